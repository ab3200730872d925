"""K2 (lora_gemm) under the interpreter vs fp64 math and its torch reference: both modes, several adapters
with tokens without adapter, fused output slices (a tile straddling two slices), DoRA g, bias, split-K."""
import dataclasses

import pytest
import torch

from rlfp8.kernels import dispatch, fp8
from rlfp8.kernels.knobs import K2_PREFETCH_EPILOGUE
from rlfp8.kernels.gemm import lora_gemm
from rlfp8.kernels.gemm_configs import GemmConfig, gemm_config
from rlfp8.kernels.gemm_ref import lora_gemm_ref
from rlfp8.kernels.gemm_triton import lora_gemm_triton
from rlfp8.kernels.metadata import build_lora_meta
from rlfp8.kernels.projection import fp8_lora_linear
from rlfp8.kernels.shrink_ref import lora_shrink_ref
from tests.conftest import HAS_CUDA, rel_err
from tests.oracles import gemm_fp64

SMALL = GemmConfig(64, 16, 64, 1, 2, 4, 2)
SPLIT = GemmConfig(64, 32, 32, 3, 1, 4, 2)
NOSWAP = GemmConfig(64, 16, 64, 1, 2, 4, 2, swap_ab=False)          # tokens on the MMA's M side
NOSWAP_SPLIT = GemmConfig(32, 32, 32, 3, 1, 4, 2, swap_ab=False)
DECODE16 = GemmConfig(16, 16, 64, 1, 8, 4, 2, swap_ab=False)        # the decode tiles: 16 weight rows, tokens on M


def _problem(M, K, widths, S, r, device, mode="w8a16", none_frac=0.3):
    N = sum(widths)
    x = torch.randn(M, K, dtype=torch.bfloat16, device=device)
    q, sw = fp8.quantize_weight_ref(torch.randn(N, K, device=device) * 0.05)
    A = [torch.randn(S, r, K, dtype=torch.bfloat16, device=device) * 0.1 for _ in widths]
    B = [torch.randn(S, n, r, dtype=torch.bfloat16, device=device) * 0.1 for n in widths]
    slots = torch.randint(0, S, (M,), device=device)
    slots[torch.rand(M, device=device) < none_frac] = -1
    slots[0], slots[-1] = -1, S - 1
    meta = build_lora_meta(slots, S)
    h = lora_shrink_ref(x, A, meta).h
    xs = None
    if mode == "w8a8":
        x, xs = fp8.quantize_activation_ref(x)
    return dict(x=x, q=q, sw=sw, xs=xs, A=A, B=B, slots=slots, meta=meta, h=h)


def _fp64(p, g=None, bias=None):
    return gemm_fp64(p["x"], p["q"], p["sw"], x_scale=p["xs"], h=p["h"], B=p["B"], slots=p["slots"], g=g, bias=bias)


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
@pytest.mark.parametrize("cfg", [SMALL, SPLIT, NOSWAP, NOSWAP_SPLIT, DECODE16],
                         ids=["tile64x16", "splitk3", "noswap", "noswap_splitk3", "decode16"])
@pytest.mark.parametrize("gather", [True, False])
def test_multi_adapter_slices_dora_bias(mode, cfg, gather, device):
    M, K, S, r = 37, 96, 4, 16
    p = _problem(M, K, [48, 40, 40], S, r, device, mode)       # N = 128: tile [0, 64) spans slices 0 and 1
    N = 128
    g = torch.rand(S, N, device=device) + 0.5
    bias = torch.randn(N, dtype=torch.bfloat16, device=device)
    ref64 = _fp64(p, g, bias)
    kw = dict(x_scale=p["xs"], h=p["h"], B=p["B"], meta=p["meta"], g=g, bias=bias)
    y32 = lora_gemm_triton(p["x"], p["q"], p["sw"], out_dtype=torch.float32, config=cfg, gather=gather, **kw)
    assert rel_err(y32, ref64) < 1e-5                        # exact operands, fp32 accumulation
    y16 = lora_gemm_triton(p["x"], p["q"], p["sw"], config=cfg, gather=gather, **kw)
    assert y16.dtype == torch.bfloat16 and rel_err(y16, ref64) < 1e-2
    yref = lora_gemm_ref(p["x"], p["q"], p["sw"], **kw)
    assert rel_err(y16, yref.float()) < 1e-2


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_base_only_ragged_shapes(mode, device):
    M, K, N = 21, 80, 72                                     # no dim a multiple of its tile
    p = _problem(M, K, [N], 1, 16, device, mode)
    y = lora_gemm_triton(p["x"], p["q"], p["sw"], x_scale=p["xs"], out_dtype=torch.float32, config=SMALL)
    acc = p["x"].double() @ p["q"].double().t() * p["sw"].double()
    if p["xs"] is not None:
        acc *= p["xs"].double()
    assert rel_err(y, acc) < 1e-5


@pytest.mark.parametrize("prec,tol", [("bf16x2", 1e-5), ("ieee", 1e-5), ("tf32x3", 1e-5), ("bf16", 1e-2)])
def test_lora_precisions(prec, tol, device):
    p = _problem(24, 64, [64], 3, 16, device)
    h = p["h"] * 50                                          # make the LoRA term dominate the error
    p["h"] = h
    y = lora_gemm_triton(p["x"], p["q"], p["sw"], h=h, B=p["B"], meta=p["meta"], out_dtype=torch.float32,
                         config=SMALL, lora_precision=prec)
    assert rel_err(y, _fp64(p)) < tol


def test_rows_do_not_depend_on_the_other_adapters(device):
    """Same config (same M): a row's output is the same whether its neighbours use other adapters or not."""
    p = _problem(32, 64, [64, 64], 3, 16, device)
    y_mixed = lora_gemm_triton(p["x"], p["q"], p["sw"], h=p["h"], B=p["B"], meta=p["meta"], config=SPLIT)
    one = torch.full_like(p["slots"], 1)
    meta1 = build_lora_meta(one, 3)
    y_one = lora_gemm_triton(p["x"], p["q"], p["sw"], h=p["h"], B=p["B"], meta=meta1, config=SPLIT)
    rows = p["slots"] == 1
    assert rows.any() and torch.equal(y_mixed[rows], y_one[rows])


def test_heuristic_config_vllm_layout_and_engine_call(device):
    M, K, S, r = 9, 64, 2, 16
    p = _problem(M, K, [64, 32], S, r, device)
    cfg = gemm_config("w8a16", M, 96, K)
    assert cfg.block_m == 16 and cfg.block_n == 64
    B4 = [b[:, None] for b in p["B"]]                         # vLLM [S, 1, N_l, r]
    y = lora_gemm_triton(p["x"], p["q"], p["sw"], h=p["h"], B=B4, meta=p["meta"], out_dtype=torch.float32)
    assert rel_err(y, _fp64(p)) < 1e-5
    # the engine's projection (K1 + K2) under the triton backend, both modes
    with dispatch.use_backend("triton"):
        y16 = fp8_lora_linear(p["x"], p["q"], p["sw"], p["A"], B4, p["meta"], mode="w8a16")
        y8 = fp8_lora_linear(p["x"], p["q"], p["sw"], p["A"], B4, p["meta"], mode="w8a8")
    with dispatch.use_backend("torch"):
        y8_ref = fp8_lora_linear(p["x"], p["q"], p["sw"], p["A"], B4, p["meta"], mode="w8a8")
    assert rel_err(y16, _fp64(p)) < 1e-2
    assert rel_err(y8, y8_ref.float()) < 1e-2


def test_dispatch_and_errors(device):
    p = _problem(8, 64, [64], 2, 16, device)
    dispatch.reset_report()
    with dispatch.use_backend("triton"):
        lora_gemm(p["x"], p["q"], p["sw"], config=SMALL)
    lora_gemm(p["x"].cpu(), p["q"].cpu(), p["sw"].cpu())     # auto on CPU tensors: reference
    assert dispatch.report() == {"lora_gemm": {"triton": 1, "torch": 1}, "lora_gemm.schedule": {"explicit": 1},
                                 "lora_gemm.prefetch_epilogue": {"split": 1}}
    x, q, sw = p["x"], p["q"], p["sw"]
    with pytest.raises(ValueError, match=r"q \(64, 64\) must be \[N, K\] with K = x.shape\[1\] = 32"):
        lora_gemm_triton(x[:, :32], q, sw)
    with pytest.raises(ValueError, match=r"needs x_scale"):
        lora_gemm_triton(p["x"].to(fp8.FP8_DTYPE), q, sw)
    with pytest.raises(ValueError, match=r"B slice widths \[32\] must sum to N = q.shape\[0\] = 64"):
        lora_gemm_triton(x, q, sw, h=p["h"], B=p["B"][0][:, :32], meta=p["meta"])
    with pytest.raises(ValueError, match=r"h must have shape \[1, 8, 16\]"):
        lora_gemm_triton(x, q, sw, h=p["h"][:, :4], B=p["B"], meta=p["meta"])
    with pytest.raises(ValueError, match=r"g must have shape \[2, 64\]"):
        lora_gemm_triton(x, q, sw, h=p["h"], B=p["B"], meta=p["meta"], g=torch.ones(2, 63, device=device))
    with pytest.raises(TypeError, match="fp32 x"):
        lora_gemm_triton(x.float(), q, sw)


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_tma_weight_loads_same_bits(mode, device):
    """w_tma=True reads the weight tiles through a TMA descriptor (zero-filled outside [N, K])."""
    p = _problem(21, 80, [48, 24], 3, 16, device, mode)      # ragged N and K: TMA's zero padding at work
    kw = dict(x_scale=p["xs"], h=p["h"], B=p["B"], meta=p["meta"], out_dtype=torch.float32)
    tma = GemmConfig(64, 16, 32, 2, 1, 4, 2, w_tma=True)
    y = lora_gemm_triton(p["x"], p["q"], p["sw"], config=tma, **kw)
    y_ptr = lora_gemm_triton(p["x"], p["q"], p["sw"], config=GemmConfig(64, 16, 32, 2, 1, 4, 2), **kw)
    assert torch.equal(y, y_ptr)
    assert rel_err(y, _fp64(p)) < 1e-5
    with pytest.raises(ValueError, match=r"w_tma needs q \(or its transpose\) row-major"):
        lora_gemm_triton(p["x"][:, :40], p["q"][:, ::2], p["sw"], x_scale=p["xs"], config=tma)


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_x_tma_same_bits(mode, device):
    """x_tma=True loads the x tiles through a TMA descriptor when rows are not gathered (no metadata: the
    trainer; ragged M and K: zero padding), in both main-loop orientations (swap_ab: the tile transposed in
    shared memory), and keeps the pointer loads for adapter-sorted rows; the dispatch report says which ran."""
    p = _problem(21, 80, [48, 24], 3, 16, device, mode)
    h1 = p["h"][:, :, :]
    for swap in (False, True):
        cfg = GemmConfig(64, 16, 32, 2, 1, 4, 2, swap_ab=swap, w_tma=True)
        for kw in (dict(x_scale=p["xs"], h=h1, B=[b[:1] for b in p["B"]]),           # no metadata: slot 0, TMA
                   dict(x_scale=p["xs"], h=p["h"], B=p["B"], meta=p["meta"])):       # gathered rows: pointers
            dispatch.reset_report()
            y = lora_gemm_triton(p["x"], p["q"], p["sw"], config=dataclasses.replace(cfg, x_tma=True),
                                 out_dtype=torch.float32, **kw)
            assert dispatch.report()["lora_gemm.x_loads"] == {"pointer" if "meta" in kw else "tma": 1}
            assert torch.equal(y, lora_gemm_triton(p["x"], p["q"], p["sw"], config=cfg, out_dtype=torch.float32,
                                                   **kw))
            assert rel_err(y, lora_gemm_ref(p["x"], p["q"], p["sw"], out_dtype=torch.float32, **kw)) < 1e-5


def _dx_problem(device):
    """The backward's dx GEMM at ragged sizes: codes q [N, K], gy [T, N], dh [1, T, r], A_c [r, K] and the
    epilogue arguments (dh·A_c, fp32 output)."""
    T, K, N, r = 33, 80, 96, 16
    q, _ = fp8.quantize_weight_ref(torch.randn(N, K, device=device) * 0.05)
    gy = torch.randn(T, N, dtype=torch.bfloat16, device=device)
    dh = torch.randn(1, T, r, device=device)
    A_c = (torch.randn(r, K, device=device) * 0.1).to(torch.bfloat16)
    return q, gy, dh, A_c, dict(h=dh, B=A_c.t()[None], out_dtype=torch.float32)


@pytest.mark.parametrize("swap", [True, False])
def test_tma_transposed_codes_same_bits(swap, device):
    """The backward's dx GEMM with w_tma: the descriptor covers the stored codes [N, K] and the kernel
    transposes each [BLOCK_K, BLOCK_N] tile (ragged shapes: zero padding on both dims)."""
    q, gy, dh, A_c, kw = _dx_problem(device)
    cfg = GemmConfig(64, 32, 32, 1, 1, 4, 2, swap_ab=swap)
    y = lora_gemm_triton(gy, q.t(), None, config=dataclasses.replace(cfg, w_tma=True), **kw)
    assert torch.equal(y, lora_gemm_triton(gy, q.t(), None, config=cfg, **kw))
    assert rel_err(y, gy.double() @ q.double() + dh[0].double() @ A_c.double()) < 1e-5


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_epilogue_variants_give_the_same_bits(mode, device, monkeypatch):
    """The multi-adapter epilogue (h loaded once per slice, next B prefetched) and the one-adapter one
    (per-slot masked loads) compute the same MMAs on the same operands."""
    from rlfp8.kernels import gemm_triton
    p = _problem(40, 64, [64, 32], 6, 16, device, mode)
    g = torch.rand(6, 96, device=device) + 0.5
    kw = dict(x_scale=p["xs"], h=p["h"], B=p["B"], meta=p["meta"], g=g, out_dtype=torch.float32, config=SPLIT)
    assert p["meta"].num_active > 2                                   # the default picks the pipelined variant
    outs = []
    for pipe in (True, False):
        monkeypatch.setattr(gemm_triton, "_PIPE_SLOTS_OVERRIDE", pipe)
        outs.append(lora_gemm_triton(p["x"], p["q"], p["sw"], **kw))
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[0], _fp64(p, g)) < 1e-5


@pytest.mark.parametrize("cfg", [SMALL, NOSWAP, NOSWAP_SPLIT], ids=["swap", "noswap", "noswap_splitk3"])
def test_transposed_codes_no_scale(cfg, device):
    """The training backward's dx GEMM: gy [T, N] · q through the transposed view qᵀ (strides (1, K)), no
    weight scale (gy = dy ⊙ s_w carries it), dh·A_c in the epilogue, in both main-loop orientations."""
    q, gy, dh, A_c, kw = _dx_problem(device)
    y = lora_gemm_triton(gy, q.t(), None, config=cfg, **kw)
    yref = lora_gemm_ref(gy, q.t(), None, **kw)
    assert rel_err(y, yref) < 1e-5
    assert rel_err(y, gy.double() @ q.double() + dh[0].double() @ A_c.double()) < 1e-5


def test_split_counters_grow_and_keep_the_replaced_buffer_alive():
    """A larger request replaces the cached counter buffer; the old one stays referenced, since a CUDA graph
    captured with it still writes it on replay (freed, its memory could back another tensor)."""
    from rlfp8.kernels import _triton_utils as tu
    dev = torch.device("cpu")
    small = tu.split_counters("test_grow", 10, dev)
    assert small.numel() >= 10 and torch.all(small == 0)
    assert tu.split_counters("test_grow", 10, dev) is small                 # cached
    big = tu.split_counters("test_grow", small.numel() + 1, dev)
    assert big is not small and big.numel() > small.numel() and torch.all(big == 0)
    assert any(b is small for b in tu._retired)
    assert tu.split_counters("test_grow", 10, dev) is big


def test_explore_k2_decode_edits_still_apply():
    """bench/lab/explore_k2_decode.py measures copies of this kernel with one textual edit each; every edit must
    still apply to the current source (the script refuses to run otherwise) and give valid Python."""
    import ast
    from bench.lab.explore_k2_decode import ARMS, variant_source
    for arm in ARMS + ("timed",):
        ast.parse(variant_source(arm))


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter's sums (the lab script checks its copies on the GPU)")
def test_explore_decode_epilogue_copies_apply_and_xk1_sums():
    """bench/lab/explore_decode_epilogue.py times copies of this kernel made by textual edits: every edit must still
    apply and give valid Python, and the xk1 copy (expand-in-K1's lower bound: K1's programs expand h·Bᵀ into a
    buffer the epilogue adds) must still give the lora output within bf16 rounding under the interpreter."""
    import ast
    from bench.lab import explore_decode_epilogue as lab
    for variant in lab.VARIANTS:
        ast.parse(lab.variant_source(variant))
    lab.check_xk1_cpu()         # raises SystemExit naming the projection whose output is off


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter's bits (the lab script checks its copy on the GPU)")
def test_explore_decode_epilogue_fp8ad_copy_reads_fp8_adapters_with_same_bits():
    """The fp8ad copy (the adapter's weights as FP8 codes: K1's programs in K2's grid widen A, K2's epilogue widens
    B) gives the package's decode-path bits on bf16 adapters holding the same e4m3 values, and reads the FP8 tensors
    it is given (doubled FP8 adapters quadruple the adapter's share of the output)."""
    from bench.lab import explore_decode_epilogue as lab
    lab.check_fp8ad_cpu()       # raises SystemExit naming the mode and projection that is off


@pytest.mark.parametrize("split,block_m,interpreting,dist", [
    (4, 64, False, True),       # 64-token decode tiles: 16 tokens per program
    (2, 64, False, True),
    (3, 64, False, False),      # not a power of 2: the never-reset counter would not wrap cleanly
    (4, 16, False, False),      # 4 tokens per program: below the 16-token dot
    (4, 64, True, False),       # the interpreter runs programs one after another: no program may wait
])
def test_split_k_protocol_choice(split, block_m, interpreting, dist, monkeypatch):
    """Which split-K reduction a launch gets (the GPU kernels are compared bit for bit in tests/gpu): the
    distributed one needs a power-of-2 split, >= 16 tokens per program and a GPU; it takes its own never-reset
    counter buffer per split, the last-program protocol the shared one it resets."""
    from rlfp8.kernels import _triton_utils as tu
    monkeypatch.setattr(dispatch, "triton_interpreting", lambda: interpreting)
    M, N, K = 64, 256, 1024
    x = torch.zeros(M, K, dtype=torch.bfloat16)
    q = torch.zeros(N, K, dtype=fp8.FP8_DTYPE)
    cfg = GemmConfig(64, block_m, 128, split)
    dispatch.reset_report()
    with tu.collect_launches() as rec:
        lora_gemm_triton(x, q, torch.ones(N), config=cfg)
    (kernel, grid, args, kw), = rec
    assert kw["DIST_RED"] is dist and kw["SPLIT_K"] == split
    assert grid == (-(-M // block_m) * (N // 64) * split,)
    assert dispatch.report()["lora_gemm.split_k"] == {"distributed" if dist else "last_program": 1}
    cnt = args[kernel.arg_names.index("cnt_ptr")]
    assert cnt is tu.split_counters(f"lora_gemm.grow{split}" if dist else "lora_gemm", 1, x.device)


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
@pytest.mark.parametrize("cfg", [SMALL, NOSWAP], ids=["swap", "noswap"])
def test_decode_tile_padding_rows_load_no_x(mode, cfg, device):
    """Fewer tokens than BLOCK_M: the padding rows' x loads are masked (knob k2_mask_x_rows, default on) or re-read
    row 0 (off); the valid rows' bits are the same either way, with adapters through metadata and without."""
    from rlfp8.kernels import knobs
    p = _problem(3, 96, [48, 40, 40], 4, 16, device, mode)
    outs = []
    for on in (True, False):
        saved = knobs.set_knobs(k2_mask_x_rows=on)
        try:
            outs.append((lora_gemm_triton(p["x"], p["q"], p["sw"], x_scale=p["xs"], config=cfg),
                         lora_gemm_triton(p["x"], p["q"], p["sw"], x_scale=p["xs"], h=p["h"], B=p["B"],
                                          meta=p["meta"], config=cfg)))
        finally:
            knobs.restore_knobs(saved)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert rel_err(outs[0][1], _fp64(p)) < 1e-2


@pytest.mark.parametrize("rounding", ["div", "recip"])
@pytest.mark.parametrize("cfg", [SMALL, SPLIT, NOSWAP, DECODE16], ids=["swap", "splitk3", "noswap", "decode16"])
@pytest.mark.parametrize("M", [1, 3, 37])
def test_quantize_x_in_k2_gives_the_separate_quantizers_bits(rounding, cfg, M, device):
    """quantize_x: K2 quantizes 16-bit x per token itself (the engine's decode calls, knob k2_quant_x_tokens).
    Same codes and scales as fp8.quantize_activation, so the output equals the e4m3-x call's bit for bit, with
    adapters through metadata and without; K = 200 leaves a ragged last chunk in both the amax pass and the loop;
    one row is all zeros (the scale's floor) and one holds a single huge value (its other codes flush to 0)."""
    p = _problem(M, 200, [48, 40, 40], 4, 16, device)
    x = p["x"].clone()
    if M > 2:
        x[M // 2] = 0
        x[1, 7] = 3.0e4
    xq, xs = fp8.quantize_activation_ref(x, rounding)
    lora = dict(h=p["h"], B=p["B"], meta=p["meta"])
    for kw in ({}, lora):
        fused = lora_gemm_triton(x, p["q"], p["sw"], quantize_x=rounding, config=cfg, **kw)
        separate = lora_gemm_triton(xq, p["q"], p["sw"], x_scale=xs, config=cfg, **kw)
        assert fused.dtype == torch.bfloat16 and torch.equal(fused, separate)
        ref = lora_gemm_ref(x, p["q"], p["sw"], quantize_x=rounding, out_dtype=torch.float32, **kw)
        assert torch.equal(ref, lora_gemm_ref(xq, p["q"], p["sw"], x_scale=xs, out_dtype=torch.float32, **kw))
        assert rel_err(fused.float(), ref) < 1e-2


def test_quantize_x_argument_errors(device):
    p = _problem(4, 64, [64], 1, 16, device)
    xq, xs = fp8.quantize_activation_ref(p["x"])
    with pytest.raises(ValueError, match="quantize_x 'nearest'"):
        lora_gemm(p["x"], p["q"], p["sw"], quantize_x="nearest")
    with pytest.raises(ValueError, match="quantize_x takes 16-bit x"):
        lora_gemm(xq, p["q"], p["sw"], quantize_x="div")
    with pytest.raises(ValueError, match="quantize_x takes 16-bit x"):
        lora_gemm(p["x"], p["q"], p["sw"], x_scale=xs, quantize_x="div")


@pytest.mark.parametrize("adapter", [False, True])
def test_projection_w8a8_quantizes_in_k2_at_decode(adapter, device):
    """fp8_lora_linear W8A8: at <= k2_quant_x_tokens tokens K2 quantizes x (dispatch "lora_gemm.x_quant" = k2);
    above, or with the knob at 0, a quantizer (or K1) does; the same bits either way."""
    from rlfp8.kernels import knobs
    p = _problem(5, 96, [48, 40, 40], 4, 16, device)
    args = (p["x"], p["q"], p["sw"]) + ((p["A"], p["B"], p["meta"]) if adapter else ())
    outs, paths = [], []
    for limit in (16, 4, 0):
        saved = knobs.set_knobs(k2_quant_x_tokens=limit)
        try:
            dispatch.reset_report()
            outs.append(fp8_lora_linear(*args, mode="w8a8"))
            paths.append(set(dispatch.report()["lora_gemm.x_quant"]))
        finally:
            knobs.restore_knobs(saved)
    assert paths[0] == {"k2"} and paths[1] == paths[2] and paths[2] <= {"k1", "kernel"}
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("adapter", [False, True])
def test_projection_takes_codes_made_by_the_caller(adapter, device):
    """fp8_lora_linear W8A8 with x_quant (the compiled engine's graph quantizes x, knob engine_graph_quant): the
    op launches no quantizer (dispatch "lora_gemm.x_quant" = graph) and, given the codes its own quantizer makes,
    returns the same bits; other codes change the output (they are what K2 reads)."""
    p = _problem(5, 96, [48, 40, 40], 4, 16, device)
    x = torch.randn(5, 96, dtype=torch.bfloat16, device=device)
    args = (x, p["q"], p["sw"]) + ((p["A"], p["B"], p["meta"]) if adapter else ())
    dispatch.reset_report()
    own = fp8_lora_linear(*args, mode="w8a8")
    assert set(dispatch.report()["lora_gemm.x_quant"]) <= {"k1", "kernel"}
    dispatch.reset_report()
    given = fp8_lora_linear(*args, mode="w8a8", x_quant=fp8.quantize_activation_ref(x, "div"))
    assert set(dispatch.report()["lora_gemm.x_quant"]) == {"graph"}
    assert torch.equal(own, given)
    x_q, x_s = fp8.quantize_activation_ref(x, "div")
    other = fp8_lora_linear(*args, mode="w8a8", x_quant=(x_q, x_s * 2))
    assert not torch.equal(other, own)


def test_projection_x_quant_errors(device):
    p = _problem(5, 96, [48, 40, 40], 4, 16, device)
    x = torch.randn(5, 96, dtype=torch.bfloat16, device=device)
    x_q, x_s = fp8.quantize_activation_ref(x)
    with pytest.raises(ValueError, match="x_quant is for mode 'w8a8'"):
        fp8_lora_linear(x, p["q"], p["sw"], mode="w8a16", x_quant=(x_q, x_s))
    with pytest.raises(ValueError, match=r"codes must be float8_e4m3fn of x's shape \(5, 96\)"):
        fp8_lora_linear(x, p["q"], p["sw"], mode="w8a8", x_quant=(x_q[:4], x_s))
    with pytest.raises(ValueError, match=r"scales must be float32 \[5, 1\]"):
        fp8_lora_linear(x, p["q"], p["sw"], mode="w8a8", x_quant=(x_q, x_s[:, 0]))


# knob k2_prefetch_epilogue: slice layouts over BLOCK_N = 32 tiles (N = 84: a ragged last tile), slot patterns cycled
# over the rows (None: no metadata, every row slot 0; "two": the per-slot loop runs twice; rows without adapter)
PREFETCH_SLICES = {"one": [64], "aligned": [32, 32, 32],
                   "straddle": [24, 40, 20]}    # tile 0 spans slices 0-1, tile 1 starts inside slice 1, tile 2 in 2
PREFETCH_SLOTS = {"no_meta": None, "one": [1, -1], "two": [1, -1, 0]}


def _prefetch_problem(M, widths, slots, mode, device, r=16, K=64, S=3):
    g = torch.Generator().manual_seed(M * 100 + len(widths))
    N = sum(widths)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(device)
    q, sw = fp8.quantize_weight_ref(torch.randn(N, K, generator=g).to(device) * 0.05)
    A = [(torch.randn(S, r, K, generator=g) * 0.1).to(torch.bfloat16).to(device) for _ in widths]
    B = [(torch.randn(S, n, r, generator=g) * 0.1).to(torch.bfloat16).to(device) for n in widths]
    if slots is None:
        return dict(x=x, q=q, sw=sw, A=[a[:1] for a in A], B=[b[:1] for b in B], slots=None, meta=None)
    slot_t = torch.tensor([slots[i % len(slots)] for i in range(M)], device=device)
    return dict(x=x, q=q, sw=sw, A=A, B=B, slots=slot_t, meta=build_lora_meta(slot_t, S))


PREFETCH_PLACES = K2_PREFETCH_EPILOGUE[1:]     # every place but off


def _k2_prefetch(where, p, mode, cfg, k1_in_k2=False, g=None):
    """K2 (fp32 out) with the knob set to `where`; h from K1's programs in its grid (k1_in_k2) or from the torch
    shrink. Returns (y, the h it read, x codes, x scales, the dispatch record)."""
    from rlfp8.kernels import knobs
    from rlfp8.kernels.shrink_triton import shrink_programs
    xq, xs = fp8.quantize_activation_ref(p["x"]) if mode == "w8a8" else (p["x"], None)
    saved = knobs.set_knobs(k2_prefetch_epilogue=where)
    try:
        dispatch.reset_report()
        if k1_in_k2:
            progs = shrink_programs(p["x"], p["A"], p["meta"], mode=mode)
            h, kw = progs.out.h, dict(shrink=progs)
        else:
            h, kw = lora_shrink_ref(p["x"], p["A"], p["meta"]).h, {}
        y = lora_gemm_triton(xq, p["q"], p["sw"], x_scale=xs, h=h, B=p["B"], meta=p["meta"], g=g, config=cfg,
                             out_dtype=torch.float32, **kw)
        return y, h.clone(), xq, xs, dispatch.report().get("lora_gemm.prefetch_epilogue")
    finally:
        knobs.restore_knobs(saved)


@pytest.mark.parametrize("slots", list(PREFETCH_SLOTS))
@pytest.mark.parametrize("slices", list(PREFETCH_SLICES))
@pytest.mark.parametrize("M", [1, 4, 16])
@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_prefetched_epilogue_gives_the_same_bits(mode, M, slices, slots, device, monkeypatch):
    """Knob k2_prefetch_epilogue (<= 16 tokens): s_w, s_x, the slots and the first slot's B tile loaded before the
    main loop, after it, or split between the two give the bits of the loads in the epilogue (the dispatch records
    which ran), with K1's programs in K2's grid and without, split-K 1 and 2, both main-loop orientations; and the
    fp64 math. With metadata, the per-slot epilogue (the one that takes the prefetched tile; three segments would
    pick the slot pipeline)."""
    from rlfp8.kernels import gemm_triton
    monkeypatch.setattr(gemm_triton, "_PIPE_SLOTS_OVERRIDE", False)
    p = _prefetch_problem(M, PREFETCH_SLICES[slices], PREFETCH_SLOTS[slots], mode, device)
    for split, k1_in_k2 in ((1, False), (2, True), (2, False), (1, True)):
        cfg = GemmConfig(32, 16, 32, split, 1, 4, 2, swap_ab=split == 1)
        y_off, h_off, xq, xs, path_off = _k2_prefetch("off", p, mode, cfg, k1_in_k2)
        assert path_off == {"off": 1}
        for where in PREFETCH_PLACES:
            y_on, h, _, _, path_on = _k2_prefetch(where, p, mode, cfg, k1_in_k2)
            assert path_on == {where: 1}
            assert torch.equal(h, h_off) and torch.equal(y_on, y_off), (where, split, k1_in_k2)
        ref = gemm_fp64(xq, p["q"], p["sw"], x_scale=xs, h=h_off, B=p["B"], slots=p["slots"])
        assert rel_err(y_off, ref) < 1e-5


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_prefetched_epilogue_beside_the_unchanged_epilogues(mode, device):
    """The epilogues whose B loads stay after the main loop (the slot pipeline at three adapters, rank chunks above
    64, DoRA's g) with the scales and slots prefetched: the same bits, and the torch reference's values."""
    for r, slots, g in ((16, [2, 0, -1, 1], None), (96, [1, -1, 0], None), (16, [1, -1, 0], True)):
        p = _prefetch_problem(16, PREFETCH_SLICES["straddle"], slots, mode, device, r=r)
        gv = torch.rand(3, 84, device=device) + 0.5 if g else None
        cfg = GemmConfig(32, 16, 32, 1, 1, 4, 2)
        y_off, h, xq, xs, _ = _k2_prefetch("off", p, mode, cfg, g=gv)
        for where in PREFETCH_PLACES:
            y_on, _, _, _, _ = _k2_prefetch(where, p, mode, cfg, g=gv)
            assert torch.equal(y_on, y_off), (where, r, slots, g)
        ref = lora_gemm_ref(xq, p["q"], p["sw"], x_scale=xs, h=h, B=p["B"], meta=p["meta"], g=gv,
                            out_dtype=torch.float32)
        assert rel_err(y_off, ref) < 1e-5


def test_prefetch_epilogue_only_at_decode_sizes_and_by_the_knob(device):
    """PREFETCH_EPI at <= 16 tokens where the knob places it (1 before the main loop, 2 after, 3 split; dispatch
    "lora_gemm.prefetch_epilogue" = the place); 0 with the knob off (= off) or B slices of two dtypes (the first tile
    is picked among the slices at run time; = off); above 16 tokens never, and nothing recorded. A place the knob
    does not know is refused, naming the knob and its values."""
    from rlfp8.kernels import _triton_utils as tu
    from rlfp8.kernels import knobs
    assert knobs.knobs().k2_prefetch_epilogue == "split"         # the default (bench/README.md session 22)
    assert knobs._env_overrides({"RLFP8_K2_PREFETCH_EPILOGUE": "split"}) == {"k2_prefetch_epilogue": "split"}
    with pytest.raises(ValueError, match=r"RLFP8_K2_PREFETCH_EPILOGUE='1': allowed values are \('off', 'before_loop'"):
        knobs._env_overrides({"RLFP8_K2_PREFETCH_EPILOGUE": "1"})
    with pytest.raises(ValueError, match=r"kernels.k2_prefetch_epilogue=True: allowed values"):
        knobs.check_section({"k2_prefetch_epilogue": True})

    def launched(M, on="before_loop", b_dtypes=(torch.bfloat16, torch.bfloat16)):
        p = _prefetch_problem(M, [32, 32], [0], "w8a16", device)
        B = [b.to(dt) for b, dt in zip(p["B"], b_dtypes)]
        saved = knobs.set_knobs(k2_prefetch_epilogue=on)
        try:
            dispatch.reset_report()
            with tu.collect_launches() as rec:
                lora_gemm_triton(p["x"], p["q"], p["sw"], h=torch.zeros(2, M, 16, device=device), B=B,
                                 meta=p["meta"], config=SMALL)
            return rec[0][3]["PREFETCH_EPI"], dispatch.report().get("lora_gemm.prefetch_epilogue")
        finally:
            knobs.restore_knobs(saved)

    assert launched(16) == (1, {"before_loop": 1})
    assert launched(16, on="after_loop") == (2, {"after_loop": 1})
    assert launched(1, on="split") == (3, {"split": 1})
    assert launched(16, on="off") == (0, {"off": 1})
    assert launched(3, b_dtypes=(torch.bfloat16, torch.float32)) == (0, {"off": 1})
    assert launched(17) == (0, None)
