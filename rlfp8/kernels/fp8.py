"""FP8 quantization ops, the public entries: `dispatch` picks the Triton kernels (fp8_triton, imported only
then) or the plain-torch references (fp8_ref, which also holds the formats' constants and contract)."""
from __future__ import annotations

import torch

from . import dispatch
from .fp8_ref import (ACT_ROUNDING, FP8_DTYPE, FP8_MAX, MIN_SCALE, dequantize_weight,  # noqa: F401 (the formats)
                      quantize_activation_ref, quantize_weight_ref)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The one weight quantizer both engine and trainer call (dispatches to Triton on CUDA)."""
    if dispatch.choose("quantize_weight", w) == "triton":
        from .fp8_triton import quantize_weight_triton   # added with the Triton kernels
        return quantize_weight_triton(w)
    return quantize_weight_ref(w)


def quantize_activation(x: torch.Tensor, rounding: str = "div", use_pdl: bool = False) -> tuple[torch.Tensor,
                                                                                          torch.Tensor]:
    """Per-token FP8 codes and scales of x (W8A8). use_pdl (Triton): the kernel lets a programmatic dependent
    launch (the caller's K2, which waits for it before reading the codes)."""
    if dispatch.choose("quantize_activation", x) == "triton":
        from .fp8_triton import quantize_activation_triton
        return quantize_activation_triton(x, rounding, use_pdl=use_pdl)
    return quantize_activation_ref(x, rounding)
