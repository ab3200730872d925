"""GPU tier for DoRA (issue 16; marked gpu, skipped without CUDA): the Triton norm pieces and column dot vs
their torch references and fp64 on real shapes, the DoRA training linear vs DoRALinearRef, and the matched
property with the engine's DoRA projection (fp8_lora_linear with g = dora_column_scale): same bits."""
from __future__ import annotations

import pytest
import torch

from rlfp8.kernels import dispatch, fp8
from rlfp8.kernels import dora as kdora
from rlfp8.kernels.dora_triton import DoRALinearTriton, col_dot_triton, norm_pieces_triton
from rlfp8.kernels import fp8_lora_linear
from tests.conftest import rel_err

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _base(N, K):
    return fp8.quantize_weight(torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * 0.02)


@pytest.mark.parametrize("N,K,r", [(8192, 8192, 384), (8192, 28672, 64), (28672, 8192, 512), (1000, 4100, 7)])
@pytest.mark.parametrize("precision", ["bf16x2", "ieee"])
def test_norm_pieces_vs_reference(N, K, r, precision):
    q, sw = _base(N, K)
    A = torch.randn(r, K, device=DEV) * 0.01
    w_sq, U = norm_pieces_triton(q, sw, A, precision=precision)
    w_sq_ref, U_ref = kdora.norm_pieces_ref(q, sw, A)
    assert rel_err(w_sq, w_sq_ref) <= 1e-6
    assert rel_err(U, U_ref) <= 1e-5
    rows = torch.randint(0, N, (64,), device=DEV)
    U64 = (q[rows].double() * sw[rows].double()[:, None]) @ A.double().t()
    assert rel_err(U[rows], U64) <= 1e-5


def test_row_norm_triton_vs_fp64_and_dispatch():
    N, K, r, s = 4096, 4096, 128, 2.0
    q, sw = _base(N, K)
    A, B = torch.randn(r, K, device=DEV) * 0.01, torch.randn(N, r, device=DEV) * 0.01
    dispatch.reset_report()
    n = kdora.dora_row_norm(q, sw, A, B, s)
    assert dispatch.report()[kdora.OP_NORM] == {"triton": 1}
    W64 = q.double() * sw.double()[:, None]
    assert rel_err(n, torch.linalg.norm(W64 + s * B.double() @ A.double(), dim=1)) <= 1e-5


def test_col_dot_vs_reference():
    dy = torch.randn(4096, 28672, device=DEV, dtype=torch.bfloat16)
    y = torch.randn_like(dy)
    bias = torch.randn(28672, device=DEV, dtype=torch.bfloat16)
    assert rel_err(col_dot_triton(dy, y, bias), kdora.col_dot_ref(dy, y, bias)) <= 1e-5


@pytest.mark.parametrize("T,N,K,r", [(2048, 4096, 4096, 64), (777, 1024, 4096, 384)])
def test_dora_linear_triton_vs_reference(T, N, K, r):
    s = 2.0
    q, sw = _base(N, K)
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    A = (torch.randn(r, K, device=DEV) * 0.01).requires_grad_()
    B = (torch.randn(N, r, device=DEV) * 0.01).requires_grad_()
    norm = kdora.dora_row_norm(q, sw, A, B, s)
    m = (norm * (torch.rand(N, device=DEV) + 0.5)).requires_grad_()
    dy = torch.randn(T, N, device=DEV, dtype=torch.bfloat16)
    outs = []
    for fn, backend in ((DoRALinearTriton, "triton"), (kdora.DoRALinearRef, "torch")):
        with dispatch.use_backend(backend):
            y = fn.apply(x, q, sw, A, B, m, norm, s, None)
            y.backward(dy)
        outs.append([y.detach(), x.grad, A.grad, B.grad, m.grad])
        x.grad = A.grad = B.grad = m.grad = None
    for name, got, ref in zip(("y", "dx", "dA", "dB", "dm"), *outs):
        assert rel_err(got, ref) <= 1e-2, name


def test_trainer_forward_matches_engine_dora_projection_bits():
    T, N, K, r, s = 1024, 4096, 4096, 64, 2.0
    q, sw = _base(N, K)
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    A, B = torch.randn(r, K, device=DEV) * 0.01, torch.randn(N, r, device=DEV) * 0.01
    m = kdora.weight_sq_norm(q, sw).sqrt() * 1.01
    norm = kdora.dora_row_norm(q, sw, A, B, s)
    y_tr = kdora.dora_linear(x, q, sw, A, B, m, norm, s)
    g = kdora.dora_column_scale(m, q, sw, A, B, s)
    y_eng = fp8_lora_linear(x, q, sw, A.to(torch.bfloat16)[None], (B * s).to(torch.bfloat16)[None], g=g[None])
    assert torch.equal(y_tr, y_eng)
