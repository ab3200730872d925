"""The training linear: y = s_w * (x @ q^T) + (x @ A^T) @ (s*B)^T + bias, trainable A and B only.

Arithmetic (the engine's W8A16 arithmetic, so that engine and trainer match):
  - the base weight stays FP8 codes q [N, K] + per-row scale [N]; x @ q^T is accumulated in fp32 from
    operands exact in x.dtype (e4m3 codes are exact in bf16), then scaled per output column;
  - the adapters are cast to x.dtype as the engine stores them, with s folded into B as vLLM does:
    A_c = A.to(dtype) [r, K], B_c = (s * B).to(dtype) [N, r];
  - h = x @ A_c^T is accumulated and kept in fp32; h @ B_c^T is added to the fp32 accumulator;
  - y is rounded to x.dtype once.
Backward never holds a persistent 16/32-bit copy of the weight (the reference widens q transiently):
  dx = (dy * s_w) @ q + (dy @ B_c) @ A_c,   dB = s * dy^T @ h,   dA = (dy @ B_c)^T @ x.
  (The Triton backward rounds gy = dy * s_w once to x.dtype, so its dx GEMM is the forward's exact W8A16
  loop on the transposed codes; `dy_prep_ref` is that step's reference.)

This module: the plain-torch reference (no Triton). `lora_linear` (rlfp8.kernels.linear) dispatches to
it or to rlfp8.kernels.linear_triton.
"""
from __future__ import annotations

import torch


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def lora_linear_forward_ref(x, q, scale, A, B, lora_scale: float, bias=None):
    """Reference forward. x [..., K]; q [N, K] fp8 (or a dense [N, K] weight with scale=None);
    A [r, K]; B [N, r]; returns (y [..., N] in x.dtype, h [M, r] fp32)."""
    y, h = lora_linear_fp32_ref(x, q, scale, A, B, lora_scale)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], q.shape[0]), h


def lora_linear_fp32_ref(x, q, scale, A, B, lora_scale: float):
    """The fp32 accumulator before bias and rounding: (s_w ⊙ x·qᵀ + h·B_cᵀ [M, N] fp32, h [M, r] fp32 or None)."""
    x2 = _flat(x).to(torch.float32)                                   # [M, K]
    acc = x2 @ q.to(torch.float32).t()                                # [M, N] fp32, transient fp32 weight
    y = acc * scale.to(torch.float32) if scale is not None else acc
    h = None
    if A is not None:
        A_c = A.to(x.dtype).to(torch.float32)                         # [r, K]
        B_c = (B * lora_scale).to(x.dtype).to(torch.float32)          # [N, r]
        h = x2 @ A_c.t()                                              # [M, r] fp32
        y = y + h @ B_c.t()
    return y, h


def dy_prep_ref(dy: torch.Tensor, w_scale: torch.Tensor, B_c: torch.Tensor | None = None):
    """Reference of the Triton backward's first step: gy = (dy ⊙ w_scale) rounded once to dy.dtype [T, N]
    and dh = dy·B_c in fp32 [T, r] (None without B_c). dy [T, N]; w_scale [N] fp32; B_c [N, r]."""
    gy = (dy.float() * w_scale.float()[None, :]).to(dy.dtype)
    dh = dy.float() @ B_c.float() if B_c is not None else None
    return gy, dh


class LoRALinearRef(torch.autograd.Function):
    """Autograd over (x, A, B); q, scale and bias are frozen buffers (they may be shared memory)."""

    @staticmethod
    def forward(ctx, x, q, scale, A, B, lora_scale, bias):
        y, h = lora_linear_forward_ref(x, q, scale, A, B, lora_scale, bias)
        ctx.save_for_backward(x, q, scale, A, B, h)
        ctx.lora_scale = lora_scale
        return y

    @staticmethod
    def backward(ctx, dy):
        x, q, scale, A, B, h = ctx.saved_tensors
        A_c = B_c = None
        if A is not None:
            A_c = A.to(x.dtype).to(torch.float32)
            B_c = (B * ctx.lora_scale).to(x.dtype).to(torch.float32)
        needs = ctx.needs_input_grad
        dx, dA, dB = lora_backward_ref(dy, x, q, scale, A_c, B_c, h, ctx.lora_scale, needs[0],
                                       A is not None and needs[3], B is not None and needs[4])
        return (dx, None, None, None if dA is None else dA.to(A.dtype), None if dB is None else dB.to(B.dtype),
                None, None)


def lora_backward_ref(dy, x, q, w_scale, A_c, B_c, h, lora_scale: float, need_dx: bool, need_dA: bool,
                      need_dB: bool):
    """The reference backward: dx = (dy ⊙ w_scale)·q + (dy·B_c)·A_c (x.dtype, x's shape), dA = (dy·B_c)ᵀ·x,
    dB = s·dyᵀ·h (fp32; None where not needed). A_c [r, K], B_c [N, r] fp32 as the forward rounded them (None
    = no adapter); w_scale [N] (None for a dense weight). DoRA calls it with w_scale·g and g·B_c."""
    dy2 = _flat(dy).to(torch.float32)                                 # [M, N]
    x2 = _flat(x).to(torch.float32)                                   # [M, K]
    dx = dA = dB = None
    if A_c is not None:
        dh = dy2 @ B_c                                                # [M, r]
    if need_dx:
        gy = dy2 * w_scale.to(torch.float32) if w_scale is not None else dy2
        dx = gy @ q.to(torch.float32)                                 # [M, K]
        if A_c is not None:
            dx = dx + dh @ A_c
        dx = dx.to(x.dtype).reshape(x.shape)
    if A_c is not None and need_dA:
        dA = dh.t() @ x2                                              # [r, K]
    if A_c is not None and need_dB:
        dB = lora_scale * (dy2.t() @ h)                               # [N, r]
    return dx, dA, dB
