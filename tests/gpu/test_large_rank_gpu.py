"""GPU tier for large LoRA ranks (issue 16's speed line; marked gpu, skipped without CUDA): K2's rank-chunked
epilogue and K1's rank blocks at rank 384 on bench/dora.py's shapes, with the configs the dispatch picks.
  * K2 vs fp64 (fp32 out) for every slot path (no metadata, per-slot loop, PIPE_SLOTS) with DoRA's g;
  * every slot path the same bits, and an engine slot padded to compat.slot_rank(384) = 512 the trainer's bits
    (the matched property at large rank: fp8_lora_linear W8A16 vs lora_linear_triton on the same rows);
  * the training linear and DoRA's fwd+bwd at 4096 tokens vs their references;
  * the dispatch records the chunk (lora_gemm.rank_chunk) and K1's rank blocks (lora_shrink.rank_blocks)."""
from __future__ import annotations

import pytest
import torch

from rlfp8.kernels import dispatch, fp8, fp8_lora_linear, gemm_triton
from rlfp8.kernels import dora as kdora
from rlfp8.kernels.dora_triton import DoRALinearTriton
from rlfp8.kernels.gemm_triton import lora_gemm_triton
from rlfp8.kernels.linear_ref import LoRALinearRef
from rlfp8.kernels.linear_triton import lora_linear_triton
from rlfp8.kernels.metadata import build_lora_meta
from rlfp8.rollout.compat import slot_rank
from tests.conftest import rel_err
from tests.oracles import gemm_fp64

pytestmark = pytest.mark.gpu
DEV = "cuda"
SHAPES = {"8192x8192": (8192, 8192), "8192x28672": (8192, 28672)}       # (N out, K in), bench/dora.py
R = 384


def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def _base(N, K, seed=0):
    return fp8.quantize_weight(torch.randn(N, K, device=DEV, dtype=torch.bfloat16, generator=_gen(seed)) * 0.02)


@pytest.fixture(autouse=True)
def _triton_backend():
    dispatch.set_backend("triton")
    yield
    dispatch.set_backend("auto")
    gemm_triton._PIPE_SLOTS_OVERRIDE = None


@pytest.mark.parametrize("path", ["slot0", "per_slot", "pipe"])
@pytest.mark.parametrize("M", [64, 1000])
def test_k2_rank_384_vs_fp64_every_slot_path(path, M):
    N, K = SHAPES["8192x8192"]
    q, sw = _base(N, K)
    S = 1 if path == "slot0" else 4
    g = _gen(1)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, generator=g)
    B = torch.randn(S, N, R, device=DEV, generator=g).mul_(0.05).to(torch.bfloat16)
    h = torch.randn(1, M, R, device=DEV, generator=g)
    gs = torch.rand(S, N, device=DEV, generator=g) + 0.5
    slots = None if path == "slot0" else (torch.randint(0, S, (M,), device=DEV, generator=g) if path == "pipe"
                                          else torch.zeros(M, dtype=torch.long, device=DEV))
    meta = None if slots is None else build_lora_meta(slots, S)
    gemm_triton._PIPE_SLOTS_OVERRIDE = None if slots is None else path == "pipe"
    dispatch.reset_report()
    y = lora_gemm_triton(x, q, sw, h=h, B=B, meta=meta, g=gs, out_dtype=torch.float32)
    assert dispatch.report()["lora_gemm.rank_chunk"] == {"32": 1}
    assert rel_err(y, gemm_fp64(x, q, sw, h=h, B=[B], slots=slots, g=gs)) < 1e-4     # as test_projection_vs_fp64


@pytest.mark.parametrize("M", [16, 256, 4096])
def test_matched_property_rank_384_engine_slot_padded_to_512(M):
    """Engine: 4 slots of rank slot_rank(384) = 512 (zero-padded as vLLM pads them), metadata, some tokens without
    adapter; trainer: slot 2's adapter at rank 384, no metadata: bit-identical rows."""
    N, K = SHAPES["8192x8192"]
    q, sw = _base(N, K, seed=3)
    S, s, r_slot = 4, 2.0, slot_rank(R)
    g = _gen(4)
    As = [torch.randn(R, K, device=DEV, generator=g) * 0.02 for _ in range(S)]
    Bs = [torch.randn(N, R, device=DEV, generator=g) * 0.02 for _ in range(S)]
    A_stack = torch.zeros(S, r_slot, K, device=DEV, dtype=torch.bfloat16)
    B_stack = torch.zeros(S, N, r_slot, device=DEV, dtype=torch.bfloat16)
    for i in range(S):
        A_stack[i, :R] = As[i].to(torch.bfloat16)
        B_stack[i, :, :R] = (Bs[i] * s).to(torch.bfloat16)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, generator=g)
    slots = torch.randint(-1, S, (M,), device=DEV, generator=g)
    slots[: max(1, M // 4)] = 2
    with torch.no_grad():
        y_eng = fp8_lora_linear(x, q, sw, A_stack, B_stack, build_lora_meta(slots, S), mode="w8a16")
        y_tr = lora_linear_triton(x, q, sw, As[2], Bs[2], s)
    rows = slots == 2
    diff = (y_eng[rows].float() - y_tr[rows].float()).abs().max().item()
    assert torch.equal(y_eng[rows], y_tr[rows]), f"max |diff| {diff}"


def test_k2_slot_paths_same_bits_rank_384():
    N, K = SHAPES["8192x8192"]
    q, sw = _base(N, K, seed=5)
    M, S = 256, 4
    g = _gen(6)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, generator=g)
    B = torch.randn(S, N, R, device=DEV, generator=g).mul_(0.05).to(torch.bfloat16)
    h = torch.randn(1, M, R, device=DEV, generator=g)
    gs = torch.rand(S, N, device=DEV, generator=g) + 0.5
    meta = build_lora_meta(torch.randint(0, S, (M,), device=DEV, generator=g), S)
    outs = []
    for pipe in (True, False):
        gemm_triton._PIPE_SLOTS_OVERRIDE = pipe
        outs.append(lora_gemm_triton(x, q, sw, h=h, B=B, meta=meta, g=gs))
    assert torch.equal(*outs)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_training_linear_and_dora_fwd_bwd_rank_384(shape):
    N, K = SHAPES[shape]
    M, s = 4096, 2.0
    q, sw = _base(N, K, seed=7)
    g = _gen(8)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_()
    A = (torch.randn(R, K, device=DEV, generator=g) * 0.01).requires_grad_()
    B = (torch.randn(N, R, device=DEV, generator=g) * 0.01).requires_grad_()
    dy = torch.randn(M, N, device=DEV, dtype=torch.bfloat16, generator=g)
    norm = kdora.dora_row_norm(q, sw, A, B, s)
    m = (norm * (torch.rand(N, device=DEV, generator=g) + 0.5)).requires_grad_()
    runs = {"lora": (lambda: lora_linear_triton(x, q, sw, A, B, s),
                     lambda: LoRALinearRef.apply(x, q, sw, A, B, s, None)),
            "dora": (lambda: DoRALinearTriton.apply(x, q, sw, A, B, m, norm, s, None),
                     lambda: kdora.DoRALinearRef.apply(x, q, sw, A, B, m, norm, s, None))}
    dispatch.reset_report()
    for kind, (ours, ref) in runs.items():
        outs = []
        for fn in (ours, ref):
            y = fn()
            y.backward(dy)
            outs.append([y.detach(), x.grad, A.grad, B.grad] + ([m.grad] if kind == "dora" else []))
            x.grad = A.grad = B.grad = m.grad = None
        errs = {n: rel_err(a, b) for n, a, b in zip(("y", "dx", "dA", "dB", "dm"), *outs)}
        assert all(e < 1e-2 for e in errs.values()), (kind, errs)
    rep = dispatch.report()
    assert set(rep["lora_gemm.rank_chunk"]) == {"32"} and set(rep["lora_shrink.rank_blocks"]) == {"4"}, rep
    assert rep["lora_gemm.smem"].get("fit_smem", 0) == 0, rep          # the epilogue no longer shrinks the tiles
