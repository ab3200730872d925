"""DoRA on the FP8 base: the factored row norm, the column scale g, and the training linear.

DoRA (PEFT's exact math, docs/dora.md): W' = m ⊙ (W + s·B·A) / n with n = ‖W + s·B·A‖_row detached, so
    y = g ⊙ (x·Wᵀ + s·(x·Aᵀ)·Bᵀ) + bias,   g = m / n   (one fp32 value per output column; bias not scaled).

Factored norm, W = diag(s_w)·Q never dequantized densely (no [N, K] temporary anywhere):
    n² = ‖W‖²_row + 2s·rowsum(B ⊙ U) + s²·rowsum((B·G) ⊙ B),   U = W·Aᵀ = diag(s_w)·(Q·Aᵀ) [N, r],  G = A·Aᵀ [r, r]
  - ‖W‖²_row = s_w²·Σ_k Q² is computed once from the codes (W is frozen) and cached by the caller;
  - U streams Q once per (A version): `norm_pieces` (Triton on CUDA: the e4m3 tile widened exactly to bf16,
    A split into bf16 hi + lo, two tensor-core dots with fp32 accumulation; torch reference in row chunks);
  - n² is clamped at 0 before the sqrt; where n = 0 (a zero row of W + sBA, PEFT gives NaN there) g = 0,
    which outputs the base value 0 of that column.

Training linear (autograd over x, A, B, m; n is a detached input, computed once per optimizer step):
  forward: the LoRA linear with g in K2's epilogue (one fused compose, one rounding of y);
  backward with gy = dy ⊙ g (a column scale), i.e. the LoRA backward with w_scale·g and g·B_c:
    dx = (dy ⊙ g ⊙ s_w)·q + (dy·(g·B_c))·A_c,   dA = (dy·(g·B_c))ᵀ·x,   dB = g ⊙ (s·dyᵀ·h),
    dm = colsum(dy ⊙ (y − bias)) / m   (= colsum(dy ⊙ z)/n with z the pre-scale output; 0 where m = 0:
         y − bias vanishes there, a measure-zero case documented rather than recomputed).
  The column dot for dm is `col_dot` (Triton on CUDA: one pass over dy and y, no [T, N] fp32 temporary).
"""
from __future__ import annotations

import torch

from . import dispatch
from .dora_ref import (CHUNK_ELEMS, NORM_PRECISIONS, OP_COLDOT, OP_NORM, _check_base,  # noqa: F401
                       column_scale_from_norm, dm_from_col_dot)
from .linear_ref import _flat, lora_backward_ref, lora_linear_fp32_ref

def norm_pieces_ref(q: torch.Tensor, scale: torch.Tensor, A: torch.Tensor, want_w_sq: bool = True):
    """(‖W‖²_row [N] fp32 or None, U = W·Aᵀ [N, r] fp32) from the codes, in row chunks of <= CHUNK_ELEMS codes."""
    _check_base(q, scale, A)
    N, K = q.shape
    A32 = A.detach().float()
    U = torch.empty((N, A.shape[0]), dtype=torch.float32, device=q.device)
    w_sq = torch.empty(N, dtype=torch.float32, device=q.device) if want_w_sq else None
    rows = max(1, CHUNK_ELEMS // max(K, 1))
    for r0 in range(0, N, rows):
        qc = q[r0:r0 + rows].float()                                         # [rows, K] exact codes
        U[r0:r0 + rows] = (qc @ A32.t()) * scale[r0:r0 + rows, None]
        if want_w_sq:
            w_sq[r0:r0 + rows] = (qc * qc).sum(1) * scale[r0:r0 + rows] ** 2
    return w_sq, U


def norm_pieces(q, scale, A, want_w_sq: bool = True, precision: str = "bf16x2"):
    """Dispatching `norm_pieces_ref` / its Triton kernel (dora_triton.norm_pieces_triton)."""
    if dispatch.choose(OP_NORM, q, A) == "triton":
        from .dora_triton import norm_pieces_triton
        return norm_pieces_triton(q, scale, A, want_w_sq, precision)
    return norm_pieces_ref(q, scale, A, want_w_sq)


def weight_sq_norm(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """‖W‖²_row = s_w²·Σ_k Q² [N] fp32 from the codes (frozen base: compute once and cache)."""
    _check_base(q, scale)
    N, K = q.shape
    out = torch.empty(N, dtype=torch.float32, device=q.device)
    rows = max(1, CHUNK_ELEMS // max(K, 1))
    for r0 in range(0, N, rows):
        qc = q[r0:r0 + rows].float()
        out[r0:r0 + rows] = (qc * qc).sum(1) * scale[r0:r0 + rows] ** 2
    return out


@torch.no_grad()
def dora_row_norm(q, scale, A, B, lora_scale: float, w_sq: torch.Tensor | None = None,
                  precision: str = "bf16x2") -> torch.Tensor:
    """n = ‖diag(s_w)·Q + s·B·A‖_row [N] fp32, detached, factored (module docstring). w_sq: the cached
    ‖W‖²_row (computed here when None). A [r, K], B [N, r] (any float dtype; used in fp32)."""
    _check_base(q, scale, A)
    if B.shape != (q.shape[0], A.shape[0]):
        raise ValueError(f"rlfp8.kernels.dora: B must be [N={q.shape[0]}, r={A.shape[0]}], got {tuple(B.shape)}")
    A32, B32 = A.detach().float(), B.detach().float()
    w_sq_new, U = norm_pieces(q, scale, A32, want_w_sq=w_sq is None, precision=precision)
    w_sq = w_sq_new if w_sq is None else w_sq
    if lora_scale == 0:
        return w_sq.clamp_min(0).sqrt()
    G = A32 @ A32.t()                                                          # [r, r]
    n2 = w_sq + (2.0 * lora_scale) * (B32 * U).sum(1) + (lora_scale * lora_scale) * ((B32 @ G) * B32).sum(1)
    return n2.clamp_min(0).sqrt()


def dora_column_scale(m, q, scale, A, B, lora_scale: float, w_sq: torch.Tensor | None = None,
                      precision: str = "bf16x2") -> torch.Tensor:
    """g = m / ‖W + s·B·A‖_row [N] fp32 with PEFT's detached norm: what K2's `g` epilogue applies (the engine
    stacks it [S, N]). m [N] (the lora_magnitude_vector); the rest as dora_row_norm."""
    if m.shape != (q.shape[0],):
        raise ValueError(f"rlfp8.kernels.dora: m must be [N={q.shape[0]}], got {tuple(m.shape)}")
    return column_scale_from_norm(m, dora_row_norm(q, scale, A, B, lora_scale, w_sq, precision))


def col_dot_ref(dy: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """colsum(dy ⊙ (y − bias)) [N] fp32 in row chunks (no [T, N] fp32 temporary). dy, y [T, N]."""
    if dy.shape != y.shape or dy.dim() != 2:
        raise ValueError(f"rlfp8.kernels.dora: col_dot needs dy and y [T, N], got {tuple(dy.shape)}, {tuple(y.shape)}")
    T, N = dy.shape
    out = torch.zeros(N, dtype=torch.float32, device=dy.device)
    rows = max(1, CHUNK_ELEMS // max(N, 1))
    for t0 in range(0, T, rows):
        z = y[t0:t0 + rows].float()
        if bias is not None:
            z = z - bias.float()
        out += (dy[t0:t0 + rows].float() * z).sum(0)
    return out


def col_dot(dy, y, bias=None):
    if dispatch.choose(OP_COLDOT, dy, y) == "triton":
        from .dora_triton import col_dot_triton
        return col_dot_triton(dy, y, bias)
    return col_dot_ref(dy, y, bias)


def _dm(dy2, y2, bias, m, g):
    return dm_from_col_dot(col_dot(dy2, y2, bias), m)


class DoRALinearRef(torch.autograd.Function):
    """Autograd over (x, A, B, m) on the FP8 base (torch reference); n is the detached row norm [N]."""

    @staticmethod
    def forward(ctx, x, q, scale, A, B, m, norm, lora_scale, bias):
        g = column_scale_from_norm(m, norm)                                    # [N] fp32
        z, h = lora_linear_fp32_ref(x, q, scale, A, B, lora_scale)            # [M, N] fp32 pre-scale output
        y = z * g[None, :]
        if bias is not None:
            y = y + bias.to(torch.float32)
        y = y.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])                  # one rounding, as K2
        A_c = A.to(x.dtype).to(torch.float32)
        B_c = (B * lora_scale).to(x.dtype).to(torch.float32)
        ctx.save_for_backward(x, q, scale, A_c, B_c, h, m, g, y, bias)
        ctx.lora_scale = lora_scale
        return y

    @staticmethod
    def backward(ctx, dy):
        x, q, scale, A_c, B_c, h, m, g, y, bias = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dx, dA, dB = lora_backward_ref(dy, x, q, scale * g, A_c, g[:, None] * B_c, h, ctx.lora_scale,
                                       needs[0], needs[3], needs[4])
        if dB is not None:
            dB = g[:, None] * dB
        dm = _dm(_flat(dy), _flat(y), bias, m, g) if needs[5] else None
        return dx, None, None, dA, dB, dm, None, None, None


def _check_adapter(x, q, A, B, m, norm):
    N, K = q.shape
    if x.shape[-1] != K:
        raise ValueError(f"rlfp8.kernels.dora_linear: x {tuple(x.shape)} does not match q {tuple(q.shape)} ([N, K])")
    if A is None or A.dim() != 2 or A.shape[1] != K:
        raise ValueError(f"rlfp8.kernels.dora_linear: A must be [r, K={K}], got {None if A is None else tuple(A.shape)}")
    if B is None or B.shape != (N, A.shape[0]):
        raise ValueError(f"rlfp8.kernels.dora_linear: B must be [N={N}, r={A.shape[0]}], got "
                         f"{None if B is None else tuple(B.shape)}")
    for name, t in (("m (lora_magnitude_vector)", m), ("norm", norm)):
        if t.shape != (N,):
            raise ValueError(f"rlfp8.kernels.dora_linear: {name} must be [N={N}], got {tuple(t.shape)}")


def dora_linear(x, q, scale, A, B, m, norm, lora_scale: float, bias=None):
    """The DoRA training linear on the FP8 base: y = g ⊙ (s_w ⊙ x·qᵀ + s·(x·Aᵀ)·Bᵀ) + bias, g = m / norm.
    x [..., K]; q [N, K] e4m3, scale [N] fp32; A [r, K], B [N, r], m [N] trainable; norm [N] fp32 detached
    (dora_row_norm, once per optimizer step). Triton on CUDA (dora_triton.DoRALinearTriton), else DoRALinearRef."""
    _check_base(q, scale, A)
    _check_adapter(x, q, A, B, m, norm)
    if dispatch.choose("dora_linear", x, q) == "triton":
        from .dora_triton import DoRALinearTriton
        if x.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"rlfp8.kernels.dora_linear: the Triton path takes bf16/fp16 x, got {x.dtype} "
                            f"{tuple(x.shape)}; use backend 'torch' for other dtypes")
        return DoRALinearTriton.apply(x, q, scale, A, B, m, norm.detach(), lora_scale, bias)
    return DoRALinearRef.apply(x, q, scale, A, B, m, norm.detach(), lora_scale, bias)


def dense_dora_linear(x, weight, A, B, m, lora_scale: float, bias=None):
    """The 16-bit-base arm (trainer.weights=bf16): PEFT's DoRA in plain torch (dora.py:132-166 of peft 0.21):
    the dense detached norm ‖W + s·B·A‖_row in the adapters' dtype (fp32), the LoRA branch on x cast to it,
    and result + ((g − 1)·(result − bias) + g·s·lora) cast back to x.dtype, in PEFT's order."""
    dispatch.record("dense_dora_linear", "torch")
    F = torch.nn.functional
    result = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))   # base layer, x.dtype
    base = result - bias.to(x.dtype) if bias is not None else result
    xa = x.to(A.dtype)
    with torch.no_grad():                  # B·A, not PEFT's B(A(eye(K)))ᵀ: same product, no [K, K] identity
        n = torch.linalg.norm(weight.to(A.dtype) + lora_scale * (B @ A), dim=1)
    g = (m / n).view(1, -1)
    lora = F.linear(F.linear(xa, A), B)
    return (result + ((g - 1) * base + g * lora * lora_scale)).to(x.dtype)
