"""gemm_configs.nearest_tuned_config: a shape the tuned table lacks (Qwen3-32B's K on the H200 table's entries
tuned at Qwen3-8B's; a Llama-3-8B projection on the shipped table) takes the winner of the same mode, token
bucket and N class at the nearest K, its split-K clamped; too far a K keeps the heuristic; the choice is a
function of the table key's fields (so q/k/v row views still share the fused call's config), and on a CPU
nothing changes (no table is read)."""
import dataclasses
import json
from pathlib import Path

from rlfp8.kernels import gemm_configs as lg

SHIPPED = json.loads((Path(lg.__file__).parent / "tuned" / "nvidia_h200.json").read_text())["gemm"]
QWEN3_8B_KS = {4096, 12288, 6144, 24576}       # the forward Ks of its layer and the dx GEMMs' (q, k, v / gate, up)
H200_TABLE = {k: v for k, v in SHIPPED.items() if int(k.split("|")[2]) in QWEN3_8B_KS}   # as tuned at 8B only
QWEN3_32B = {"qkv": (5120, 10240), "o": (8192, 5120), "gate_up": (5120, 51200), "down": (25600, 5120)}
LLAMA3_8B_DOWN = (14336, 4096)                 # (K, N): a shape the shipped table has no key for


def test_32b_projections_take_the_nearest_tuned_8b_winner_of_their_bucket_and_class():
    nearest_k = {"qkv": 4096, "o": 12288, "gate_up": 4096, "down": 12288}      # |log ratio| smallest
    for mode in ("w8a16", "w8a8"):
        for M in (1, 16, 64, 256, 4096):
            for name, (K, N) in QWEN3_32B.items():
                got = lg.nearest_tuned_config(H200_TABLE, mode, M, N, K)
                key = f"{mode}|{lg.m_bucket(M)}|{nearest_k[name]}|{lg.n_class(N)}"
                if key not in H200_TABLE:          # the 8B layer has no wide weight at K = 12288
                    assert got is None, (mode, M, name)
                    continue
                want = lg.GemmConfig(**H200_TABLE[key])
                assert got == dataclasses.replace(want, split_k=max(1, min(want.split_k, K // (2 * want.block_k)))), \
                    (mode, M, name)
                assert lg.config_key(mode, M, N, K) not in H200_TABLE     # really an untuned key


def test_the_choice_depends_on_the_key_fields_only_and_the_dx_keys_stay_apart():
    a = lg.nearest_tuned_config(H200_TABLE, "w8a16", 64, 8192, 5120)       # q rows of a fused qkv
    b = lg.nearest_tuned_config(H200_TABLE, "w8a16", 64, 1024, 5120)       # k rows: same N class
    assert a == b == lg.nearest_tuned_config(H200_TABLE, "w8a16", 40, 6000, 5120)     # same bucket
    dx = lg.nearest_tuned_config(H200_TABLE, "w8a16", 8192, 5120, 10240, transposed=True)
    assert dx == lg.GemmConfig(**H200_TABLE["w8a16T|4611686018427387904|6144|narrow"])   # a T entry, not a forward one


def test_too_far_a_k_keeps_the_heuristic_ties_take_the_smaller_k_and_split_is_clamped():
    assert lg.nearest_tuned_config(H200_TABLE, "w8a16", 64, 1024, 1024) is None     # 4096 / 1024 = 4 > 3
    assert lg.nearest_tuned_config(H200_TABLE, "w8a16", 64, 1024, 1366) is not None  # 4096 / 1366 < 3
    entry = dict(block_n=64, block_m=16, block_k=256, split_k=8)
    table = {"w8a16|16|2000|narrow": {**entry, "num_warps": 4}, "w8a16|16|8000|narrow": {**entry, "num_warps": 8}}
    tie = lg.nearest_tuned_config(table, "w8a16", 16, 4096, 4000)           # ratio 2 both ways
    assert tie.num_warps == 4 and tie.split_k == min(8, 4000 // 512)
    assert lg.nearest_tuned_config(table, "w8a16", 16, 4096, 2048).split_k == 4      # 2048 // (2 * 256)
    assert lg.nearest_tuned_config(table, "w8a8", 16, 4096, 2000) is None            # another mode
    assert lg.nearest_tuned_config(table, "w8a16", 64, 4096, 2000) is None           # another bucket
    assert lg.nearest_tuned_config(table, "w8a16", 16, 16384, 2000) is None          # another N class


def test_on_a_cpu_the_heuristic_runs_and_says_so():
    for name, (K, N) in QWEN3_32B.items():
        assert lg.config_source("w8a16", 64, N, K, "cpu") == "heuristic"
        assert lg.gemm_config("w8a16", 64, N, K, "cpu") == lg._heuristic("w8a16", 64, N, K)


def test_the_knob_turns_the_fallback_on_for_a_named_gpu_and_the_source_says_so():
    from rlfp8.kernels.knobs import restore_knobs, set_knobs
    K, N = LLAMA3_8B_DOWN
    assert lg.config_key("w8a16", 64, N, K) not in SHIPPED
    saved = set_knobs(tuned_gpu="NVIDIA H200")
    try:           # the table is read for a CUDA device name; nothing runs on it
        lg.reload_tuned_table()
        assert lg.config_source("w8a16", 64, N, K, "cuda") == "heuristic"             # off by default
        assert lg.config_source("w8a16", 64, 4096, 12288, "cuda") == "tuned"
        set_knobs(tuned_gpu="NVIDIA H200", tuned_nearest=True)
        assert lg.config_source("w8a16", 64, N, K, "cuda") == "nearest_tuned"
        nearest = lg.nearest_tuned_config(SHIPPED, "w8a16", 64, N, K)
        assert nearest is not None and lg.gemm_config("w8a16", 64, N, K, "cuda") == nearest
        inv = lg.invariant_gemm_config("w8a16", 64, N, K, "cuda")                     # tiles from it, schedule fixed
        sched = lg.reduction_schedule("w8a16", N, K)
        assert (inv.block_n, inv.block_m) == (nearest.block_n, nearest.block_m)
        assert (inv.split_k, inv.block_k, inv.swap_ab) == (sched.split_k, sched.block_k, True)
    finally:
        restore_knobs(saved)
        lg.reload_tuned_table()
