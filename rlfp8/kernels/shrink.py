"""K1, the multi-adapter LoRA down-projection (+ the fused W8A8 quantization): the op's public entry.
`dispatch` picks the Triton kernel (lora_shrink_triton, imported only then) or the torch reference."""
from __future__ import annotations

import torch

from . import dispatch
from .shrink_ref import ShrinkOut, lora_shrink_ref
from .metadata import LoRAMeta

OP = "lora_shrink"


def lora_shrink(x: torch.Tensor, A, meta: LoRAMeta | None = None, quant: str | None = None,
                out: torch.Tensor | None = None, config=None,
                use_pdl: bool = False, mode: str | None = None) -> ShrinkOut:
    """K1 (see rlfp8/kernels/shrink_triton.py). Dispatches Triton (CUDA / interpreter) or the torch reference.
    mode: the projection's ("w8a16" | "w8a8"), which picks K1's schedule (default: "w8a8" when K1 quantizes)."""
    if dispatch.choose(OP, x) == "triton":
        from .shrink_triton import lora_shrink_triton
        return lora_shrink_triton(x, A, meta, quant, out, config, use_pdl, mode)
    return lora_shrink_ref(x, A, meta, quant, out)
