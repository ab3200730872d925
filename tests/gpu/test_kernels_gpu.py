"""GPU tier for rlfp8.kernels (marked gpu; skipped without CUDA). Qwen3-8B projection shapes, tokens
M in {1, 7, 16, 33, 128, 1000, 4096}, ranks 16/64/128, 1/4/32 adapters with some tokens without adapter,
both engine modes: kernels against fp64 math; quantization bit-equal to the references (CUDA and CPU), to
IEEE amax/448 and to vLLM's dynamic_per_token_scaled_fp8_quant; the matched property (engine W8A16 call and
trainer forward bit-identical on the same rows); the two W8A16 widenings, the two multi-adapter epilogue
variants, the two split-K reductions (distributed over the tile's programs, or by its last program; also
in CUDA-graph replays with PDL) and the W8A16 BLOCK_K chunkings of one reduction schedule bit-identical; the Gluon
main loop (gemm_rs, > 512 tokens without metadata) bit-identical to the Triton kernel for the forward (with DoRA's
g; ranks up to 512 in rank chunks) and dx GEMMs; the training linear's forward and backward against LoRALinearRef,
with allocation sizes showing that no weight is copied.

All kernels the cases need are compiled up front in parallel (rlfp8.kernels._triton_utils.precompile), so
the module runs in about a minute or two on an H200:
    python -m pytest tests/gpu/test_kernels_gpu.py -m gpu -v -s
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch

from rlfp8.kernels import _triton_utils as tu
from rlfp8.kernels import dispatch, fp8
from rlfp8.kernels.fp8_triton import quantize_activation_triton, quantize_weight_triton
from rlfp8.kernels.gemm_configs import gemm_config
from rlfp8.kernels.gemm_ref import lora_gemm_ref
from rlfp8.kernels.gemm_triton import lora_gemm_triton
from rlfp8.kernels.knobs import restore_knobs, set_knobs
from rlfp8.kernels.linear_ref import LoRALinearRef
from rlfp8.kernels.linear_triton import lora_linear_triton
from rlfp8.kernels.metadata import build_lora_meta
from rlfp8.kernels.projection import fp8_lora_linear
from rlfp8.kernels.shrink_triton import lora_shrink_triton
from tests.conftest import rel_err
from tests.oracles import gemm_fp64, quant_scale_fp64, shrink_fp64

pytestmark = pytest.mark.gpu

SHAPES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (12288, 12288)),
          "down": (12288, (4096,))}
# (shape, M, rank, adapters, mode): every shape, M, rank, adapter count and mode at least once
CASES = [
    ("qkv", 1, 64, 1, "w8a16"), ("qkv", 7, 16, 4, "w8a8"), ("qkv", 33, 128, 32, "w8a16"),
    ("qkv", 1000, 64, 4, "w8a8"), ("qkv", 4096, 16, 1, "w8a16"), ("qkv", 128, 64, 32, "w8a8"),
    ("o", 16, 64, 32, "w8a8"), ("o", 128, 16, 1, "w8a16"), ("o", 4096, 128, 4, "w8a8"), ("o", 1, 128, 4, "w8a16"),
    ("gate_up", 7, 128, 1, "w8a16"), ("gate_up", 128, 64, 32, "w8a8"), ("gate_up", 1000, 16, 4, "w8a16"),
    ("gate_up", 33, 64, 4, "w8a8"), ("gate_up", 16, 16, 1, "w8a16"),
    ("down", 1, 16, 32, "w8a8"), ("down", 16, 128, 4, "w8a16"), ("down", 33, 64, 1, "w8a8"),
    ("down", 4096, 64, 32, "w8a16"), ("down", 128, 128, 1, "w8a8"), ("down", 1000, 64, 1, "w8a16"),
]
MATCHED = [("qkv", 16), ("o", 128), ("gate_up", 33), ("down", 1000), ("o", 4096)]
TRAIN = [("qkv", 1024), ("o", 1024), ("gate_up", 1024), ("down", 1024)]
BATCH_INVARIANT = ("on", "off")            # the training linear under both settings of the knob
DEV = "cuda"


def _weights(shape, seed=0):
    K, widths = SHAPES[shape]
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(sum(widths), K, device=DEV, generator=g, dtype=torch.bfloat16) * 0.02
    q, sw = fp8.quantize_weight_ref(w)
    return K, widths, q, sw


def _adapters(K, widths, S, r, seed=1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    A = [torch.randn(S, r, K, device=DEV, generator=g).mul_(0.02).to(torch.bfloat16) for _ in widths]
    B = [torch.randn(S, n, r, device=DEV, generator=g).mul_(0.05).to(torch.bfloat16) for n in widths]
    return A, B


def _slots(M, S, seed=2):
    g = torch.Generator(device=DEV).manual_seed(seed)
    slots = torch.randint(0, S, (M,), device=DEV, generator=g)
    slots[torch.rand(M, device=DEV, generator=g) < 0.2] = -1            # some tokens carry no adapter
    if M > 1:
        slots[0] = -1
    return slots


def _case_inputs(shape, M, r, S):
    K, widths, q, sw = _weights(shape)
    A, B = _adapters(K, widths, S, r)
    slots = _slots(M, S)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    N = sum(widths)
    bias = torch.randn(N, device=DEV, dtype=torch.bfloat16) * 0.1
    return x, q, sw, A, B, slots, build_lora_meta(slots, S), bias


def _reference(x, q, sw, A, B, slots, bias, mode):
    """fp64 oracle: (s_x·)s_w·(x·qᵀ) + h·B_slotᵀ + bias, h = x·A_slotᵀ (h from 16-bit x)."""
    h = shrink_fp64(x, A, slots)
    if mode == "w8a8":
        xq, xs = fp8.quantize_activation_ref(x)
        return gemm_fp64(xq, q, sw, x_scale=xs, h=h, B=B, slots=slots, bias=bias), h
    return gemm_fp64(x, q, sw, h=h, B=B, slots=slots, bias=bias), h


def _run_case(shape, M, r, S, mode):
    x, q, sw, A, B, slots, meta, bias = _case_inputs(shape, M, r, S)
    y = fp8_lora_linear(x, q, sw, A, B, meta, mode=mode, bias=bias)
    y32 = fp8_lora_linear(x, q, sw, A, B, meta, mode=mode, bias=bias, out_dtype=torch.float32)
    h = lora_shrink_triton(x, A, meta).h
    return (x, q, sw, A, B, slots, meta, bias), y, y32, h


def _train_inputs(shape, M, r=64):
    K, widths, q, sw = _weights(shape, seed=5)
    N = sum(widths)
    g = torch.Generator(device=DEV).manual_seed(6)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_()
    A = (torch.randn(r, K, device=DEV, generator=g) * 0.02).requires_grad_()
    B = (torch.randn(N, r, device=DEV, generator=g) * 0.02).requires_grad_()
    return x, q, sw, A, B


@pytest.fixture(scope="module", autouse=True)
def _warm():
    """Capture every launch the cases make, compile them in parallel, then run the tests against the cache."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dispatch.set_backend("triton")
    with tu.collect_launches() as rec, torch.no_grad():
        for shape, M, r, S, mode in CASES:
            _run_case(shape, M, r, S, mode)
        for shape, M, r, S, mode in TMA_CASES:
            test_tma_weight_loads(shape, M, r, S, mode)
        for shape, M in [("qkv", 128), ("down", 16)]:
            test_dora_g(shape, M)
        for shape, M in [("qkv", 16), ("gate_up", 64), ("down", 256), ("o", 2048)]:
            test_w8a16_widening_bits_equal_cvt(shape, M)
        for case in SWAP_CASES:
            test_both_main_loop_orientations(*case)
        for shape in ("qkv", "down"):
            test_dx_gemm_both_orientations(shape)
        for mode in ("w8a16", "w8a8"):
            _epilogue_variants(mode)
        for shape, M in CHUNKINGS:
            _chunking_outputs(shape, M)
        for case in DIST_CASES:
            _split_protocols(*case)
        _split_protocols("qkv", 64, 4, "w8a16", False, use_pdl=True)
        for shape, M in MATCHED:
            _matched_outputs(shape, M)
        for (shape, M), invariant in ((c, inv) for c in TRAIN for inv in BATCH_INVARIANT):
            x, q, sw, A, B = _train_inputs(shape, M)
            with _knob(batch_invariant=invariant):
                lora_linear_triton(x.detach(), q, sw, A.detach(), B.detach(), 2.0)
            N = q.shape[0]
            lora_gemm_triton(torch.empty(M, N, device=DEV, dtype=torch.bfloat16), q.t(), None,
                             h=torch.empty(1, M, 64, device=DEV),
                             B=A.detach().to(torch.bfloat16).t()[None], out_dtype=torch.bfloat16)
    info = tu.precompile(rec, jobs=min(16, os.cpu_count() or 4))
    print(f"\n[precompile] {info['kernels']} kernels in {info['seconds']} s, errors: {info['errors']}")
    yield
    dispatch.set_backend("auto")
    print("\n[dispatch report]", dispatch.report())


# ---------------------------------------------------------------------------------------------- quantization


def _diff(a, b):
    return int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) if a.dtype == fp8.FP8_DTYPE else \
        int((a != b).sum())


@pytest.mark.parametrize("M,K", [(1, 4096), (7, 4096), (1000, 12288), (4096, 4096)])
@pytest.mark.parametrize("rounding", ["div", "recip"])
def test_activation_quant_bit_exact(M, K, rounding):
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    x = x * torch.logspace(-3, 2, M, device=DEV)[:, None].to(torch.bfloat16)
    x[0, :7] = 0
    q, s = quantize_activation_triton(x, rounding)
    qr, sr = fp8.quantize_activation_ref(x, rounding)
    qc, sc = fp8.quantize_activation_ref(x.cpu(), rounding)
    oracle = quant_scale_fp64(x)[:, None]
    # which side is wrong, if any: the Triton kernel, the CUDA reference, or the CPU reference
    assert torch.equal(s, oracle), f"Triton scale: {_diff(s, oracle)} of {M} rows differ from IEEE amax/448"
    assert torch.equal(sr, oracle), f"CUDA reference scale: {_diff(sr, oracle)} rows differ from IEEE amax/448"
    assert torch.equal(sc, oracle.cpu()), "CPU reference scale differs from IEEE amax/448"
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)), f"{_diff(q, qr)} codes differ"
    assert torch.equal(qr.view(torch.uint8).cpu(), qc.view(torch.uint8)), "CUDA and CPU references differ"


def test_weight_quant_bit_exact():
    w = torch.randn(6144, 4096, device=DEV, dtype=torch.bfloat16) * 0.02
    w[5, 3] = 40.0
    q, s = quantize_weight_triton(w)
    qr, sr = fp8.quantize_weight_ref(w)
    assert torch.equal(s, quant_scale_fp64(w)), "Triton weight scale differs from IEEE amax/448"
    assert torch.equal(sr, quant_scale_fp64(w)), "CUDA reference weight scale differs from IEEE amax/448"
    assert torch.equal(s, sr) and torch.equal(q.view(torch.uint8), qr.view(torch.uint8)), _diff(q, qr)


def test_activation_quant_equals_vllm_op():
    try:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)
        op = torch.ops._C.dynamic_per_token_scaled_fp8_quant
    except Exception as e:  # vLLM GPU build missing or broken here
        pytest.skip(f"vLLM's CUDA ops are not importable ({type(e).__name__}: {e}); cannot compare bit for bit")
    for M, K in [(1, 4096), (33, 4096), (1000, 12288), (4096, 4096)]:
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16) * 3
        out = torch.empty(M, K, device=DEV, dtype=torch.float8_e4m3fn)
        scale = torch.empty(M, 1, device=DEV, dtype=torch.float32)
        op(out, x, scale, None)
        q, s = quantize_activation_triton(x, "div")
        assert torch.equal(s, scale), (M, K)
        same = torch.equal(q.view(torch.uint8), out.view(torch.uint8))
        if not same:
            qr, _ = quantize_activation_triton(x, "recip")
            n_div = int((q.view(torch.uint8) != out.view(torch.uint8)).sum())
            n_rec = int((qr.view(torch.uint8) != out.view(torch.uint8)).sum())
            pytest.fail(f"M={M} K={K}: {n_div} codes differ from vLLM's op with rounding='div', {n_rec} with "
                        "'recip' (DESIGN says vLLM's CUDA op divides)")


# ------------------------------------------------------------------------------------------------ projections
@pytest.mark.parametrize("shape,M,r,S,mode", CASES, ids=[f"{c[0]}-M{c[1]}-r{c[2]}-S{c[3]}-{c[4]}" for c in CASES])
def test_projection_vs_fp64(shape, M, r, S, mode):
    (x, q, sw, A, B, slots, meta, bias), y, y32, h = _run_case(shape, M, r, S, mode)
    ref, h64 = _reference(x, q, sw, A, B, slots, bias, mode)
    e16, e32 = rel_err(y, ref), rel_err(y32, ref)
    has = slots >= 0
    eh = rel_err(h[:, has], h64[:, has]) if has.any() else 0.0
    cfg = gemm_config(mode, M, q.shape[0], q.shape[1], DEV)
    print(f"  {shape} M={M} r={r} S={S} {mode}: bf16-out {e16:.2e}  fp32-out {e32:.2e}  h {eh:.2e}  cfg {cfg}")
    assert y.dtype == torch.bfloat16 and e16 < 1e-2
    # fp32 output: only accumulation error is left. W8A8 uses Hopper's fast FP8 accumulation (like vLLM's
    # CUTLASS FastAccum kernels, ~14-bit partial sums), so it only gets the bf16 bound.
    assert e32 < (1e-2 if mode == "w8a8" else 1e-4)
    assert eh < 1e-4
    if mode == "w8a8":                                       # K1's fused quantization is bit-exact
        so = lora_shrink_triton(x, A, meta, quant="div")
        qr, sr = fp8.quantize_activation_ref(x)
        assert torch.equal(so.x_q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(so.x_scale, sr)


TMA_CASES = [("qkv", 33, 64, 4, "w8a16"), ("gate_up", 1000, 64, 1, "w8a8"), ("down", 7, 16, 4, "w8a16"),
             ("o", 2048, 64, 32, "w8a8")]


@pytest.mark.parametrize("shape,M,r,S,mode", TMA_CASES, ids=[f"{c[0]}-M{c[1]}-{c[4]}" for c in TMA_CASES])
def test_tma_weight_loads(shape, M, r, S, mode):
    """The w_tma tuning option (weight tiles via a TMA descriptor) against fp64 and the cp.async config."""
    x, q, sw, A, B, slots, meta, bias = _case_inputs(shape, M, r, S)
    cfg = gemm_config(mode, M, q.shape[0], q.shape[1], DEV)
    xin, xs = (x, None) if mode == "w8a16" else fp8.quantize_activation_ref(x)
    h = lora_shrink_triton(x, A, meta).h
    kw = dict(x_scale=xs, h=h, B=B, meta=meta, bias=bias)
    y_tma = lora_gemm_triton(xin, q, sw, config=dataclasses.replace(cfg, w_tma=True), **kw)
    y_ptr = lora_gemm_triton(xin, q, sw, config=dataclasses.replace(cfg, w_tma=False), **kw)
    if tu._collector is not None:          # the warm-up only collects the launches
        return
    ref, _ = _reference(x, q, sw, A, B, slots, bias, mode)
    print(f"  {shape} M={M} {mode}: tma {rel_err(y_tma, ref):.2e}, cp.async {rel_err(y_ptr, ref):.2e}, "
          f"bit-identical {torch.equal(y_tma, y_ptr)}")
    assert rel_err(y_tma, ref) < 1e-2


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
@pytest.mark.parametrize("M", [1000, 256, 64])
def test_x_tma_same_bits(mode, M, swap):
    """x_tma (x tiles via TMA when rows are not gathered) gives the pointer loads' bits in both main-loop
    orientations (swap_ab: the tile transposed in shared memory; its wrong results before SYNC_A were the
    register race): the trainer-style call (no metadata, one adapter, bias), W8A16 and W8A8, ragged and even M."""
    x, q, sw, A, B, slots, meta, bias = _case_inputs("qkv", M, 64, 1)
    N, K = q.shape[0], q.shape[1]
    cfg = dataclasses.replace(gemm_config(mode, M, N, K, DEV), swap_ab=swap, w_tma=True)
    xin, xs = (x, None) if mode == "w8a16" else fp8.quantize_activation_ref(x)
    h = lora_shrink_triton(x, [a[:1] for a in A], None).h
    kw = dict(x_scale=xs, h=h, B=[b[:1] for b in B], bias=bias, out_dtype=torch.float32)
    y_tma = lora_gemm_triton(xin, q, sw, config=dataclasses.replace(cfg, x_tma=True), **kw)
    y_ptr = lora_gemm_triton(xin, q, sw, config=cfg, **kw)
    if tu._collector is not None:
        return
    assert torch.equal(y_tma, y_ptr)
    # W8A8: the FP8 MMA's fast accumulation (as CUTLASS's FastAccum) sits ~1e-3 from the fp32 reference
    assert rel_err(y_tma, lora_gemm_ref(xin, q, sw, **kw)) < (1e-2 if mode == "w8a8" else 1e-5)


SWAP_CASES = [("qkv", 16, 64, 4, "w8a16"), ("gate_up", 64, 64, 1, "w8a16"), ("down", 256, 16, 32, "w8a8"),
              ("o", 2048, 64, 4, "w8a16"), ("gate_up", 256, 64, 1, "w8a8")]


@pytest.mark.parametrize("shape,M,r,S,mode", SWAP_CASES, ids=[f"{c[0]}-M{c[1]}-{c[4]}" for c in SWAP_CASES])
def test_both_main_loop_orientations(shape, M, r, S, mode):
    """GemmConfig.swap_ab False (tokens on the MMA's M side, the weight tile through shared memory, widened
    with "prmt") against fp64 and the swap_ab config, with several adapters, bias and fp32 output."""
    x, q, sw, A, B, slots, meta, bias = _case_inputs(shape, M, r, S)
    cfg = gemm_config(mode, M, q.shape[0], q.shape[1], DEV)
    xin, xs = (x, None) if mode == "w8a16" else fp8.quantize_activation_ref(x)
    h = lora_shrink_triton(x, A, meta).h
    kw = dict(x_scale=xs, h=h, B=B, meta=meta, bias=bias, out_dtype=torch.float32)
    outs = {}
    for swap in (True, False):
        c = dataclasses.replace(cfg, swap_ab=swap, widen="bits" if swap else "prmt")
        if not swap and c.block_m < 16:
            c = dataclasses.replace(c, block_m=16)
        outs[swap] = lora_gemm_triton(xin, q, sw, config=c, **kw)
    if tu._collector is not None:
        return
    ref, _ = _reference(x, q, sw, A, B, slots, bias, mode)
    errs = {k: rel_err(v, ref) for k, v in outs.items()}
    print(f"  {shape} M={M} {mode}: swap_ab {errs[True]:.2e}, tokens-on-M {errs[False]:.2e}")
    assert all(e < (1e-2 if mode == "w8a8" else 1e-4) for e in errs.values()), errs


@pytest.mark.parametrize("shape", ["qkv", "down"])
def test_dx_gemm_both_orientations(shape):
    """The training backward's dx GEMM (transposed FP8 view, no scale: gy carries it) in both orientations."""
    K, widths, q, sw = _weights(shape)
    N, T, r = sum(widths), 1024, 64
    g = torch.Generator(device=DEV).manual_seed(9)
    gy = torch.randn(T, N, device=DEV, dtype=torch.bfloat16, generator=g)
    dh = torch.randn(1, T, r, device=DEV, generator=g)
    A_c = (torch.randn(r, K, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    cfg = gemm_config("w8a16", T, K, N, DEV, transposed=True)
    kw = dict(h=dh, B=A_c.t()[None], out_dtype=torch.float32)
    outs = {swap: lora_gemm_triton(gy, q.t(), None, config=dataclasses.replace(cfg, swap_ab=swap), **kw)
            for swap in (True, False)}
    if tu._collector is not None:
        return
    ref = lora_gemm_ref(gy, q.t(), None, **kw)
    errs = {k: rel_err(v, ref) for k, v in outs.items()}
    print(f"  dx {shape}: swap_ab {errs[True]:.2e}, tokens-on-M {errs[False]:.2e}")
    assert all(e < 1e-4 for e in errs.values()), errs


@pytest.mark.parametrize("shape,M", [("qkv", 128), ("down", 16)])
def test_dora_g(shape, M):
    """Per-slot, per-column DoRA scale g [S, N] in the epilogue (rows without adapter get no g)."""
    x, q, sw, A, B, slots, meta, bias = _case_inputs(shape, M, 64, 4)
    g = torch.rand(4, q.shape[0], device=DEV) + 0.5
    h = lora_shrink_triton(x, A, meta).h
    y = lora_gemm_triton(x, q, sw, h=h, B=B, meta=meta, g=g, bias=bias)
    if tu._collector is not None:
        return
    ref = lora_gemm_ref(x, q, sw, h=h, B=B, meta=meta, g=g, bias=bias, out_dtype=torch.float32)
    assert rel_err(y, ref) < 1e-2


def test_split_k_and_pdl_are_deterministic():
    x, q, sw, A, B, slots, meta, bias = _case_inputs("o", 16, 64, 4)
    assert gemm_config("w8a16", 16, q.shape[0], q.shape[1], DEV).split_k > 1
    y1 = fp8_lora_linear(x, q, sw, A, B, meta, bias=bias)
    y2 = fp8_lora_linear(x, q, sw, A, B, meta, bias=bias)
    h = lora_shrink_triton(x, A, meta, use_pdl=True).h
    y3 = lora_gemm_triton(x, q, sw, h=h, B=B, meta=meta, bias=bias, use_pdl=True)
    torch.cuda.synchronize()
    assert torch.equal(y1, y2) and torch.equal(y1, y3)


# (shape, M, adapters, mode, DoRA g): tuned configs with split-K where every program reduces its share of
# the tile's tokens (asserted), one and many adapters, both modes (all swap-AB: the only tuned configs that qualify)
DIST_CASES = [("qkv", 64, 1, "w8a16", False), ("o", 64, 4, "w8a16", True), ("down", 64, 32, "w8a16", False),
              ("o", 50, 1, "w8a16", False), ("qkv", 33, 32, "w8a16", True), ("down", 64, 4, "w8a8", True),
              ("down", 256, 4, "w8a8", False)]


def _split_protocols(shape, M, S, mode, dora, use_pdl=False):
    """The same call with the split-K partials reduced by every program (its share of the tokens) and by the
    tile's last program only (the interpreter's protocol); both with the tuned config."""
    x, q, sw, A, B, slots, meta, bias = _case_inputs(shape, M, 64, S)
    cfg = gemm_config(mode, M, q.shape[0], q.shape[1], DEV)
    xin, xs = (x, None) if mode == "w8a16" else fp8.quantize_activation_ref(x)
    g = torch.rand(S, q.shape[0], device=DEV) + 0.5 if dora else None
    h = lora_shrink_triton(x, A, meta).h
    outs = {}
    saved = set_knobs()
    try:
        for dist in (True, False):
            set_knobs(k2_dist_red=dist)
            outs[dist] = [lora_gemm_triton(xin, q, sw, x_scale=xs, h=h, B=B, meta=meta, g=g, bias=bias,
                                           out_dtype=dt, use_pdl=use_pdl)
                          for dt in (torch.bfloat16, torch.float32)]
    finally:
        restore_knobs(saved)
    return cfg, outs, (x, q, sw, h, B, meta, g, bias)


@pytest.mark.parametrize("shape,M,S,mode,dora", DIST_CASES,
                         ids=[f"{c[0]}-M{c[1]}-S{c[2]}-{c[3]}{'-g' if c[4] else ''}" for c in DIST_CASES])
def test_split_k_distributed_reduction_same_bits_as_last_program(shape, M, S, mode, dora):
    cfg, outs, _ = _split_protocols(shape, M, S, mode, dora)
    assert cfg.split_k in (2, 4, 8) and cfg.block_m // cfg.split_k >= 16, \
        f"{shape} M={M} {mode}: tuned config {cfg} does not take the distributed reduction; pick another case"
    for yd, yl in zip(outs[True], outs[False]):
        d = (yd.float() - yl.float()).abs().max().item()
        assert torch.equal(yd, yl), f"distributed vs last-program split-K: max |diff| {d}"
    before = dispatch.report().get("lora_gemm.split_k", {}).get("distributed", 0)
    _split_protocols(shape, M, S, mode, dora)
    assert dispatch.report()["lora_gemm.split_k"]["distributed"] == before + 2


def test_split_k_distributed_reduction_in_cuda_graph_with_pdl():
    """vLLM replays K2 from CUDA graphs behind K1 (programmatic dependent launch): the never-reset tile
    counters keep working replay after replay (the output is zeroed before each replay)."""
    cfg, outs, (x, q, sw, h, B, meta, g, bias) = _split_protocols("qkv", 64, 4, "w8a16", False, use_pdl=True)
    y_eager = outs[True][0]
    assert torch.equal(y_eager, outs[False][0])
    out = torch.empty_like(y_eager)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        lora_gemm_triton(x, q, sw, h=h, B=B, meta=meta, bias=bias, out=out, use_pdl=True)      # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_gemm_triton(x, q, sw, h=h, B=B, meta=meta, bias=bias, out=out, use_pdl=True)
    for _ in range(50):
        out.zero_()
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, y_eager)
    for _ in range(200):                    # eager launches between replays share the same counters
        lora_gemm_triton(x, q, sw, h=h, B=B, meta=meta, bias=bias, use_pdl=True)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, y_eager)


# ------------------------------------------------------------------------------------------ matched property
def _matched_outputs(shape, M):
    K, widths, q, sw = _weights(shape, seed=3)
    N, r, S, s = sum(widths), 64, 4, 2.0
    g = torch.Generator(device=DEV).manual_seed(4)
    As = [torch.randn(r, K, device=DEV, generator=g) * 0.02 for _ in range(S)]
    Bs = [torch.randn(N, r, device=DEV, generator=g) * 0.02 for _ in range(S)]
    A_stack = torch.stack([a.to(torch.bfloat16) for a in As])             # engine slots, s folded into B
    B_stack = torch.stack([(b * s).to(torch.bfloat16) for b in Bs])
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, generator=g)
    bias = torch.randn(N, device=DEV, dtype=torch.bfloat16, generator=g)
    slots = _slots(M, S, seed=7)
    slots[: max(1, M // 4)] = 2
    y_eng = fp8_lora_linear(x, q, sw, A_stack, B_stack, build_lora_meta(slots, S), mode="w8a16", bias=bias)
    y_tr = lora_linear_triton(x, q, sw, As[2], Bs[2], s, bias)
    return slots, y_eng, y_tr


@pytest.mark.parametrize("shape,M", MATCHED, ids=[f"{s}-M{m}" for s, m in MATCHED])
def test_matched_property_engine_w8a16_vs_trainer_forward(shape, M):
    with torch.no_grad():
        slots, y_eng, y_tr = _matched_outputs(shape, M)
    rows = slots == 2
    assert rows.any()
    diff = (y_eng[rows].float() - y_tr[rows].float()).abs().max().item()
    assert torch.equal(y_eng[rows], y_tr[rows]), f"max |diff| {diff}"


# --------------------------------------------------------------------------------------------- training linear
@contextlib.contextmanager
def _knob(**changes):
    saved = set_knobs(**changes)
    try:
        yield
    finally:
        restore_knobs(saved)


def _forward_workspaces(x, q, sw, A, B, s) -> tuple[list[int], list[str]]:
    """The split-K partials workspaces (bytes) K2 allocates in the training forward, read from the launches the
    dispatch actually makes (captured, not run), and each K2 launch's config for the test's message."""
    with tu.collect_launches() as rec, torch.no_grad():
        lora_linear_triton(x.detach(), q, sw, A.detach(), B.detach(), s)
    workspaces, configs = [], []
    for kernel, _grid, args, kw in rec:
        if kernel.fn.__name__ == "_lora_gemm_rs_kernel":
            configs.append("gluon_rs (no split-K)")
        elif kernel.fn.__name__ == "_lora_gemm_kernel":
            configs.append(f"BLOCK_N={kw['BLOCK_N']} BLOCK_M={kw['BLOCK_M']} BLOCK_K={kw['BLOCK_K']} "
                           f"SPLIT_K={kw['SPLIT_K']}")
            if kw["SPLIT_K"] > 1:                      # part_ptr: the fp32 [SPLIT_K, M_pad, N_pad] workspace
                part = dict(zip(kernel.arg_names, args))["part_ptr"]
                workspaces.append(part.numel() * part.element_size())
    return workspaces, configs


def _weight_sized(sizes, threshold, expected) -> list[int]:
    """Allocations of >= threshold bytes other than the expected ones (each expected size consumed once; the
    caching allocator rounds requests up to 512 bytes)."""
    left = [sz for sz in sizes if sz >= threshold]
    for want in expected:
        rounded = -(-want // 512) * 512
        if rounded in left:
            left.remove(rounded)
    return left


@pytest.mark.parametrize("invariant", BATCH_INVARIANT, ids=[f"batch_invariant_{v}" for v in BATCH_INVARIANT])
@pytest.mark.parametrize("shape,M", TRAIN, ids=[s for s, _ in TRAIN])
def test_training_linear_fwd_bwd_vs_reference(shape, M, invariant):
    """Forward and backward against LoRALinearRef, with the knob batch_invariant on and off; memory: after one
    warm-up step (Triton compilation and the cuBLAS/cuBLASLt workspaces, 32 MiB each per stream on Hopper,
    allocated by the first bf16 matmul), the forward allocates nothing beyond y, the split-K partials of the
    config the dispatch chose (the batch-invariant schedule sums narrow weights in SPLIT_K = 2 shares: an fp32
    [2, M, N] workspace, activation-sized, read from the captured launch) and small tensors; the backward
    nothing beyond dx, gy = dy ⊙ s_w (dy's size) and small tensors; and no allocation other than that
    workspace reaches the size of the FP8 codes (N·K bytes): a transposed FP8 copy would be N·K bytes, a bf16
    copy 2·N·K."""
    x, q, sw, A, B = _train_inputs(shape, M)
    s = 2.0
    N, K = q.shape
    with _knob(batch_invariant=invariant):
        workspaces, configs = _forward_workspaces(x, q, sw, A, B, s)
        lora_linear_triton(x, q, sw, A, B, s).backward(torch.randn(M, N, device=DEV, dtype=torch.bfloat16))
        x.grad = A.grad = B.grad = None
        y, peak_fwd, sizes_fwd = tu.alloc_trace(lambda: lora_linear_triton(x, q, sw, A, B, s))
        dy = torch.randn_like(y)
        _, peak_bwd, sizes_bwd = tu.alloc_trace(lambda: y.backward(dy))
    got = [y.detach(), x.grad, A.grad, B.grad]
    x.grad = A.grad = B.grad = None
    yr = LoRALinearRef.apply(x, q, sw, A, B, s, None)
    yr.backward(dy)
    ref = [yr.detach(), x.grad, A.grad, B.grad]
    errs = {n: rel_err(a, b) for n, a, b in zip(("y", "dx", "dA", "dB"), got, ref)}
    fp8_bytes, y_bytes, dx_bytes, gy_bytes = q.numel(), y.numel() * 2, x.numel() * 2, dy.numel() * 2
    ws_bytes = sum(workspaces)
    mib = 2 ** 20
    msg = (f"{shape} T={M} batch_invariant={invariant}: K2 {configs}, split-K workspace {ws_bytes / mib:.1f} MiB; "
           f"fwd peak {peak_fwd / mib:.1f} MiB (y {y_bytes / mib:.1f}), bwd peak {peak_bwd / mib:.1f} MiB (dx "
           f"{dx_bytes / mib:.1f}, gy {gy_bytes / mib:.1f}); FP8 codes {fp8_bytes / mib:.1f} MiB, a bf16 copy "
           f"{2 * fp8_bytes / mib:.1f} MiB")
    print(f"  {msg}; rel err vs LoRALinearRef {errs}")
    assert all(e < 1e-2 for e in errs.values()), errs
    assert peak_fwd - y_bytes - ws_bytes < fp8_bytes / 2, f"the forward allocated something weight-sized: {msg}"
    assert peak_bwd - dx_bytes - gy_bytes < fp8_bytes / 2, f"the backward allocated something weight-sized: {msg}"
    if sizes_fwd is not None and sizes_bwd is not None:
        big = _weight_sized(sizes_fwd, fp8_bytes, workspaces) + _weight_sized(sizes_bwd, fp8_bytes, [])
        assert not big, f"allocations of {big} bytes >= the FP8 codes ({fp8_bytes}) besides the workspace: {msg}"


@pytest.mark.parametrize("shape,M", [("qkv", 16), ("gate_up", 64), ("down", 256), ("o", 2048)])
def test_w8a16_widening_bits_equal_cvt(shape, M):
    """The F2F-free widenings (GemmConfig.widen="bits" and "prmt", inline PTX) and Triton's cast give the same
    bits in both main-loop orientations, on weights holding every finite e4m3 code (subnormals, both zeros,
    +-448)."""
    K, widths, q, sw = _weights(shape)
    codes = torch.arange(256, device=DEV, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes != 0x7F) & (codes != 0xFF)]
    q = q.clone()
    q.view(torch.uint8).view(-1)[: 64 * codes.numel()] = codes.repeat(64)    # the first rows: every code
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    cfg = gemm_config("w8a16", M, q.shape[0], K, DEV)
    outs = {}
    for swap in (True, False):
        for wd in ("bits", "prmt", "cvt"):
            c = dataclasses.replace(cfg, widen=wd, swap_ab=swap, block_m=max(cfg.block_m, 16))
            outs[(swap, wd)] = lora_gemm_triton(x, q, sw, config=c, out_dtype=torch.float32)
    if tu._collector is not None:
        return
    for swap in (True, False):                       # same orientation: the same bits whatever the widening
        for wd in ("bits", "prmt"):
            d = (outs[(swap, wd)] - outs[(swap, "cvt")]).abs().max().item()
            assert torch.equal(outs[(swap, wd)], outs[(swap, "cvt")]), f"swap_ab={swap} {wd}: max |diff| {d}"


# (shape, M): decode (split-K 2 narrow, 1 wide), a prefill chunk and the trainer's size; a 32B-like K where
# BLOCK_K 1024 would move the share boundary (25600 / 2 = 12800 is not a multiple of 1024) is covered by the unit
# test of same_sums
CHUNKINGS = [("qkv", 1), ("o", 16), ("gate_up", 1), ("down", 4), ("qkv", 300), ("gate_up", 2048)]


def _chunking_outputs(shape, M):
    """W8A16 K2 with one adapter on the shape's invariant schedule, at its BLOCK_K and at every larger one that
    keeps its shares (gemm_configs.same_sums), tiles and stages as the invariant config picks them."""
    from rlfp8.kernels.gemm_configs import (SM90_MAX_SMEM, fit_smem, invariant_gemm_config, reduction_schedule,
                                            same_sums)
    x, q, sw, A, B, slots, meta, bias = _case_inputs(shape, M, 64, 4)
    K, N = x.shape[1], q.shape[0]
    h = lora_shrink_triton(x, A, meta).h
    sched = reduction_schedule("w8a16", N, K)
    base = invariant_gemm_config("w8a16", M, N, K, DEV)
    outs = {}
    for bk in (sched.block_k, 128, 256, 512, 1024):
        c = dataclasses.replace(base, block_k=bk, split_k=sched.split_k, num_stages=2 if bk >= 512 else 3)
        if bk < sched.block_k or not same_sums(c, sched, K):
            continue
        c = fit_smem(c, "w8a16", 64, SM90_MAX_SMEM)         # long chunks of large tiles: fewer tokens per tile
        outs[bk] = lora_gemm_triton(x, q, sw, h=h, B=B, meta=meta, bias=bias, config=c, out_dtype=torch.float32)
    return sched, outs


@pytest.mark.parametrize("shape,M", CHUNKINGS)
def test_w8a16_block_k_chunking_keeps_the_bits(shape, M):
    """The batch-invariant W8A16 schedule fixes the split and the shares' boundaries, not BLOCK_K: a share's k16
    wgmma steps run in k order into one accumulator however many chunks group them, so every BLOCK_K that keeps the
    shares gives the schedule's bits (the tuner may then give decode calls 256-512-byte row chunks)."""
    sched, outs = _chunking_outputs(shape, M)
    if tu._collector is not None:
        return
    assert len(outs) >= 3, (sched, sorted(outs))
    ref = outs[sched.block_k]
    for bk, y in outs.items():
        d = (y - ref).abs().max().item()
        assert torch.equal(y, ref), f"{shape} M={M}: BLOCK_K {bk} vs the schedule's {sched.block_k}: max |diff| {d}"


def _epilogue_variants(mode):
    from rlfp8.kernels import gemm_triton as lg
    x, q, sw, A, B, slots, meta, bias = _case_inputs("qkv", 64, 64, 32)
    xin, xs = (x, None) if mode == "w8a16" else fp8.quantize_activation_ref(x)
    h = lora_shrink_triton(x, A, meta).h
    outs = []
    try:
        for pipe in (True, False):
            lg._PIPE_SLOTS_OVERRIDE = pipe
            outs.append(lora_gemm_triton(xin, q, sw, x_scale=xs, h=h, B=B, meta=meta, bias=bias))
    finally:
        lg._PIPE_SLOTS_OVERRIDE = None
    return outs


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_epilogue_variants_same_bits(mode):
    """32 adapters at T = 64: the slot-pipelined epilogue and the per-slot one give the same bits."""
    y_pipe, y_plain = _epilogue_variants(mode)
    assert torch.equal(y_pipe, y_plain)


def test_dispatch_auto_picks_triton_on_cuda():
    from rlfp8.kernels.linear import lora_linear
    with dispatch.use_backend("auto"):
        dispatch.reset_report()
        x, q, sw, A, B = _train_inputs("o", 128)
        lora_linear(x, q, sw, A, B, 1.0)
        fp8.quantize_activation(x.detach())
        assert dispatch.report()["lora_linear"] == {"triton": 1}
        assert dispatch.report()["quantize_activation"] == {"triton": 1}


# ------------------------------------------------------------------------------ the Gluon main loop (lora_gemm_rs)
# (shape, M, forward rank, bias, DoRA g, dx rank): above rank 64 the epilogue runs K2's rank chunks of 32 (96 and
# 200: a last chunk past the rank, an odd chunk count), DoRA's g after the LoRA sum (with and without bias)
RS_CASES = [("qkv", 1000, 64, True, False, 64), ("o", 4096, 16, False, False, 64),
            ("gate_up", 2048, 64, False, False, 64), ("down", 1000, 32, True, False, 64), ("o", 600, 0, True, False, 64),
            ("o", 4096, 384, False, True, 384), ("o", 1000, 64, False, True, 128), ("qkv", 1000, 128, True, True, 96),
            ("gate_up", 2048, 512, False, False, 512), ("down", 1000, 200, True, True, 384)]


@pytest.fixture
def tuned_configs():
    """The tuned per-token-count configs (knob batch_invariant=off): with the default (auto) the narrow shapes'
    split-K schedule keeps their W8A16 calls off the Gluon loop."""
    saved = set_knobs(batch_invariant="off")
    yield
    restore_knobs(saved)


@pytest.mark.parametrize("shape,M,r,bias,dora,r_dx", RS_CASES,
                         ids=[f"{c[0]}-M{c[1]}-r{c[2]}{'-g' if c[4] else ''}-dx{c[5]}" for c in RS_CASES])
def test_gluon_rs_bits_equal_triton_kernel(shape, M, r, bias, dora, r_dx, tuned_configs):
    """Above 512 tokens, W8A16 calls without metadata (the trainer's forward and dx GEMMs, long prefills) run
    lora_gemm_rs; its output must be bit-identical to the Triton kernel's (same MMAs in the same order, same
    epilogue) for the forward (scale, LoRA, DoRA's g, bias) and for the dx GEMM (transposed codes, LoRA, no
    scale), and close to the fp64 reference. Tails: M not a multiple of 256, ranks below 64 and between chunks."""
    K, widths, q, sw = _weights(shape, seed=11)
    N = sum(widths)
    g = torch.Generator(device=DEV).manual_seed(12)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, generator=g)
    b = torch.randn(N, device=DEV, dtype=torch.bfloat16, generator=g) if bias else None
    fwd = dict(bias=b)
    if r:
        fwd.update(h=torch.randn(1, M, r, device=DEV, generator=g),
                   B=(torch.randn(1, N, r, device=DEV, generator=g) * 0.02).to(torch.bfloat16))
    if dora:
        fwd.update(g=0.75 + 0.5 * torch.rand(1, N, device=DEV, generator=g))
    gy = torch.randn(M, N, device=DEV, dtype=torch.bfloat16, generator=g)
    dx_kw = dict(h=torch.randn(1, M, r_dx, device=DEV, generator=g),
                 B=(torch.randn(r_dx, K, device=DEV, generator=g) * 0.02).to(torch.bfloat16).t()[None])
    dispatch.reset_report()
    y = lora_gemm_triton(x, q, sw, **fwd)
    dx = lora_gemm_triton(gy, q.t(), None, **dx_kw)
    if tu._collector is not None:
        return
    assert dispatch.report()["lora_gemm.mainloop"] == {"gluon_rs": 2}, dispatch.report()
    y_k2 = lora_gemm_triton(x, q, sw, config=gemm_config("w8a16", M, N, K, DEV), **fwd)
    dx_k2 = lora_gemm_triton(gy, q.t(), None, config=gemm_config("w8a16", M, K, N, DEV, transposed=True), **dx_kw)
    e_y = rel_err(y, lora_gemm_ref(x, q, sw, out_dtype=torch.float32, **fwd))
    e_dx = rel_err(dx, lora_gemm_ref(gy, q.t(), None, out_dtype=torch.float32, **dx_kw))
    print(f"  {shape} M={M} r={r} g={dora} r_dx={r_dx}: rel err fwd {e_y:.1e}, dx {e_dx:.1e}; bits equal to K2: "
          f"fwd {torch.equal(y, y_k2)}, dx {torch.equal(dx, dx_k2)}")
    assert e_y < 1e-2 and e_dx < 1e-2
    assert torch.equal(y, y_k2), f"fwd max |diff| {(y.float() - y_k2.float()).abs().max().item()}"
    assert torch.equal(dx, dx_k2), f"dx max |diff| {(dx.float() - dx_k2.float()).abs().max().item()}"


def test_gluon_rs_not_used_where_unsupported():
    """Metadata (gather), fp16 x, an fp32 output, an explicit config (or the knob gemm_rs=false) keep the Triton
    kernel; the dispatch says which main loop ran."""
    K, widths, q, sw = _weights("o", seed=13)
    N, M = sum(widths), 1024
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    meta = build_lora_meta(torch.zeros(M, dtype=torch.long, device=DEV), 1)
    h, B = torch.randn(1, M, 64, device=DEV), torch.randn(1, N, 64, device=DEV, dtype=torch.bfloat16) * 0.02
    dispatch.reset_report()
    lora_gemm_triton(x, q, sw, h=h, B=B, meta=meta)
    lora_gemm_triton(x.half(), q, sw)
    y32 = lora_gemm_triton(x, q, sw, out_dtype=torch.float32)
    lora_gemm_triton(x, q, sw, config=gemm_config("w8a16", M, N, K, DEV))    # explicit config: no record
    if tu._collector is not None:
        return
    assert dispatch.report()["lora_gemm.mainloop"] == {"triton": 3}, dispatch.report()
    assert rel_err(y32, lora_gemm_ref(x, q, sw, out_dtype=torch.float32)) < 1e-4



@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("M", [1, 4, 16])
def test_w8a8_quantize_x_in_k2_same_bits(shape, M):
    """The engine's W8A8 decode calls: K2 quantizing x itself (knob k2_quant_x_tokens) equals a quantizer kernel
    + K2 bit for bit, on the tuned configs, without an adapter and with one under PDL (K1 then only shrinks and K2
    waits before its epilogue) and with four; 20 repeats of the fused call give the same bits."""
    x, q, sw, A, B, slots, meta, bias = _case_inputs(shape, M, 64, 4)
    one = build_lora_meta(torch.zeros(M, dtype=torch.long, device=DEV), 4)
    for args in ((), (A, B, one), (A, B, meta)):
        outs, paths = [], []
        for limit in (16, 0):
            saved = set_knobs(k2_quant_x_tokens=limit)
            try:
                dispatch.reset_report()
                outs.append(fp8_lora_linear(x, q, sw, *args, mode="w8a8", bias=bias))
                paths.append(dict(dispatch.report()))
            finally:
                restore_knobs(saved)
        assert set(paths[0]["lora_gemm.x_quant"]) == {"k2"} and "k2" not in paths[1]["lora_gemm.x_quant"]
        if args and "lora_gemm.launch" in paths[0] and set(paths[0]["lora_gemm.launch"]) == {"pdl"}:
            assert set(paths[0]["lora_gemm.pdl_wait"]) == {"epilogue"}
        assert _diff(outs[0], outs[1]) == 0
        if not args:
            ref = lora_gemm_ref(x, q, sw, quantize_x="div", bias=bias, out_dtype=torch.float32)
            assert rel_err(outs[0], ref) < 1e-2
        for _ in range(20):
            assert torch.equal(fp8_lora_linear(x, q, sw, *args, mode="w8a8", bias=bias), outs[0])


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_k1_decode_rank_blocks_same_bits(shape, mode):
    """Knobs k1_decode_rank_block (16 / 32 ranks per K1 program at <= 16 tokens) and k1_mask_x_rows (K1's padding
    rows load no x): the projection's output and h are the same bits as with the whole rank in one program and
    unmasked loads, one adapter and four, under PDL where it resolves on."""
    for M in (1, 4, 16):
        x, q, sw, A, B, slots, meta, bias = _case_inputs(shape, M, 64, 4)
        one = build_lora_meta(torch.zeros(M, dtype=torch.long, device=DEV), 4)
        for m in (one, meta):
            outs, hs = [], []
            for rb, masked in ((0, False), (16, False), (32, False), (0, True), (16, True)):
                saved = set_knobs(k1_decode_rank_block=rb, k1_mask_x_rows=masked)
                try:
                    outs.append(fp8_lora_linear(x, q, sw, A, B, m, mode=mode, bias=bias))
                    hs.append(lora_shrink_triton(x, A, m).h)
                finally:
                    restore_knobs(saved)
            has = m.token_lora_mapping >= 0
            assert all(_diff(o, outs[0]) == 0 for o in outs), (M, [_diff(o, outs[0]) for o in outs])
            assert all(torch.equal(h[:, has], hs[0][:, has]) for h in hs)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_w8a8_quantizer_chained_k2_same_bits(shape):
    """Knob pdl_quant_k2: W8A8 without an adapter (and with LoRA buffers but no adapter token), K2 as the
    quantizer's programmatic dependent gives the stream-order bits, 20 times over."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    for M in (1, 16, 64):
        x, q, sw, A, B, slots, meta, bias = _case_inputs(shape, M, 64, 4)
        none = build_lora_meta(torch.full((M,), -1, dtype=torch.long, device=DEV), 4)
        for args in ((), (A, B, none)):
            outs, paths = [], []
            for chain in (False, True):
                saved = set_knobs(pdl_quant_k2=chain, pdl="on")
                try:
                    dispatch.reset_report()
                    outs.append(fp8_lora_linear(x, q, sw, *args, mode="w8a8", bias=bias))
                    paths.append(dict(dispatch.report()))
                    if chain:
                        for _ in range(20):
                            assert torch.equal(fp8_lora_linear(x, q, sw, *args, mode="w8a8", bias=bias), outs[-1])
                finally:
                    restore_knobs(saved)
            assert paths[1]["lora_gemm.launch"] == {"pdl": 1} and paths[0]["lora_gemm.launch"] == {"stream": 1}
            assert _diff(outs[0], outs[1]) == 0
