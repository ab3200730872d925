"""Large LoRA ranks (issue 16): K2's epilogue multiplies h·Bᵀ in rank chunks of 32 above rank 64
(gemm_configs.rank_chunk) and K1 splits a tile's ranks over programs of 128 (shrink_triton.shrink_rank_block). Under
the interpreter at ranks 16 (one chunk), 96 (three chunks, the last partly masked) and 384 (twelve chunks, K1 three
rank blocks) against fp64 math and
the references, for every slot path (no metadata, the per-slot loop, PIPE_SLOTS) with and without DoRA's g; the
same bits for every slot path and for an engine slot padded to a larger rank; the dispatch record of the chunk.
The training linear's and DoRA's fwd+bwd at rank 384: test_linear_triton.py, test_dora_triton.py."""
import pytest
import torch

from rlfp8.kernels import dispatch, fp8, gemm_triton
from rlfp8.kernels.gemm_configs import GemmConfig, rank_chunk, block_r
from rlfp8.kernels.gemm_ref import lora_gemm_ref
from rlfp8.kernels.gemm_triton import lora_gemm_triton
from rlfp8.kernels.metadata import build_lora_meta
from rlfp8.kernels.shrink_ref import lora_shrink_ref
from rlfp8.kernels.shrink_triton import lora_shrink_triton
from tests.conftest import rel_err
from tests.oracles import gemm_fp64, shrink_fp64

CFG = GemmConfig(64, 16, 32, 1, 2, 4, 2)
RANKS = (16, 96, 384)


def _problem(M, K, widths, S, r, device, slots):
    x = torch.randn(M, K, dtype=torch.bfloat16, device=device)
    q, sw = fp8.quantize_weight_ref(torch.randn(sum(widths), K, device=device) * 0.05)
    B = [torch.randn(S, n, r, dtype=torch.bfloat16, device=device) * 0.1 for n in widths]
    h = torch.randn(len(widths), M, r, device=device)              # fp32, as K1 leaves it
    if slots is not None:
        h[:, slots < 0] = 0.0
    return x, q, sw, h, B


def _slots(path, M, S, device):
    if path == "slot0":
        return None
    slots = torch.randint(0, S, (M,), device=device) if path == "pipe" else torch.zeros(M, dtype=torch.long)
    slots[::5] = -1                                                # tokens without adapter
    return slots.to(device)


@pytest.fixture
def pipe_slots(monkeypatch):
    def force(on):
        monkeypatch.setattr(gemm_triton, "_PIPE_SLOTS_OVERRIDE", on)
    return force


@pytest.mark.parametrize("r", RANKS)
@pytest.mark.parametrize("path", ["slot0", "per_slot", "pipe"])
@pytest.mark.parametrize("with_g", [True, False])
def test_k2_rank_chunks_vs_fp64_every_slot_path(r, path, with_g, pipe_slots, device):
    M, K, widths = 20, 32, [40, 24]                               # tile [0, 64) spans both slices
    S = 1 if path == "slot0" else 3
    slots = _slots(path, M, S, device)
    x, q, sw, h, B = _problem(M, K, widths, S, r, device, slots)
    N = sum(widths)
    g = torch.rand(S, N, device=device) + 0.5 if with_g else None
    bias = torch.randn(N, dtype=torch.bfloat16, device=device)
    meta = None if slots is None else build_lora_meta(slots, S)
    pipe_slots(path == "pipe")
    dispatch.reset_report()
    y = lora_gemm_triton(x, q, sw, h=h, B=B, meta=meta, g=g, bias=bias, out_dtype=torch.float32, config=CFG)
    assert dispatch.report()["lora_gemm.rank_chunk"] == {str(rank_chunk(block_r(r))): 1}
    ref64 = gemm_fp64(x, q, sw, h=h, B=B, slots=slots, g=g, bias=bias)
    assert rel_err(y, ref64) < 1e-5                                # bf16x2: ~2^-17 per product
    yref = lora_gemm_ref(x, q, sw, h=h, B=B, meta=meta, g=g, bias=bias, out_dtype=torch.float32)
    assert rel_err(y, yref) < 1e-5


@pytest.mark.parametrize("r", (96, 384))
def test_k2_every_slot_path_and_a_padded_engine_slot_give_the_same_bits(r, pipe_slots, device):
    """The trainer's call (no metadata, rank r), the engine's per-slot loop and PIPE_SLOTS on slot 1 of three
    whose B is padded with zeros by two rank chunks beyond BLOCK_R: the same MMAs in the same order
    on every row (the extra chunks add exact zeros), so bit-identical outputs."""
    M, K, N, S = 24, 32, 64, 3
    x, q, sw, h, B = _problem(M, K, [N], 1, r, device, None)
    g = torch.rand(1, N, device=device) + 0.5
    y_tr = lora_gemm_triton(x, q, sw, h=h, B=B, g=g, config=CFG)
    r_pad = block_r(r) + 2 * rank_chunk(block_r(r))
    B_pad = torch.randn(S, N, r_pad, dtype=torch.bfloat16, device=device)
    B_pad[1] = 0.0
    B_pad[1, :, :r] = B[0][0]
    h_pad = torch.zeros(1, M, r_pad, device=device)
    h_pad[..., :r] = h
    g_pad = torch.rand(S, N, device=device) + 0.5
    g_pad[1] = g[0]
    meta = build_lora_meta(torch.ones(M, dtype=torch.long, device=device), S)
    for pipe in (False, True):
        pipe_slots(pipe)
        y_eng = lora_gemm_triton(x, q, sw, h=h_pad, B=[B_pad], meta=meta, g=g_pad, config=CFG)
        assert torch.equal(y_eng, y_tr), f"PIPE_SLOTS={pipe}"


@pytest.mark.parametrize("r", RANKS + (256,))
def test_k1_rank_blocks_vs_fp64(r, device):
    """K1 with the tile's ranks over several programs (above 128), no metadata and with segments, split-K."""
    M, K, S = 21, 96, 2
    x = torch.randn(M, K, dtype=torch.bfloat16, device=device)
    A = [torch.randn(S, r, K, dtype=torch.bfloat16, device=device) * 0.1 for _ in range(2)]
    slots = torch.randint(-1, S, (M,), device=device)
    dispatch.reset_report()
    h = lora_shrink_triton(x, A, build_lora_meta(slots, S)).h
    blocks = max(1, block_r(r) // 128)
    assert dispatch.report()["lora_shrink.rank_blocks"] == {str(blocks): 1}
    assert rel_err(h, shrink_fp64(x, A, slots)) < 1e-5
    h0 = lora_shrink_triton(x, A[0][:1], None).h
    assert torch.equal(h0, lora_shrink_ref(x, A[0][:1], None).h) or rel_err(h0, shrink_fp64(x, A[:1], None)) < 1e-5
