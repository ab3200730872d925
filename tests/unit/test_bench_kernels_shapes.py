"""bench/kernel_bench.py --shape: the decoder layer's projections come from the architecture's config (the 8B literal the
benchmark always used, the 32B shape for issue 14's placements), and a tuning run at one shape keeps another
shape's tuned entries (the table is one file per GPU)."""

import json

import pytest
import torch

from tests.bench_scripts import load_bench_script

kb = load_bench_script("kernel_bench")


def table_ks(proj: dict) -> set[int]:
    """The K fields of the tuned-table keys these projections tune (forward K; the dx GEMM keys by the width)."""
    return {K for K, _ in proj.values()} | {sum(widths) for _, widths in proj.values()}


def test_projection_shapes_from_the_architecture_configs():
    assert kb.projection_shapes("qwen3_8b") == kb.PROJ        # the literal every committed 8B result used
    p32 = kb.projection_shapes("qwen3_32b")
    assert p32 == {"qkv": (5120, (8192, 1024, 1024)), "o": (8192, (5120,)), "gate_up": (5120, (25600, 25600)),
                   "down": (25600, (5120,))}
    assert table_ks(kb.PROJ) == {4096, 12288, 6144, 24576}
    assert not table_ks(p32) & table_ks(kb.PROJ)         # disjoint keys: the shapes never share an entry


def test_a_tuning_run_replaces_only_the_entries_it_redid():
    """Another shape's entries, other --tune-keys', and this shape's keys a run cut by its budget never reached all
    stay (session 9's 32B run stopped before its training keys; dropping the 8B ones that way would have sent the
    engine back to heuristic tiles)."""
    old = {"w8a16|64|4096|narrow": 1, "w8a16|64|12288|narrow": 2, "w8a16T|4611686018427387904|6144|narrow": 3,
           "w8a16|64|5120|wide": 4}
    assert kb.kept_entries(old, {"w8a16|64|5120|wide"}) == {k: v for k, v in old.items() if k != "w8a16|64|5120|wide"}
    assert kb.kept_entries(old, {"w8a16|64|4096|narrow"}) == {k: v for k, v in old.items()
                                                              if k != "w8a16|64|4096|narrow"}
    assert kb.kept_entries(old, set()) == old


def test_out_defaults_by_shape_and_the_readme_table_stays_8b(capsys):
    assert kb._args([]).out.endswith("bench/results/kernels_h200.json")
    assert kb._args(["--shape", "qwen3_32b"]).out.endswith("bench/results/kernels_qwen3_32b_h200.json")
    with pytest.raises(SystemExit):
        kb._args(["--shape", "qwen3_32b", "--update-readme"])
    assert "--update-readme" in capsys.readouterr().err


def test_tuning_covers_every_token_bucket_the_engine_reaches():
    """Decode batches shrink through every bucket as sequences finish; a bucket the tuner skips runs heuristic
    tiles in the engine (session 9's records: 2560 heuristic K2 calls at 32B, buckets 32 / 128 / 512)."""
    import torch
    from rlfp8.kernels import gemm_configs as lg
    ms = kb.tune_ms()
    assert set(ms) == set(lg.M_BUCKETS) and all(lg.m_bucket(M) == b for b, M in ms.items())
    assert {ms[32], ms[128], ms[512]} == {32, 128, 512} and ms[64] == 64 and ms[lg.M_BUCKETS[-1]] == 2048
    layer = type("L", (), {"w": {n: (torch.empty(sum(w), 1),) for n, (_, w) in kb.PROJ.items()}})()
    jobs, dx = kb._tune_jobs(layer, None)
    buckets = {(mode, lg.m_bucket(M)) for mode, M, _, _ in jobs}
    assert buckets == {(mode, b) for mode in ("w8a8", "w8a16") for b in lg.M_BUCKETS}
    assert {M for mode, M, _, _ in jobs if mode == "w8a16" and lg.m_bucket(M) == lg.M_BUCKETS[-1]} == \
        {kb.TRAIN_TOKENS}
    assert len(jobs) == 2 * len(lg.M_BUCKETS) * 3 and set(dx) == set(kb.PROJ)   # 3 (K, N class) groups at 8B
    only = kb._tune_jobs(layer, "^w8a16\\|(32|128|512)\\|")[0]                 # the new buckets alone
    assert sorted({M for _, M, _, _ in only}) == [32, 128, 512] and len(only) == 9


@pytest.mark.parametrize("shape", ["qwen3_8b", "qwen3_32b"])
def test_every_w8a16_key_gets_candidates_with_its_invariant_schedule(shape):
    """The tuner times, for each W8A16 forward key, tiles on the weight shape's batch-invariant schedule (split,
    BLOCK_K, swap_ab), so invariant_gemm_config finds a measured one in the table; before, 8B gate_up at 16 tokens
    and the narrow shapes at > 512 tokens had none and ran heuristic tiles."""
    from rlfp8.kernels import gemm_configs as lg
    groups = {}
    for K, widths in kb.projection_shapes(shape).values():
        groups[(K, lg.n_class(sum(widths)))] = sum(widths)
    for (K, _), N in groups.items():
        for bucket in lg.M_BUCKETS:
            inv = kb.invariant_candidates("w8a16", bucket, N, K)
            assert inv, (shape, bucket, N, K)
            sched = lg.reduction_schedule("w8a16", N, K)
            for c in inv:
                assert lg.invariant_tile(c, sched, K), c
                assert lg.smem_bytes(c, "w8a16", 0) <= lg.SM90_MAX_SMEM, c
            keys = [c.key() for c in kb._forward_candidates("w8a16", bucket, N, K)]
            assert len(keys) == len(set(keys))
            assert any(lg.schedule_of(c) == sched and c.swap_ab
                       for c in map(lambda k: lg.GemmConfig(*k), keys))
            if bucket <= 64:      # decode: longer row chunks of the same shares, both widenings
                assert any(c.block_k > sched.block_k for c in inv) and {c.widen for c in inv} == {"bits", "prmt"}
    assert kb.invariant_candidates("w8a8", 16, 4096, 4096) == []      # W8A8 calls are not invariant by default


def test_decode_bucket_times_narrow_tiles_that_invariant_calls_never_take(tmp_path, monkeypatch):
    """The 16-token bucket's candidates include tiles of 16-32 weight rows with tokens on the M side (mma.sync) and
    512-1024-byte row chunks; a batch-invariant call must never take one (another instruction, other sums), even
    when the tuned table's candidates record it as the fastest."""
    from rlfp8.kernels import gemm_configs as lg
    cands = kb.candidates("w8a8", 16, 4096, 4096)
    narrow = [c for c in cands if c.block_n < lg.WGMMA_ROWS]
    assert narrow and all(not c.swap_ab for c in narrow)
    assert {c.block_k for c in narrow} >= {512, 1024}
    assert all(c.block_n >= lg.WGMMA_ROWS for c in kb.invariant_candidates("w8a16", 16, 4096, 4096))
    sched = lg.reduction_schedule("w8a16", 4096, 4096)
    fast_decode = lg.GemmConfig(32, 16, sched.block_k, sched.split_k, 8, 4, 4, swap_ab=True)
    slower = lg.GemmConfig(64, 16, sched.block_k, sched.split_k, 8, 4, 4, swap_ab=True)
    assert lg.schedule_of(fast_decode) == sched and not lg.invariant_tile(fast_decode, sched, 4096)
    assert lg.invariant_tile(slower, sched, 4096)
    table = {"gemm": {}, "candidates": {lg.config_key("w8a16", 16, 4096, 4096): [
        {"config": list(fast_decode.key()), "us": 1.0}, {"config": list(slower.key()), "us": 2.0}]}}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(lg, "tuned_table_path", lambda device=None: path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert lg._measured_candidate("w8a16", 16, 4096, 4096, sched, "cuda") == slower


def test_the_decode_bucket_is_timed_at_batch_one_too():
    """The 16-token bucket's candidates are timed at M = 1 and at its bound (summed): the engine's batch-1 decode
    step runs M = 1, where the same configs measured differently from M = 16 on the H200."""
    assert kb.timed_ms(16) == (1, 16) and kb.timed_ms(1) == (1,)
    assert kb.timed_ms(64) == (64,) and kb.timed_ms(kb.TRAIN_TOKENS) == (kb.TRAIN_TOKENS,)


def test_a_retune_rewrites_its_entries_in_place():
    old = {"a": 1, "b": 2, "c": 3}
    assert list(kb.in_table_order(old, {"b": 20, "d": 4}).items()) == [("a", 1), ("b", 20), ("c", 3), ("d", 4)]
