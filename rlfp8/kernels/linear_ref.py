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
    x2 = _flat(x).to(torch.float32)                                   # [M, K]
    acc = x2 @ q.to(torch.float32).t()                                # [M, N] fp32, transient fp32 weight
    y = acc * scale.to(torch.float32) if scale is not None else acc
    h = None
    if A is not None:
        A_c = A.to(x.dtype).to(torch.float32)                         # [r, K]
        B_c = (B * lora_scale).to(x.dtype).to(torch.float32)          # [N, r]
        h = x2 @ A_c.t()                                              # [M, r] fp32
        y = y + h @ B_c.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], q.shape[0]), h


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
        s = ctx.lora_scale
        dy2 = _flat(dy).to(torch.float32)                             # [M, N]
        x2 = _flat(x).to(torch.float32)                               # [M, K]
        dx = dA = dB = None
        gy = dy2 * scale.to(torch.float32) if scale is not None else dy2
        if A is not None:
            A_c = A.to(x.dtype).to(torch.float32)
            B_c = (B * s).to(x.dtype).to(torch.float32)
            dh = dy2 @ B_c                                            # [M, r]
        if ctx.needs_input_grad[0]:
            dx = gy @ q.to(torch.float32)                             # [M, K]
            if A is not None:
                dx = dx + dh @ A_c
            dx = dx.to(x.dtype).reshape(x.shape)
        if A is not None and ctx.needs_input_grad[3]:
            dA = (dh.t() @ x2).to(A.dtype)                            # [r, K]
        if B is not None and ctx.needs_input_grad[4]:
            dB = (s * (dy2.t() @ h)).to(B.dtype)                      # [N, r]
        return dx, None, None, dA, dB, None, None
