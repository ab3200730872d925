"""Batch invariance of K1/K2 (knob batch_invariant): the reduction schedule over K depends on the weight shape
only, never on the token count, and rows computed inside batches of different sizes come out bit-identical
(interpreter), equal to the trainer's forward on the whole batch. GPU: tests/gpu/test_plugin_gpu.py and
bench/lab/invariant_configs.py."""
import pytest
import torch

from rlfp8.kernels import dispatch, fp8, knobs
from rlfp8.kernels.gemm_configs import (GLUON_SCHEDULE, GemmConfig, ReductionSchedule, batch_invariant,
                                        invariant_gemm_config, invariant_tile, reduction_schedule, reload_tuned_table,
                                        same_sums, schedule_of, share_len)
from rlfp8.kernels.metadata import build_lora_meta
from rlfp8.kernels.projection import fp8_lora_linear
from rlfp8.kernels.shrink_triton import _pick_shrink_config

# Qwen3-8B: fused qkv / gate_up (engine) and their row views q, k/v, gate/up (trainer), o, down
SHAPES = [(6144, 4096), (4096, 4096), (1024, 4096), (24576, 4096), (12288, 4096), (4096, 12288), (256, 1024)]
TOKEN_COUNTS = sorted({*range(1, 70), *(2 ** i + d for i in range(6, 14) for d in (-1, 0, 1)), 8192})


@pytest.fixture(autouse=True)
def _restore():
    saved = knobs.set_knobs()
    yield
    knobs.restore_knobs(saved)
    reload_tuned_table()


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
@pytest.mark.parametrize("table", [None, "NVIDIA H200"], ids=["heuristic", "h200_table"])
def test_the_schedule_never_varies_with_the_token_count(mode, table):
    """Every M in 1..8192 sums over K as the shape's schedule does (SPLIT_K and the shares' boundaries; W8A8 also
    its BLOCK_K, W8A16 any chunking of the same shares: same_sums) with swap_ab and >= 64 weight rows (with the
    H200's tuned table as the GPU reads it: device "cuda" and the knob tuned_gpu), and the trainer's row views
    share the fused weight's schedule."""
    knobs.set_knobs(tuned_gpu=table, batch_invariant="on")     # "on": W8A8's K1 too
    reload_tuned_table()
    device = "cuda" if table else None
    for N, K in SHAPES:
        sched = reduction_schedule(mode, N, K)
        configs = [invariant_gemm_config(mode, M, N, K, device) for M in TOKEN_COUNTS]
        bad = [c for c in configs if not invariant_tile(c, sched, K, mode)]
        assert not bad, (N, K, sched, bad[:3])
        if mode == "w8a8":
            assert {schedule_of(c) for c in configs} == {sched}, (N, K)
        shrink = {(c.block_m, c.block_k, c.split_k)
                  for c in (_pick_shrink_config(None, M, K, 64, mode)
                            for M in TOKEN_COUNTS)}
        assert len(shrink) == 1, (N, K, shrink)
    assert reduction_schedule(mode, 6144, 4096) == reduction_schedule(mode, 1024, 4096)       # qkv vs k_proj
    assert reduction_schedule(mode, 24576, 4096) == reduction_schedule(mode, 12288, 4096)     # gate_up vs up


def test_the_tuned_configs_do_vary_with_the_token_count():
    """The property above is not vacuous: the tuned H200 configs change BLOCK_K / SPLIT_K with M."""
    knobs.set_knobs(tuned_gpu="NVIDIA H200", batch_invariant="off")
    reload_tuned_table()
    from rlfp8.kernels.gemm_configs import gemm_config
    assert len({schedule_of(gemm_config("w8a16", M, 6144, 4096, "cuda")) for M in TOKEN_COUNTS}) > 1


def test_the_wide_schedule_is_the_gluon_loops():
    """gate_up's schedule equals the Gluon main loop's, so the trainer's > 512-token calls may still take it."""
    assert reduction_schedule("w8a16", 24576, 4096) == GLUON_SCHEDULE
    gemm_rs = pytest.importorskip("rlfp8.kernels.gemm_rs")
    assert GLUON_SCHEDULE.block_k == gemm_rs.BK and GLUON_SCHEDULE.split_k == 1


def test_the_knob_selects_and_the_dispatch_records():
    assert batch_invariant("w8a16") and not batch_invariant("w8a8")            # auto
    assert not batch_invariant("w8a16", transposed=True)                        # the backward's dx GEMM
    knobs.set_knobs(batch_invariant="on")
    assert batch_invariant("w8a8")
    knobs.set_knobs(batch_invariant="off")
    assert not batch_invariant("w8a16")
    with pytest.raises(ValueError, match=r"batch_invariant='yes'.*\('auto', 'on', 'off'\)"):
        knobs.set_knobs(batch_invariant="yes")
    with pytest.raises(ValueError, match="RLFP8_BATCH_INVARIANT='1'"):
        knobs._env_overrides({"RLFP8_BATCH_INVARIANT": "1"})
    assert knobs.apply_config({"batch_invariant": "on"}).batch_invariant == "on"


@pytest.fixture
def shape_invariant_dot(monkeypatch):
    """The interpreter's tl.dot is one np.matmul in fp32, whose BLAS changes its summation order with the tile's
    shape, so tiles of 16 and 64 tokens would differ for that reason alone (numpy, not the kernels). The GPU's
    model instead: each dot's products are exact and its sum does not depend on the tile's other rows and
    columns: here the dot in fp64 (exact for these operands: bf16 x bf16 products, <= 256 terms), added to the
    accumulator and rounded to fp32 once. What the kernels decide stays visible: which chunks of K, in which
    order, form each partial, and the split-order sum of the partials."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    from tests import triton_interp_patch as patch
    plain = interp.InterpreterBuilder.create_dot

    def widened(h):
        sc = h.dtype.scalar
        if sc == tl.bfloat16 or (sc.is_floating() and sc.primitive_bitwidth == 8):
            return patch._to_torch(h.data, patch._TL2TORCH[sc]).double().numpy()
        return h.data.astype(np.float64)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if d.data.dtype != np.float32 or not (a.dtype.scalar.is_floating() and b.dtype.scalar.is_floating()):
            return plain(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = np.matmul(widened(a), widened(b)) + d.data.astype(np.float64)
        return interp.TensorHandle(acc.astype(np.float32), d.dtype.scalar)

    monkeypatch.setattr(interp.InterpreterBuilder, "create_dot", dot)


def _layer(K, widths, S, r, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, sw = fp8.quantize_weight_ref(torch.randn(sum(widths), K, generator=g) * 0.05)
    A = tuple((torch.randn(S, r, K, generator=g) * 0.1).to(torch.bfloat16) for _ in widths)
    B = tuple((torch.randn(S, n, r, generator=g) * 0.1).to(torch.bfloat16) for n in widths)
    x = torch.randn(64, K, generator=g).to(torch.bfloat16)
    return x, q, sw, A, B


def _rows_in_batches(x, q, sw, A, B, S, slot, sizes):
    """The engine's outputs (fp32, so no rounding hides an order change) of rows 0..max(sizes)-1 of the trainer's
    slot, each computed inside a batch of every size in `sizes` (other tenants and no-adapter rows beside them)."""
    per_size = {}
    for m in sizes:
        slots = torch.full((m,), slot, dtype=torch.int32)
        slots[1::3] = (slot + 1) % S
        slots[2::5] = -1
        y = fp8_lora_linear(x[:m], q, sw, A, B, build_lora_meta(slots, S), mode="w8a16", out_dtype=torch.float32)
        per_size[m] = {i: y[i] for i in range(m) if slots[i] == slot}
    return per_size


def _differing_rows(per_size):
    ref = per_size[max(per_size)]
    return sorted({i for rows in per_size.values() for i, y in rows.items() if not torch.equal(y, ref[i])})


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (the GPU runs tests/gpu)")
def test_rows_are_bit_identical_inside_batches_of_1_3_17_64(shape_invariant_dot):
    """Under the interpreter: K1 and K2 in invariant mode give each row the same bits in batches of 1, 3, 17 and
    64 tokens (the tuned configs of those sizes split K differently: the same rows then differ)."""
    K, widths, S, r, slot = 1024, (128, 64, 64), 3, 16, 1
    x, q, sw, A, B = _layer(K, widths, S, r)
    dispatch.reset_report()
    with dispatch.use_backend("triton"):
        knobs.set_knobs(batch_invariant="on")
        assert _differing_rows(_rows_in_batches(x, q, sw, A, B, S, slot, (1, 3, 17, 64))) == []
        ran = dispatch.report()
        assert ran["lora_gemm.schedule"] == {"batch_invariant": 4} and ran["lora_shrink.schedule"] == \
            {"batch_invariant": 4}, ran
        knobs.set_knobs(batch_invariant="off")
        assert _differing_rows(_rows_in_batches(x, q, sw, A, B, S, slot, (17, 64))) != []
        assert dispatch.report()["lora_gemm.schedule"]["tuned"] == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (the GPU runs tests/gpu)")
def test_engine_chunks_equal_the_trainers_forward(shape_invariant_dot):
    """The matched property at any chunk size (interpreter): the trainer's FP8 linear on the whole batch of 64
    rows (lora_linear_triton: K1 then K2 with meta=None) and the engine's fused call on chunks of 1 and 17 rows
    give the trainer's rows the same bf16 bits."""
    from rlfp8.kernels.linear import lora_linear
    K, N, S, r, slot = 1024, 128, 3, 16, 2
    x, q, sw, A, B = _layer(K, (N,), S, r, seed=1)
    a, b, scale = A[0][slot].float(), B[0][slot].float(), 1.0      # B already in bf16: s·B exact with s = 1
    with dispatch.use_backend("triton"), torch.no_grad():
        y_tr = lora_linear(x, q, sw, a, b, scale)
        for chunk in (1, 17):
            for start in range(0, 64, chunk):
                m = min(chunk, 64 - start)
                slots = torch.full((m,), slot, dtype=torch.int32)
                slots[1::4] = -1
                y = fp8_lora_linear(x[start:start + m], q, sw, A, B, build_lora_meta(slots, S), mode="w8a16")
                sel = slots == slot
                assert torch.equal(y[sel], y_tr[start:start + m][sel]), (chunk, start)


def test_same_sums_allows_w8a16_chunkings_that_keep_the_shares():
    """W8A16: a BLOCK_K that is a multiple of the schedule's and keeps the shares' boundaries adds the same products
    in the same order (k16 wgmma steps in k order per share); another split, a BLOCK_K that moves a boundary or does
    not divide into the schedule's chunks does not. W8A8 keeps the schedule's BLOCK_K."""
    narrow, wide = ReductionSchedule(2, 128), ReductionSchedule(1, 64)
    cfg = lambda bk, split=2: GemmConfig(64, 16, bk, split, 8, 4, 3)
    for bk in (128, 256, 512, 1024):                                   # Qwen3-8B qkv / o (K 4096), down (K 12288)
        assert same_sums(cfg(bk), narrow, 4096) and same_sums(cfg(bk), narrow, 12288)
    assert share_len(25600, 2, 128) == 12800 and share_len(25600, 2, 1024) == 13312
    assert same_sums(cfg(512), narrow, 25600) and not same_sums(cfg(1024), narrow, 25600)   # Qwen3-32B down
    assert not same_sums(cfg(64), narrow, 4096)                        # 64 is not a multiple of the chunks
    assert not same_sums(cfg(192), narrow, 4096)
    assert not same_sums(cfg(256, split=4), narrow, 4096)               # another split
    for bk in (64, 128, 512, 1024):                                     # one share: any multiple of 64
        assert same_sums(cfg(bk, split=1), wide, 5120)
    assert not same_sums(cfg(256), narrow, 4096, mode="w8a8") and same_sums(cfg(128), narrow, 4096, mode="w8a8")
    assert invariant_tile(cfg(512), narrow, 4096)
    assert not invariant_tile(GemmConfig(32, 16, 512, 2, 8, 4, 3), narrow, 4096)               # mma.sync tile
    assert not invariant_tile(GemmConfig(64, 16, 512, 2, 8, 4, 3, swap_ab=False), narrow, 4096)
