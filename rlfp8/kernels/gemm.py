"""K2, the FP8 base GEMM with every adapter's up-projection, DoRA scale and bias in its epilogue: the op's
public entry. `dispatch` picks the Triton kernel (lora_gemm_triton, imported only then) or the torch
reference (lora_gemm_ref) per call and records which ran."""
from __future__ import annotations

import torch

from . import dispatch
from .gemm_ref import lora_gemm_ref

OP = "lora_gemm"
_TRITON_ONLY = ("out", "config", "gather", "lora_precision", "use_pdl", "x_from_primary", "shrink")


def lora_gemm(x, q, w_scale, **kw) -> torch.Tensor:
    """K2 (see rlfp8/kernels/gemm_triton.py). Dispatches Triton (CUDA / interpreter) or the reference."""
    if dispatch.choose(OP, x, q) == "triton":
        from .gemm_triton import lora_gemm_triton
        return lora_gemm_triton(x, q, w_scale, **kw)
    for k in _TRITON_ONLY:
        kw.pop(k, None)
    return lora_gemm_ref(x, q, w_scale, **kw)
