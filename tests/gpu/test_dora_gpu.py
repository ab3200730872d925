"""GPU tier for DoRA (issue 16; marked gpu, skipped without CUDA): the Triton norm pieces and column dot vs
their torch references and fp64 on real shapes, the DoRA training linear vs DoRALinearRef, and the matched
property with the engine's DoRA projection (fp8_lora_linear with g = dora_column_scale): same bits."""
from __future__ import annotations

import math

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


NORM_BLOCK_K = 64                    # norm_pieces_triton's K tile (passed explicitly: the order model below uses it)


def _w_sq_fp64(q, sw, rows=1024):
    out = torch.empty(q.shape[0], dtype=torch.float64, device=q.device)
    for r0 in range(0, q.shape[0], rows):
        c = q[r0:r0 + rows].double()
        out[r0:r0 + rows] = (c * c).sum(1) * sw[r0:r0 + rows].double() ** 2
    return out


def _w_sq_kernel_order_fp32(q, sw, block_k):
    """‖W‖²_row in fp32 with the kernel's accumulation order: each BLOCK_K tile summed, the tile sums added one
    after another from zero, then · s_w · s_w. Its error vs fp64 is the error that order has by itself."""
    N, K = q.shape
    tiles = torch.nn.functional.pad(q.float() ** 2, (0, -K % block_k)).view(N, -1, block_k).sum(2)
    acc = torch.zeros(N, dtype=torch.float32, device=q.device)
    for t in range(tiles.shape[1]):
        acc = acc + tiles[:, t]
    return acc * sw * sw


def _u_split_bf16x2(q, sw, A):
    """U with the bf16x2 arithmetic in torch: A = A_hi + A_lo (bf16 each), two bf16 GEMMs with fp32 accumulation
    on the tensor cores (cuBLAS), the codes exact in bf16."""
    a_hi = A.to(torch.bfloat16)
    a_lo = (A - a_hi.float()).to(torch.bfloat16)
    qb = q.to(torch.bfloat16)
    mm = lambda a, b: torch.mm(a, b.t(), out_dtype=torch.float32)          # noqa: E731 (fp32 result, no rounding)
    return (mm(qb, a_hi) + mm(qb, a_lo)) * sw[:, None]


@pytest.mark.parametrize("N,K,r", [(8192, 8192, 384), (8192, 28672, 64), (28672, 8192, 512), (1000, 4100, 7)])
@pytest.mark.parametrize("precision", ["bf16x2", "ieee"])
def test_norm_pieces_vs_reference(N, K, r, precision):
    """Both pieces against fp64, each held to the error its arithmetic has by itself, computed in torch with the
    same arithmetic (the yardstick), within 2x:
      ‖W‖²: Q² is exact in fp32 (4-bit significands); what rounds is the sum over K in the kernel's order, one
            fp32 tile sum per BLOCK_K and ceil(K / BLOCK_K) sequential adds (error ~ sqrt(K / BLOCK_K)·2^-24,
            1.1-1.2e-6 at K = 28672 on the H200), so the yardstick sums in that order (_w_sq_kernel_order_fp32);
      U:    ieee = fp32 FMA products and sums: the yardstick is the torch fp32 reference (TF32 off);
            bf16x2 = the split A_hi + A_lo leaves up to 2^-16 relative per product (random in sign) plus the
            tensor cores' fp32 accumulation (1.6-1.7e-5 vs the fp32 reference at K = 8192 on the H200): the
            yardstick is the same split as two cuBLAS bf16 GEMMs with fp32 output (_u_split_bf16x2).
    U against fp64 on 256 random rows (the fp64 product of all rows would be N·K·8 bytes)."""
    q, sw = _base(N, K)
    A = torch.randn(r, K, device=DEV) * 0.01
    w_sq, U = norm_pieces_triton(q, sw, A, precision=precision, block_k=NORM_BLOCK_K)
    w_sq_ref, U_ref = kdora.norm_pieces_ref(q, sw, A)
    w_sq64 = _w_sq_fp64(q, sw)
    err_wsq, yard_wsq = rel_err(w_sq, w_sq64), rel_err(_w_sq_kernel_order_fp32(q, sw, NORM_BLOCK_K), w_sq64)
    rows = torch.randint(0, N, (256,), device=DEV)
    U64 = (q[rows].double() * sw[rows].double()[:, None]) @ A.double().t()
    if precision == "bf16x2":
        U_yard = _u_split_bf16x2(q[rows], sw[rows], A)
    else:
        assert not torch.backends.cuda.matmul.allow_tf32, "the fp32 yardstick must not run in TF32"
        U_yard = U_ref[rows]
    err_u, yard_u = rel_err(U[rows], U64), rel_err(U_yard, U64)
    print(f"  N={N} K={K} r={r} {precision}: |w_sq| err vs fp64 {err_wsq:.2e} (kernel-order fp32 {yard_wsq:.2e}, "
          f"torch ref {rel_err(w_sq_ref, w_sq64):.2e}); U err vs fp64 {err_u:.2e} (yardstick {yard_u:.2e}, "
          f"fp32 ref {rel_err(U_ref[rows], U64):.2e})")
    assert err_wsq <= 2 * yard_wsq + 2 ** -24, (err_wsq, yard_wsq)
    assert err_u <= 2 * yard_u + 2 ** -24, (err_u, yard_u)
    # and in absolute terms (no lost bits in both): the split's <= 2^-16 per product (x4), fp32 accumulation
    # ~ sqrt(K)·2^-24 (x4)
    assert err_u <= (4 * 2 ** -16 if precision == "bf16x2" else 0) + 4 * math.sqrt(K) * 2 ** -24, err_u


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
