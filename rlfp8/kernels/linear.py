"""The training linear's public entries: `lora_linear` (FP8 base + LoRA; `dispatch` picks the Triton autograd
Function of linear_triton, imported only then, or the torch reference LoRALinearRef of linear_ref) and
`dense_lora_linear`, the 16-bit-base arm (trainer.weights=bf16), plain torch like PEFT. The arithmetic is in
linear_ref's docstring."""
from __future__ import annotations

import torch

from . import dispatch
from .linear_ref import LoRALinearRef


def dense_lora_linear(x, weight, A, B, lora_scale: float, bias=None):
    """The 16-bit-base arm (trainer.weights=bf16): plain torch ops in x.dtype, as PEFT runs LoRA."""
    dispatch.record("dense_lora_linear", "torch")
    y = torch.nn.functional.linear(x, weight.to(x.dtype), bias)
    if A is not None:
        y = y + torch.nn.functional.linear(torch.nn.functional.linear(x, A.to(x.dtype)), (B * lora_scale).to(x.dtype))
    return y


def lora_linear(x, q, scale, A, B, lora_scale: float, bias=None, casts=None):
    """FP8 base (q [N, K] float8_e4m3fn, scale [N] fp32) + LoRA (A [r, K], B [N, r]; None = no adapter).
    casts: optional dtype -> (A.to(dtype), (B·s).to(dtype)) cache for the Triton path (the reference casts
    itself: it is the baseline)."""
    if q.dtype != torch.float8_e4m3fn or scale is None:
        raise TypeError(f"lora_linear: q must be float8_e4m3fn with a scale, got q {q.dtype} "
                        f"{tuple(q.shape)}; use dense_lora_linear for a 16-bit base")
    if dispatch.choose("lora_linear", x, q) == "triton":
        from .linear_triton import lora_linear_triton     # added with the Triton kernels
        return lora_linear_triton(x, q, scale, A, B, lora_scale, bias, casts)
    return LoRALinearRef.apply(x, q, scale, A, B, lora_scale, bias)
