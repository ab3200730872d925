"""K1 (lora_shrink) under the interpreter vs its reference and fp64 math."""
import pytest
import torch

from rlfp8.kernels import _triton_utils as tu
from rlfp8.kernels import dispatch, fp8
from rlfp8.kernels.metadata import build_lora_meta
from rlfp8.kernels.shrink import lora_shrink
from rlfp8.kernels.shrink_ref import lora_shrink_ref
from rlfp8.kernels.shrink_triton import ShrinkConfig, lora_shrink_triton
from tests.conftest import rel_err
from tests.oracles import shrink_fp64

SENTINEL = 7.25


def _case(M, K, S, r, L, device, none_frac=0.25):
    x = torch.randn(M, K, dtype=torch.bfloat16, device=device)
    A = [torch.randn(S, r, K, dtype=torch.bfloat16, device=device) * 0.1 for _ in range(L)]
    slots = torch.randint(0, S, (M,), device=device)
    slots[torch.rand(M, device=device) < none_frac] = -1
    slots[0], slots[-1] = -1, S - 1                          # at least one token without adapter
    return x, A, slots




@pytest.mark.parametrize("cfg", [None, ShrinkConfig(16, 32, 3), ShrinkConfig(32, 64, 1)],
                         ids=["heuristic", "split3", "nosplit"])
@pytest.mark.parametrize("quant", [None, "div", "recip"])
def test_multi_adapter_slices_quant(cfg, quant, device):
    M, K, S, r, L = 37, 160, 4, 16, 3                       # K not a multiple of 64: masked tail
    x, A, slots = _case(M, K, S, r, L, device)
    meta = build_lora_meta(slots, S)
    out = torch.full((L, M, r), SENTINEL, device=device)
    res = lora_shrink_triton(x, A, meta, quant=quant, out=out, config=cfg)
    ref64 = shrink_fp64(x.cpu(), [a.cpu() for a in A], slots.cpu())
    has = slots >= 0
    assert res.h is out
    assert torch.all(res.h[:, ~has] == SENTINEL)             # rows without adapter untouched
    assert rel_err(res.h[:, has], ref64[:, has.cpu()]) < 1e-5  # fp32 accumulation of exact bf16 products
    if quant is None:
        assert res.x_q is None and res.x_scale is None
    else:
        qr, sr = fp8.quantize_activation_ref(x, quant)
        assert torch.equal(res.x_q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(res.x_scale, sr)


def test_split_k_deterministic_and_equal_to_reference_order(device):
    M, K, S, r = 20, 256, 3, 32
    x, A, slots = _case(M, K, S, r, 1, device)
    meta = build_lora_meta(slots, S)
    a = lora_shrink_triton(x, A, meta, config=ShrinkConfig(16, 32, 4)).h
    b = lora_shrink_triton(x, A, meta, config=ShrinkConfig(16, 32, 4)).h
    assert torch.equal(a, b)
    ref = lora_shrink_ref(x, A, meta).h
    assert rel_err(a, ref) < 1e-5


def test_single_adapter_no_metadata_vllm_layout(device):
    M, K, r = 19, 96, 16
    x = torch.randn(M, K, dtype=torch.bfloat16, device=device)
    A4 = torch.randn(2, 1, r, K, dtype=torch.bfloat16, device=device)      # vLLM [S, 1, r, K]
    h = lora_shrink_triton(x, A4, None, config=ShrinkConfig(16, 32, 2)).h  # every token slot 0
    ref = (x.double() @ A4[0, 0].double().t())[None]
    assert h.shape == (1, M, r) and rel_err(h, ref) < 1e-5
    # the metadata path with all tokens on slot 0 gives the same bits (same config: same order)
    h2 = lora_shrink_triton(x, A4, build_lora_meta(torch.zeros(M, dtype=torch.long, device=device), 2),
                            config=ShrinkConfig(16, 32, 2)).h
    assert torch.equal(h, h2)


def test_no_lora_flag_skips_shrink_but_still_quantizes(device):
    M, K, S, r = 9, 64, 2, 16
    x, A, _ = _case(M, K, S, r, 1, device)
    meta = build_lora_meta(torch.full((M,), -1, device=device), S)
    res = lora_shrink_triton(x, A, meta, quant="div", out=torch.full((1, M, r), SENTINEL, device=device))
    assert torch.all(res.h == SENTINEL)
    qr, sr = fp8.quantize_activation_ref(x)
    assert torch.equal(res.x_q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(res.x_scale, sr)


def test_dispatch_and_errors(device):
    x, A, slots = _case(8, 64, 2, 16, 1, device)
    meta = build_lora_meta(slots, 2)
    dispatch.reset_report()
    with dispatch.use_backend("triton"):
        lora_shrink(x, A, meta)
    with dispatch.use_backend("torch"):
        lora_shrink(x, A, meta)
    assert dispatch.report() == {"lora_shrink": {"triton": 1, "torch": 1},
                                 "lora_shrink.schedule": {"batch_invariant": 1},      # W8A16 (knob auto)
                                 "lora_shrink.rank_blocks": {"1": 1}}
    with pytest.raises(ValueError, match=r"A\[0\] has last dim 32, expected 64"):
        lora_shrink_triton(x, torch.zeros(2, 16, 32, dtype=torch.bfloat16, device=device), meta)
    with pytest.raises(ValueError, match=r"metadata covers 8 tokens .* x has 7 rows"):
        lora_shrink_triton(x[:7], A, meta)
    with pytest.raises(TypeError, match=r"A\[0\] must have dtype"):
        lora_shrink_triton(x, [a.float() for a in A], meta)
    with pytest.raises(ValueError, match=r"out must have shape \[1, 8, 16\]"):
        lora_shrink_triton(x, A, meta, out=torch.zeros(1, 8, 8, device=device))


@pytest.mark.parametrize("quant", ["div", "recip"])
def test_fused_quant_two_pass_rows_many_segments(quant, device):
    """The quantization programs of K1 (token order, one row each for K >= 4096, two passes when K > 4096)
    beside the shrink programs of several segments: codes and scales bit-equal to the reference."""
    M, K, S, r, L = 9, 4100, 4, 16, 2
    x, A, slots = _case(M, K, S, r, L, device)
    x[3] = 0.0                                                  # an all-zero token: the smallest scale
    meta = build_lora_meta(slots, S)
    res = lora_shrink_triton(x, A, meta, quant=quant, config=ShrinkConfig(16, 128, 2))
    qr, sr = fp8.quantize_activation_ref(x, quant)
    assert torch.equal(res.x_q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(res.x_scale, sr)
    has = slots >= 0
    ref64 = shrink_fp64(x.cpu(), [a.cpu() for a in A], slots.cpu())
    assert rel_err(res.h[:, has], ref64[:, has.cpu()]) < 1e-5


def test_grid_is_quant_programs_then_shrink_programs():
    """One 1-D launch: ceil(T / QBLOCK_M) quantization programs, then SPLIT_K x m_tiles x L x segments."""
    M, K, S, r = 40, 4096, 3, 16
    x = torch.empty(M, K, dtype=torch.bfloat16)
    A = [torch.empty(S, r, K, dtype=torch.bfloat16)] * 3
    meta = build_lora_meta(torch.arange(M) % (S + 1) - 1, S)
    cfg = ShrinkConfig(16, 128, 4)
    with tu.collect_launches() as rec:
        lora_shrink_triton(x, A, meta, quant="div", config=cfg)
        lora_shrink_triton(x, A, meta, config=cfg)
    (_, g_q, _, kw_q), (_, g_n, _, kw_n) = rec
    shrink = cfg.split_k * 3 * 3 * meta.num_active                   # split x m_tiles x L x segments
    assert kw_q["QBLOCK_M"] == 1 and kw_q["QBLOCK_K"] == 4096 and g_q == (M + shrink,)
    assert g_n == (shrink,) and kw_n["QUANT"] == 0


@pytest.mark.parametrize("rank_block", [16, 32, 64])
def test_decode_rank_blocks_keep_h_and_multiply_the_programs(rank_block, device):
    """Knob k1_decode_rank_block: at <= 16 tokens a tile's ranks go to rank_block-wide programs (more programs,
    each its own h columns, split-K partials reduced per block); h is the same as with the whole rank in one
    program; above 16 tokens the knob does nothing. Rank 48 (BLOCK_R 64) leaves the last 16-block empty."""
    from rlfp8.kernels import knobs
    M, K, S, r = 11, 1024, 3, 48
    x = torch.randn(M, K, dtype=torch.bfloat16, device=device)
    A = [(torch.randn(S, r, K, device=device) * 0.1).to(torch.bfloat16) for _ in range(2)]
    meta = build_lora_meta(torch.arange(M, device=device) % (S + 1) - 1, S)
    cfg = ShrinkConfig(16, 128, 4)
    outs, grids = [], []
    for rb in (0, rank_block):
        saved = knobs.set_knobs(k1_decode_rank_block=rb)
        try:
            dispatch.reset_report()
            outs.append(lora_shrink_triton(x, A, meta, config=cfg).h)
            assert dispatch.report()["lora_shrink.rank_blocks"] == {str(64 // (rb or 64)): 1}
            with tu.collect_launches() as rec:
                lora_shrink_triton(x, A, meta, config=cfg)
                lora_shrink_triton(torch.empty(17, K, dtype=torch.bfloat16, device=device), A,
                                   build_lora_meta(torch.zeros(17, dtype=torch.long, device=device), S), config=cfg)
            grids.append([(g, kw["BR_BLOCK"]) for _, g, _, kw in rec])
        finally:
            knobs.restore_knobs(saved)
    if device == "cuda":
        assert torch.equal(outs[0], outs[1])
    else:
        # The interpreter's tl.dot is numpy's sgemm, whose summation order depends on the dot's width and the CPU's
        # OpenBLAS kernel (Haswell/Zen kernels give a 16-wide slice other bits than the 64-wide dot): same bits is a
        # GPU property (the branch above, and tests/gpu/test_kernels_gpu.py::test_k1_decode_rank_blocks_same_bits);
        # here the split may differ by fp32 rounding only.
        assert rel_err(outs[1], outs[0]) < 1e-6
    blocks = 64 // rank_block
    assert grids[1][0] == ((grids[0][0][0][0] * blocks,), rank_block) and grids[0][0][1] == 64
    assert grids[1][1] == grids[0][1]                               # 17 tokens: the whole rank per program
    has = meta.token_lora_mapping >= 0
    ref64 = shrink_fp64(x.cpu(), [a.cpu() for a in A], meta.token_lora_mapping.cpu())
    assert rel_err(outs[1][:, has], ref64[:, has.cpu()]) < 1e-5


def test_masked_padding_rows_keep_h(device):
    """Knob k1_mask_x_rows: at <= 16 tokens a tile's rows past its segment load no x (MASK_ROWS); h is the same,
    with metadata (segments of 1-3 tokens in 16-row tiles) and without; above 16 tokens the knob does nothing."""
    from rlfp8.kernels import knobs
    M, K, S, r = 7, 640, 3, 16
    x = torch.randn(M, K, dtype=torch.bfloat16, device=device)
    A = [(torch.randn(S, r, K, device=device) * 0.1).to(torch.bfloat16) for _ in range(3)]
    meta = build_lora_meta(torch.arange(M, device=device) % (S + 1) - 1, S)
    outs = {}
    for masked in (False, True):
        saved = knobs.set_knobs(k1_mask_x_rows=masked)
        try:
            outs[masked] = [lora_shrink_triton(x, A, m, quant=qt, config=ShrinkConfig(16, 128, 2)).h
                            for m in (meta, None) for qt in (None, "div")]
            with tu.collect_launches() as rec:
                lora_shrink_triton(x, A, meta)
                lora_shrink_triton(torch.empty(17, K, dtype=torch.bfloat16, device=device), A, None)
            assert [kw["MASK_ROWS"] for *_, kw in rec] == [masked, False]
        finally:
            knobs.restore_knobs(saved)
    has = meta.token_lora_mapping >= 0
    for a, b, m in zip(outs[False], outs[True], (meta, meta, None, None)):
        assert torch.equal(a[:, has], b[:, has]) if m is not None else torch.equal(a, b)


def test_decode_split_max_knob(device):
    """Knob k1_decode_split_max: at decode sizes a 12288-wide K splits 16 ways in W8A8 (K1 quantizing) by default
    and 8 ways at 8, the sum unrolled; W8A16 keeps 8 (the trainer's schedule); a rank-128 tile, whose 16 partials
    would not unroll, stays at 8; 64 tokens stay at 8. h within fp32 accumulation of the
    fp64 math every time; a bad value names the knob."""
    from rlfp8.kernels import knobs
    from rlfp8.kernels.shrink_triton import invariant_shrink_config, shrink_config
    M, K, S, r = 3, 12288, 2, 64
    x, A, slots = _case(M, K, S, r, 1, device)
    meta = build_lora_meta(slots, S)
    ref64 = shrink_fp64(x.cpu(), [a.cpu() for a in A], slots.cpu())
    has = slots >= 0
    saved = knobs.set_knobs()
    try:
        assert knobs.knobs().k1_decode_split_max == 16 and invariant_shrink_config(K, r).split_k == 8
        assert shrink_config(M, K, r, 16).split_k == 16 and shrink_config(M, K, 128, 16).split_k == 8
        assert shrink_config(64, K, r, 16).split_k == 8 == shrink_config(M, K, r).split_k
        for split_max in (16, 8):
            knobs.set_knobs(k1_decode_split_max=split_max)
            for quant, split in (("div", split_max), (None, 8)):
                with tu.collect_launches() as rec:
                    lora_shrink_triton(x, A, meta, quant=quant)
                assert rec[0][3]["SPLIT_K"] == split and rec[0][3]["RED_UNROLL"]
                h = lora_shrink_triton(x, A, meta, quant=quant).h
                assert rel_err(h[:, has], ref64[:, has.cpu()]) < 1e-5
        with pytest.raises(ValueError, match=r"kernels\.k1_decode_split_max=12.*\(8, 16\)"):
            knobs.apply_config({"k1_decode_split_max": 12})
    finally:
        knobs.restore_knobs(saved)
