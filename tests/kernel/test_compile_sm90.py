"""Every Triton kernel of rlfp8.kernels compiles for sm_90a (GPUTarget("cuda", 90, 32)) with the configs
the host code uses on an H200, without a GPU: in a subprocess without TRITON_INTERPRET (the interpreter
replaces @triton.jit at decoration time). Checks what the interpreter cannot: wgmma in the GEMMs (the
widened FP8 tile as wgmma's register A operand in W8A16), IEEE division and the saturating e4m3 cast in
the quantizers, the PDL instructions where asked, and shared memory within the sm_90 limit; from the cubin
(cuobjdump, bundled with Triton): no F2F conversion in the W8A16 MMA loops and no register spills where
occupancy matters."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlfp8.kernels.gemm_triton import K1_IN_K2_REGS

ROOT = Path(__file__).resolve().parents[2]
SMEM_MAX = 232448


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["RLFP8_TUNED_GPU"] = env.get("RLFP8_TUNED_GPU", "NVIDIA H200")   # include a committed tuned table
    p = subprocess.run([sys.executable, "-m", "tests.kernel.sm90_compile_worker", "--jobs", "2"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-5000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    return [r for r in rows if "event" not in r]


def test_all_kernels_compile(compiled):
    names = {r["name"] for r in compiled}
    assert names == {"_quant_rows_kernel", "_lora_shrink_kernel", "_lora_gemm_kernel", "_dy_prep_kernel",
                     "_lora_gemm_rs_kernel", "_norm_pieces_kernel", "_col_dot_kernel"}, names
    failed = [f"{r['name']} {r.get('constexprs')}: {r['error']}" for r in compiled if not r["ok"]]
    assert not failed, "\n".join(failed)
    too_big = [(r["name"], r["shared"], r["constexprs"]) for r in compiled if r["shared"] > SMEM_MAX]
    assert not too_big, too_big


def test_gemms_use_wgmma_with_register_a_in_w8a16(compiled):
    """swap_ab GEMMs (weight rows on the M side) run wgmma, in W8A16 with the widened tile as its register
    operand; the other orientation runs wgmma from shared memory at >= 64-token tiles and mma.sync below. (K2 grids
    with K1's programs also hold K1's 16-row mma.sync shrink: checked below, not here.)"""
    gemms = [r for r in compiled if r["name"] == "_lora_gemm_kernel" and not r["constexprs"]["K1_PROGRAMS"]]
    assert len(gemms) >= 20
    swap = [r for r in gemms if r["constexprs"]["SWAP_AB"]]
    noswap = [r for r in gemms if not r["constexprs"]["SWAP_AB"]]
    assert len(swap) >= 20 and len(noswap) >= 6
    assert all(r["wgmma"] and not r["mma_sync"] for r in swap), [r["constexprs"] for r in swap if not r["wgmma"]]
    w8a16 = [r for r in swap if r["constexprs"]["WIDEN_W"]]
    assert w8a16 and all(r["wgmma_reg_a"] for r in w8a16)
    for r in noswap:
        big = r["constexprs"]["BLOCK_M"] >= 64
        assert r["wgmma"] if big else r["mma_sync"], r["constexprs"]    # (the LoRA epilogue may add a wgmma)
    assert any(r["constexprs"]["SCALE_W"] == 0 for r in w8a16)          # the backward dx kernel (no scale)
    assert any(r["constexprs"]["SCALE_W"] == 0 and r["constexprs"]["WIDEN_W"] for r in noswap)
    assert {r["constexprs"]["N_SLICES"] for r in gemms if r["constexprs"]["HAS_LORA"]} == {1, 2, 3}
    assert any(r["constexprs"]["SPLIT_K"] > 1 for r in gemms)
    tma = [r for r in gemms if r["constexprs"]["W_TMA"]]
    assert len(tma) >= 6 and all(r["tma"] for r in tma) and not any(r["tma"] for r in gemms if r not in tma)
    x_tma = [r for r in gemms if r["constexprs"]["X_TMA"]]
    assert len(x_tma) >= 4 and all(r["tma"] for r in x_tma)
    assert {r["constexprs"]["SWAP_AB"] for r in x_tma} == {True, False}     # both orientations
    assert any(r["constexprs"]["W_TMA"] == 2 for r in gemms)          # the backward's transposed codes
    big_shrinks = [r for r in compiled if r["name"] == "_lora_shrink_kernel" and r["constexprs"]["BLOCK_M"] >= 64]
    assert big_shrinks and all(r["wgmma"] for r in big_shrinks)


def test_quantizers_ieee_division_and_saturating_cast(compiled):
    """Bit-exactness with vLLM's CUDA op rests on IEEE division: `/` on fp32 in Triton is div.full.f32 (2 ulp),
    so the quantizers use div_rn; no approximate division or reciprocal may appear anywhere in them."""
    quant = [r for r in compiled if r["name"] == "_quant_rows_kernel"
             or (r["name"] == "_lora_shrink_kernel" and r["constexprs"]["QUANT"])]
    assert {r["constexprs"]["QUANT" if "QUANT" in r["constexprs"] else "ROUNDING"] for r in quant} >= {1, 2}
    in_k2 = [r for r in compiled if r["name"] == "_lora_gemm_kernel" and r["constexprs"]["QUANT_X"]]
    assert {r["constexprs"]["QUANT_X"] for r in in_k2} == {1, 2}           # K2 quantizing x (W8A8 decode)
    assert any(r["constexprs"]["HAS_LORA"] and r["constexprs"]["USE_PDL"] for r in in_k2)
    quant += [r for r in in_k2 if r["constexprs"]["QUANT_X"] == 1]
    for r in quant:
        assert r["div_rn"] and not r["div_full"] and not r["div_approx"] and r["cvt_e4m3"], r


def test_w8a16_widening_avoids_f2f(compiled):
    """W8A16 bf16 kernels widen e4m3 with one of the bit tricks (no F2F, 16/clk/SM on sm_90) in their MMA main
    loop: "bits" (cvt to f16x2 + integer ops + fma) or "prmt" (byte permute + integer ops + mul, no cvt);
    Triton's own cast (widen="cvt") has one F2F per weight element there."""
    gemms = [r for r in compiled if r["name"] == "_lora_gemm_kernel" and r["constexprs"]["WIDEN_W"]]
    bits = [r for r in gemms if r["constexprs"]["WIDEN_ASM"] == 1]
    prmt = [r for r in gemms if r["constexprs"]["WIDEN_ASM"] == 2]
    dx = [r for r in gemms if r["constexprs"]["SCALE_W"] == 0]         # the backward's: the same widenings
    cvt = [r for r in gemms if not r["constexprs"]["WIDEN_ASM"]]
    assert len(bits) >= 20 and len(prmt) >= 3 and cvt and dx and all(r["constexprs"]["WIDEN_ASM"] for r in dx)
    assert all(r["widen_bits"] for r in bits)
    assert all(r["widen_prmt"] for r in prmt)
    if "mma_loop_f2f" in bits[0]:                                      # cuobjdump available (bundled)
        assert all(r["mma_loop_f2f"] == 0 for r in bits + prmt + dx), [
            (r["constexprs"], r["mma_loop_f2f"]) for r in bits + prmt + dx if r["mma_loop_f2f"]]
        assert all(r["mma_loop_f2f"] > 0 for r in cvt)


def test_no_register_spills_where_occupancy_matters(compiled):
    """K1 (shrink + quantization), every base GEMM and every decode-size K2 (BLOCK_M <= 32) keep their state
    in registers (the spill stack of the cubin is 0); K2 with the LoRA epilogue is checked for the slot
    variants: the multi-adapter pipeline appears, and the one-adapter variant stays within 168 registers at
    64-token tiles of 4 warps (3 programs per SM)."""
    rows = [r for r in compiled if "stack" in r]
    if not rows:
        pytest.skip("cuobjdump not available")
    k1 = [r for r in rows if r["name"] == "_lora_shrink_kernel"]
    assert any(r["constexprs"]["MASK_ROWS"] for r in k1) and any(r["constexprs"]["BR_BLOCK"] == 16 for r in k1)
    base = [r for r in rows if r["name"] == "_lora_gemm_kernel" and not r["constexprs"]["HAS_LORA"]]
    small = [r for r in rows if r["name"] == "_lora_gemm_kernel" and r["constexprs"]["BLOCK_M"] <= 32]
    prep = [r for r in rows if r["name"] == "_dy_prep_kernel"]
    for r in k1 + base + small + prep:
        assert r["stack"] == 0, (r["name"], r["constexprs"], r["regs"], r["stack"])
    lora = [r for r in rows if r["name"] == "_lora_gemm_kernel" and r["constexprs"]["HAS_LORA"]]
    assert {r["constexprs"]["PIPE_SLOTS"] for r in lora if not r["constexprs"]["ALL_SLOT0"]} == {True, False}
    one = [r for r in lora if not r["constexprs"]["PIPE_SLOTS"] and not r["constexprs"]["ALL_SLOT0"]
           and r["constexprs"]["BLOCK_M"] == 64 and r["constexprs"]["BLOCK_N"] == 64 and r["num_warps"] == 4]
    assert len(one) >= 2 and all(r["regs"] <= 168 for r in one), [(r["constexprs"], r["regs"]) for r in one]


def test_large_rank_training_linear_keeps_its_tiles_without_spills(compiled):
    """Issue 16: at ranks 384 and 512 (BLOCK_R 512) the training linear's kernels with the H200's configs
    (sm90_compile_worker.large_rank_launch) have no spill stack: K2's forward (with and without DoRA's g), its dx
    GEMM and the engine's K2 (per-slot loop and PIPE_SLOTS) multiply h·Bᵀ in rank chunks, K1 runs the ranks in
    blocks of 128 per program, dy_prep keeps the whole rank. K2's 4096-token forward keeps the 256-token tile and
    the main loop's stages it has at rank 64 (fit_smem sized the epilogue by the chunk, not the whole rank)."""
    rows = [r for r in compiled if "stack" in r and r["constexprs"].get("BLOCK_R") == 512
            and r["name"] in ("_lora_gemm_kernel", "_lora_shrink_kernel", "_dy_prep_kernel")]
    if not rows:
        pytest.skip("cuobjdump not available")
    k2 = [r for r in rows if r["name"] == "_lora_gemm_kernel"]
    assert {(r["constexprs"]["ALL_SLOT0"], r["constexprs"]["PIPE_SLOTS"]) for r in k2} == {
        (True, False), (False, False), (False, True)}
    assert any(r["constexprs"]["HAS_G"] for r in k2) and any(r["constexprs"]["SCALE_W"] == 0 for r in k2)
    assert {r["name"] for r in rows} == {"_lora_gemm_kernel", "_lora_shrink_kernel", "_dy_prep_kernel"}
    spilled = [(r["name"], r["constexprs"], r["regs"], r["stack"]) for r in rows if r["stack"] != 0]
    assert not spilled, spilled
    # (BLOCK_M, stages) as at rank 64 (the forward's invariant config, the dx GEMM's tuned-or-heuristic one)
    for scale_w, transposed in ((1, False), (0, True)):
        want = _h200_w8a16_tiles_at_rank_64(4096, 8192, 8192, transposed)
        got = {(r["constexprs"]["BLOCK_M"], r["num_stages"]) for r in k2
               if r["constexprs"]["ALL_SLOT0"] and r["constexprs"]["SCALE_W"] == scale_w}
        assert got == {want}, (scale_w, got, want)


def _h200_w8a16_tiles_at_rank_64(M, N, K, transposed):
    """(BLOCK_M, num_stages) K2 takes at rank 64 on an H200 (the committed tuned table): what the worker's
    h200_w8a16_config picks, computed here in the test process (config choice is host code)."""
    from rlfp8.kernels import gemm_triton
    from rlfp8.kernels.gemm_configs import SM90_MAX_SMEM, fit_smem
    from rlfp8.kernels.knobs import restore_knobs, set_knobs
    q = torch.empty(K, N, dtype=torch.float8_e4m3fn).t() if transposed else torch.empty(N, K, dtype=torch.float8_e4m3fn)
    old = set_knobs(tuned_gpu="NVIDIA H200")
    try:
        cfg, _ = gemm_triton._pick_config(None, "w8a16", M, N, K, q, torch.device("cuda"))
    finally:
        restore_knobs(old)
    cfg = fit_smem(cfg, "w8a16", 64, SM90_MAX_SMEM)
    return cfg.block_m, cfg.num_stages


def test_pdl_wait_point_present_only_when_asked(compiled):
    """K1 (shrink, with and without the W8A8 quantization programs) triggers its dependent and is itself a
    plain launch (it has no wait); K2 waits and is the one launched with launch_pdl; in W8A8 with K1's x_q it
    asks L2 for its weight rows before the early wait (unless they come through TMA); in W8A8 with x quantized before K1 it waits at the
    epilogue, as W8A16. The quantizer with USE_PDL (knob pdl_quant_k2) triggers its dependent as K1 does, and K1
    in 16-rank programs (knob k1_decode_rank_block) too. Without USE_PDL none of it, and no timeline stamp
    anywhere."""
    pdl = [r for r in compiled if r["constexprs"].get("USE_PDL")]
    assert {r["name"] for r in pdl} == {"_lora_shrink_kernel", "_lora_gemm_kernel", "_quant_rows_kernel"}
    quant = [r for r in pdl if r["name"] == "_quant_rows_kernel"]
    assert all(r["gdc_launch"] and not r["gdc_wait"] and not r["launch_pdl"] for r in quant), quant
    k1 = [r for r in pdl if r["name"] == "_lora_shrink_kernel"]
    assert any(r["constexprs"]["BR_BLOCK"] == 16 for r in k1)
    k2 = [r for r in pdl if r["name"] == "_lora_gemm_kernel"]
    assert {r["constexprs"]["QUANT"] for r in k1} == {0, 1} and any(r["constexprs"]["SPLIT_K"] > 1 for r in k1)
    assert all(r["gdc_launch"] and not r["gdc_wait"] and not r["launch_pdl"] for r in k1), k1
    assert all(r["gdc_wait"] and not r["gdc_launch"] and r["launch_pdl"] for r in k2), k2
    early = [r for r in k2 if r["constexprs"]["PDL_WAIT_EARLY"]]
    assert len(early) >= 2 and all(r["constexprs"]["HAS_XS"] for r in early)
    assert any(r["constexprs"]["PDL_WAIT_EARLY"] == 2 for r in early)
    assert all(r["l2_prefetch"] == (r["constexprs"]["PDL_WAIT_EARLY"] == 2) for r in early)
    # the prefetch reads the codes' own pointer, so TMA tiles take it too (their rows are row-major and aligned)
    assert all(r["constexprs"]["PDL_WAIT_EARLY"] == 2 for r in early)
    assert any(r["constexprs"]["W_TMA"] for r in early)
    assert all(not r["l2_prefetch"] for r in k2 if r not in early)
    assert len([r for r in k2 if r["constexprs"]["HAS_XS"] and r not in early]) >= 2     # W8A8, x quantized apart
    others = [r for r in compiled if not r["constexprs"].get("USE_PDL")]
    assert not any(r["gdc_wait"] or r["gdc_launch"] or r["launch_pdl"] for r in others)
    assert not any(r["l2_prefetch"] for r in others if r["name"] == "_lora_gemm_kernel")
    assert not any(r["globaltimer"] for r in compiled)


def test_w8a16_register_a_loops_retire_wgmmas_before_the_next_widening(compiled):
    """K2's W8A16 swap_ab loops read the widened tile as wgmma's register operand, asynchronously: each k-step
    waits for its wgmmas (WARPGROUP.DEPBAR.LE gsb0, 0x0 in the loop, none left in flight) before the next
    widening writes registers (SYNC_A; without it the H200 gave garbage tiles at 8192 tokens with a bias)."""
    loops = [r for r in compiled if r["name"] == "_lora_gemm_kernel" and r["constexprs"]["WIDEN_W"]
             and r["constexprs"]["SWAP_AB"]]
    assert len(loops) >= 10
    for r in loops:
        assert r["constexprs"]["SYNC_A"], r["constexprs"]
        assert r["mma_loop_wgmma_waits"] == [0], (r["mma_loop_wgmma_waits"], r["constexprs"])


def test_gluon_main_loop_pipelined_without_spills(compiled):
    """lora_gemm_rs (Gluon, warp-specialized, register-A wgmma): every variant the dispatch can pick (forward
    with LoRA ranks 16/64 in one piece and 96/384/512 in rank chunks, with bias, with DoRA's g; dx GEMM on the
    transposed codes, also in rank chunks; base GEMM) compiles for sm_90a with TMA loads, no register spills,
    no ptxas "wgmma serialized" warning (C751x: the register-set alternation and the peeled first steps are
    what avoid them) and a main loop that keeps one wgmma group in flight."""
    rs = [r for r in compiled if r["name"] == "_lora_gemm_rs_kernel"]
    assert len(rs) >= 9, [r["constexprs"] for r in rs]
    assert {r["constexprs"]["TRANS_Q"] for r in rs} == {True, False}
    lora = [r["constexprs"] for r in rs if r["constexprs"]["HAS_LORA"]]
    assert {c["BR"] for c in lora} >= {16, 64, 128, 512}
    assert {c["BR"] for c in lora if c["TRANS_Q"]} >= {64, 128, 512}
    assert {c["BR"] for c in lora if c["HAS_G"]} >= {64, 512} and not any(c["HAS_G"] and c["TRANS_Q"] for c in lora)
    assert any(not r["constexprs"]["HAS_LORA"] for r in rs) and any(r["constexprs"]["HAS_BIAS"] for r in rs)
    # the LoRA epilogue's shared-memory wgmmas (two MMA partitions, k16 each): hi and lo over BR in one piece, or
    # one unrolled pair of rank chunks of 32 (gemm_rs._lora_rank_chunks), hi and lo each
    for r in rs:
        c = r["constexprs"]
        want = 0 if not c["HAS_LORA"] else 2 * 2 * (c["BR"] // 16 if c["BR"] <= 64 else 2 * 32 // 16)
        assert r["wgmma_smem_a"] == want, (r["wgmma_smem_a"], want, c)
    for r in rs:
        assert r["ok"] and r["tma"] and r["wgmma_reg_a"], r
        assert r.get("stack", 0) == 0, f"spills: {r}"
        assert r["wgmma_serialized"] == [], f"ptxas serializes the wgmmas: {r['wgmma_serialized']} {r['constexprs']}"
        assert 1 in r["wgmma_wait_depths"], f"no wgmma left in flight: {r['wgmma_wait_depths']} {r['constexprs']}"


def test_timeline_stamps_compile_for_the_benchmark():
    """bench/pdl_timeline.py's stamped K1/K2 (rlfp8.kernels.timeline enabled) compile for sm_90a with the
    %globaltimer reads, in both modes (the PDL decode pairs at 64 tokens)."""
    code = (
        "import json\n"
        "from rlfp8.kernels import timeline\n"
        "timeline.enable(1 << 40)\n"
        "from rlfp8.kernels import _triton_utils as tu\n"
        "import tests.kernel.sm90_compile_worker as w\n"
        "with tu.collect_launches() as rec:\n"
        "    w._rank_and_pdl_launches()\n"
        "for i, (k, g, a, kw) in enumerate(w._distinct(rec)[-4:]):\n"
        "    r = w._check((i, tu.jit_spec(k, a, kw)))\n"
        "    print(json.dumps(dict(name=r['name'], ok=r['ok'], err=r.get('error'), stamps=r.get('globaltimer'))))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-5000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert {r["name"] for r in rows} == {"_lora_shrink_kernel", "_lora_gemm_kernel"}
    assert all(r["ok"] and r["stamps"] for r in rows), rows


def test_k1_in_k2_grids_compile_without_spills(compiled):
    """Knob k1_in_k2: K2 with K1's programs in its grid compiles for every projection at decode sizes, no
    spill stack; W8A16 is a plain launch (no wait: the counter replaces it), W8A8 the quantizer's dependent (L2
    prefetch of its weight rows, TMA tiles too, then the wait before its main loop)."""
    fused = [r for r in compiled if r["name"] == "_lora_gemm_kernel" and r["constexprs"]["K1_PROGRAMS"]]
    assert len(fused) >= 8 and all(r["stack"] == 0 for r in fused), fused
    # gemm_triton._one_wave counts programs per SM with K1_IN_K2_REGS registers per thread: never fewer than used
    over = [(r["regs"], r["constexprs"]["WIDEN_W"]) for r in fused
            if r["regs"] > K1_IN_K2_REGS["w8a16" if r["constexprs"]["WIDEN_W"] else "w8a8",
                                         r["constexprs"]["PREFETCH_EPI"]]]
    assert not over, over
    assert {r["constexprs"]["K1_SPLIT_K"] for r in fused} >= {8, 16}        # W8A8's decode split (down: 16)
    assert all(r["constexprs"]["K1_RED_UNROLL"] for r in fused)
    w8a16 = [r for r in fused if r["constexprs"]["WIDEN_W"]]
    assert w8a16 and all(not r["gdc_wait"] and not r["launch_pdl"] for r in w8a16)
    w8a8 = [r for r in fused if r["constexprs"]["HAS_XS"]]
    assert w8a8 and all(r["gdc_wait"] and r["launch_pdl"] and r["l2_prefetch"] for r in w8a8)
    assert any(r["constexprs"]["W_TMA"] for r in w8a8)                         # down's tile (weights through TMA)


def test_prefetched_epilogues_compile_without_spills(compiled):
    """Knob k2_prefetch_epilogue: K2 at decode sizes with its epilogue's scales, slots and first B tile loaded before
    the main loop (the tile held in registers across it), after it, or split, has no spill stack with the H200's
    decode configs of every projection (tuned, and W8A16's batch-invariant ones), W8A8 and W8A16, K1's programs in
    its grid or not, the padding rows masked (1 token) or not (16)."""
    k2 = [r for r in compiled if r["name"] == "_lora_gemm_kernel" and "stack" in r]
    if not k2:
        pytest.skip("cuobjdump not available")
    pre = [r for r in k2 if r["constexprs"]["PREFETCH_EPI"]]
    spilled = [(r["constexprs"], r["regs"], r["stack"]) for r in pre if r["stack"] != 0]
    assert len(pre) >= 3 * 48 and not spilled, spilled
    assert {r["constexprs"]["PREFETCH_EPI"] for r in pre} == {1, 2, 3}
    one_adapter = [r["constexprs"] for r in pre if r["constexprs"]["HAS_LORA"] and not r["constexprs"]["ALL_SLOT0"]
                   and not r["constexprs"]["PIPE_SLOTS"] and r["constexprs"]["BLOCK_R"] == 64]
    assert {c["N_SLICES"] for c in one_adapter} == {1, 2, 3}
    for key in ("WIDEN_W", "K1_PROGRAMS", "MASK_ROWS", "SWAP_AB", "USE_PDL"):
        assert {bool(c[key]) for c in one_adapter} == {True, False}, key
    assert {c["SPLIT_K"] for c in one_adapter} >= {1, 2, 4}
