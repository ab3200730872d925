"""DoRA's Triton kernels under the interpreter vs their torch references (rlfp8.kernels.dora) and fp64, and the
DoRA training linear (K1 + K2 with g, the LoRA backward with g folded in) vs DoRALinearRef."""
import pytest
import torch

from rlfp8.kernels import dispatch, fp8
from rlfp8.kernels import dora as kdora
from rlfp8.kernels.dora_triton import DoRALinearTriton, col_dot_triton, norm_pieces_triton
from tests.conftest import rel_err


@pytest.mark.parametrize("precision", ["bf16x2", "ieee"])
@pytest.mark.parametrize("N,K,r", [(70, 96, 8), (33, 40, 20)])
def test_norm_pieces_vs_reference_and_fp64(precision, N, K, r, device):
    q, sw = fp8.quantize_weight_ref(torch.randn(N, K, device=device) * 0.1)
    A = torch.randn(r, K, device=device) * 0.2
    w_sq, U = norm_pieces_triton(q, sw, A, precision=precision, block_n=32, block_k=32, max_block_r=16)
    w_sq_ref, U_ref = kdora.norm_pieces_ref(q, sw, A)
    W64 = q.double() * sw.double()[:, None]
    assert rel_err(U, W64 @ A.double().t()) <= 1e-5            # bf16 hi+lo split: ~2^-17 per product
    assert rel_err(U, U_ref) <= 1e-5
    assert rel_err(w_sq, (W64 ** 2).sum(1)) <= 1e-6 and rel_err(w_sq, w_sq_ref) <= 1e-6
    none, U2 = norm_pieces_triton(q, sw, A, want_w_sq=False, precision=precision, block_n=32, block_k=32,
                                  max_block_r=16)
    assert none is None and torch.equal(U2, U)


def test_row_norm_dispatches_to_triton(device):
    q, sw = fp8.quantize_weight_ref(torch.randn(48, 64, device=device) * 0.1)
    A, B = torch.randn(4, 64, device=device), torch.randn(48, 4, device=device) * 0.1
    dispatch.reset_report()
    with dispatch.use_backend("triton"):
        n = kdora.dora_row_norm(q, sw, A, B, 2.0)
    assert dispatch.report()[kdora.OP_NORM] == {"triton": 1}
    W64 = q.double() * sw.double()[:, None]
    assert rel_err(n, torch.linalg.norm(W64 + 2.0 * B.double() @ A.double(), dim=1)) <= 1e-5


@pytest.mark.parametrize("with_bias", [True, False])
def test_col_dot_vs_reference(with_bias, device):
    T, N = 75, 300
    dy = torch.randn(T, N, dtype=torch.bfloat16, device=device)
    y = torch.randn(T, N, dtype=torch.bfloat16, device=device)
    bias = torch.randn(N, dtype=torch.bfloat16, device=device) if with_bias else None
    got = col_dot_triton(dy, y, bias, block_t=16, block_n=128, chunks=3)
    ref64 = (dy.double() * (y.double() - (0 if bias is None else bias.double()))).sum(0)
    assert rel_err(got, ref64) <= 1e-5
    assert rel_err(got, kdora.col_dot_ref(dy, y, bias)) <= 1e-5


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("r", [8, 384])                     # 384: K1 in rank blocks, K2's epilogue in rank chunks
def test_dora_linear_triton_vs_reference(with_bias, r, device):
    M, K, N, s = 37, 96, 80, 0.5
    x = torch.randn(M, K, dtype=torch.bfloat16, device=device, requires_grad=True)
    q, sw = fp8.quantize_weight_ref(torch.randn(N, K, device=device) * 0.05)
    A = (torch.randn(r, K, device=device) * 0.1).requires_grad_()
    B = (torch.randn(N, r, device=device) * 0.1).requires_grad_()
    bias = torch.randn(N, dtype=torch.bfloat16, device=device) if with_bias else None
    norm = kdora.dora_row_norm(q, sw, A, B, s)
    m = (norm * (torch.rand(N, device=device) + 0.5)).requires_grad_()
    dy = torch.randn(M, N, dtype=torch.bfloat16, device=device)
    outs = []
    for fn in (DoRALinearTriton, kdora.DoRALinearRef):
        with dispatch.use_backend("triton" if fn is DoRALinearTriton else "torch"):
            y = fn.apply(x, q, sw, A, B, m, norm, s, bias)
            y.backward(dy)
        outs.append([y.detach(), x.grad, A.grad, B.grad, m.grad])
        x.grad = A.grad = B.grad = m.grad = None
    for name, got, ref in zip(("y", "dx", "dA", "dB", "dm"), *outs):
        assert rel_err(got, ref) <= 1e-2, name                 # bf16 operands (DESIGN tolerances)
