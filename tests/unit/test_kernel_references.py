"""CPU tier 1: the torch references of rlfp8.kernels against fp64 math written out independently."""
import pytest
import torch

from rlfp8.kernels import fp8
from rlfp8.kernels.linear import lora_linear
from rlfp8.kernels.linear_ref import LoRALinearRef
from tests.conftest import rel_err
from tests.oracles import quant_codes_fp64, quant_scale_fp64


def test_weight_quantization_contract():
    w = torch.randn(96, 80) * torch.logspace(-3, 2, 96)[:, None]
    w[3] = 0.0                                                   # all-zero row: smallest scale, zero codes
    w[5, 7] = 1e4                                                # one large outlier
    q, s = fp8.quantize_weight_ref(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and s.dtype == torch.float32 and s.shape == (96,)
    assert torch.equal(s, quant_scale_fp64(w))
    assert s[3].item() == fp8.MIN_SCALE and torch.all(q[3].float() == 0)
    # Codes are the round-to-nearest-even e4m3 values of w / s within +-448 (no NaN, saturated max).
    qf = q.float()
    assert qf.abs().max() <= 448 and torch.isfinite(qf).all()
    assert torch.all(qf.abs().amax(dim=1)[torch.arange(96) != 3] == 448)
    # Dequantization error is within half an e4m3 ulp (relative 2^-4) of each element.
    deq = fp8.dequantize_weight(q, s, torch.float64)
    assert torch.all((deq - w.double()).abs() <= (w.double().abs() * 2**-4 + s.double()[:, None] * 2**-9))


def test_activation_quantization_div_vs_recip():
    x = torch.randn(64, 257, dtype=torch.bfloat16) * 3
    qd, sd = fp8.quantize_activation_ref(x, "div")
    qr, sr = fp8.quantize_activation_ref(x, "recip")
    assert torch.equal(sd, sr) and sd.shape == (64, 1)
    assert torch.equal(qd.float(), quant_codes_fp64(x, sd).float())
    # The two roundings agree except on rare ties shifted by the reciprocal's rounding.
    assert (qd.float() != qr.float()).float().mean() < 0.01
    with pytest.raises(ValueError, match="allowed values"):
        fp8.quantize_activation_ref(x, "nearest")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_lora_linear_reference_vs_fp64(dtype, tol):
    M, K, N, r, s = 37, 96, 80, 8, 0.5
    x = torch.randn(2, M, K, dtype=dtype, requires_grad=True)
    q, sw = fp8.quantize_weight_ref(torch.randn(N, K) * 0.05)
    A = (torch.randn(r, K) * 0.1).requires_grad_()
    B = (torch.randn(N, r) * 0.1).requires_grad_()
    bias = torch.randn(N, dtype=dtype)
    y = LoRALinearRef.apply(x, q, sw, A, B, s, bias)
    dy = torch.randn_like(y)
    y.backward(dy)
    # fp64 math on the operands as the contract rounds them (adapters in x.dtype, s folded into B).
    W64 = q.double() * sw.double()[:, None]
    x64 = x.detach().double().requires_grad_()
    A64 = A.detach().double().requires_grad_()
    B64 = B.detach().double().requires_grad_()
    Ac = A64 + (A.detach().to(dtype).double() - A64).detach()        # straight-through rounding
    Bc = s * B64 + ((B.detach() * s).to(dtype).double() - s * B64).detach()
    y64 = x64 @ W64.t() + (x64 @ Ac.t()) @ Bc.t() + bias.double()
    y64.backward(dy.double())
    assert y.dtype == dtype and y.shape == (2, M, N)
    assert rel_err(y, y64) < tol
    assert rel_err(x.grad, x64.grad) < tol
    assert rel_err(A.grad, A64.grad) < tol
    assert rel_err(B.grad, B64.grad) < tol


def test_lora_linear_dispatch_records_path_and_rejects_dense():
    from rlfp8.kernels import dispatch
    dispatch.reset_report()
    q, sw = fp8.quantize_weight_ref(torch.randn(16, 32))
    lora_linear(torch.randn(3, 32), q, sw, None, None, 1.0)
    assert dispatch.report() == {"lora_linear": {"torch": 1}}
    with pytest.raises(TypeError, match="dense_lora_linear"):
        lora_linear(torch.randn(3, 32), torch.randn(16, 32), None, None, None, 1.0)


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_lora_gemm_reference_vs_fp64(mode):
    """K2's torch reference (two output slices, several adapters and tokens without one, DoRA g, bias)
    against the shared fp64 oracle."""
    from rlfp8.kernels.gemm_ref import lora_gemm_ref
    from rlfp8.kernels.metadata import build_lora_meta
    from tests.oracles import gemm_fp64, shrink_fp64
    M, K, widths, S, r = 29, 64, [48, 16], 3, 8
    x = torch.randn(M, K, dtype=torch.bfloat16)
    q, sw = fp8.quantize_weight_ref(torch.randn(sum(widths), K) * 0.05)
    A = [torch.randn(S, r, K, dtype=torch.bfloat16) * 0.1 for _ in widths]
    B = [torch.randn(S, n, r, dtype=torch.bfloat16) * 0.1 for n in widths]
    slots = torch.randint(-1, S, (M,))
    slots[0] = -1
    g, bias = torch.rand(S, sum(widths)) + 0.5, torch.randn(sum(widths), dtype=torch.bfloat16)
    h = shrink_fp64(x, A, slots).float()
    xs = None
    if mode == "w8a8":
        x, xs = fp8.quantize_activation_ref(x)
    y = lora_gemm_ref(x, q, sw, x_scale=xs, h=h, B=B, meta=build_lora_meta(slots, S), g=g, bias=bias,
                      out_dtype=torch.float32)
    assert rel_err(y, gemm_fp64(x, q, sw, x_scale=xs, h=h, B=B, slots=slots, g=g, bias=bias)) < 1e-5
