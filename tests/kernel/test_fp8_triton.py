"""Triton FP8 quantizers vs the references: bit-exact codes and scales (the DESIGN contract)."""
import pytest
import torch

from rlfp8.kernels import dispatch, fp8
from rlfp8.kernels.fp8_triton import quantize_activation_triton, quantize_weight_triton


def _hard_rows(M, K, dtype, device):
    x = torch.randn(M, K, device=device) * torch.logspace(-4, 3, M, device=device)[:, None]
    x[0] = 0.0                                   # all-zero row: smallest scale, zero codes
    x[1, 3] = 3e4                                # outlier: everything else rounds small or to zero
    x[2] = torch.linspace(-1, 1, K, device=device) * 448 * 1.00049   # values at the saturation edge
    if M > 3:
        x[3] = 1e-30                             # tiny row: clamped scale, zero-ish codes
    return x.to(dtype)


def _same_codes(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("M,K", [(7, 37), (5, 5000), (33, 256)])   # one-pass, two-pass (K > 4096), many rows
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("rounding", ["div", "recip"])
def test_activation_quant_bit_exact(M, K, dtype, rounding, device):
    x = _hard_rows(M, K, dtype, device)
    q, s = quantize_activation_triton(x, rounding)
    qr, sr = fp8.quantize_activation_ref(x, rounding)
    assert q.shape == (M, K) and s.shape == (M, 1) and q.dtype == fp8.FP8_DTYPE
    assert torch.equal(s, sr)
    assert _same_codes(q, qr)


@pytest.mark.parametrize("N,K", [(40, 96), (3, 4500)])
def test_weight_quant_bit_exact(N, K, device):
    w = _hard_rows(N, K, torch.bfloat16, device)
    q, s = quantize_weight_triton(w)
    qr, sr = fp8.quantize_weight_ref(w)
    assert s.shape == (N,) and torch.equal(s, sr) and _same_codes(q, qr)


def test_strided_rows(device):
    big = torch.randn(20, 130, dtype=torch.bfloat16, device=device)
    x = big[::2, 1:129]                                   # row stride 260, not contiguous
    q, s = quantize_activation_triton(x)
    qr, sr = fp8.quantize_activation_ref(x.contiguous())
    assert torch.equal(s, sr) and _same_codes(q, qr)


def test_dispatch_records_triton_path(device):
    dispatch.reset_report()
    x = torch.randn(4, 64, device=device)
    with dispatch.use_backend("triton"):
        q, s = fp8.quantize_activation(x, "recip")
        fp8.quantize_weight(x)
    assert dispatch.report() == {"quantize_activation": {"triton": 1}, "quantize_weight": {"triton": 1}}
    qr, sr = fp8.quantize_activation_ref(x, "recip")
    assert _same_codes(q, qr) and torch.equal(s, sr)


def test_forced_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with dispatch.use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        fp8.quantize_activation(torch.randn(2, 16))


def test_bad_inputs_name_the_tensor(device):
    with pytest.raises(ValueError, match=r"x must be 2-D.*\(2, 3, 4\)"):
        quantize_activation_triton(torch.randn(2, 3, 4, device=device))
    with pytest.raises(TypeError, match="x must have dtype"):
        quantize_activation_triton(torch.ones(2, 4, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="allowed values"):
        quantize_activation_triton(torch.randn(2, 4, device=device), "nearest")
