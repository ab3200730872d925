"""rlfp8.kernels: FP8 formats, the K1/K2 LoRA kernels shared by engine and trainer, the training linear.

Every op has a Triton kernel and a plain-torch reference; `dispatch` picks one per call and records it
(`dispatch.report()`), Triton on CUDA tensors and the reference on the CPU by default, never silently.

  quantize_weight / quantize_activation    FP8 e4m3 per output channel / per token (fp8.py, fp8_triton.py)
  build_lora_meta, LoRAMeta                vLLM-layout adapter-sorted segments (metadata.py)
  lora_shrink      (K1)                    h = x·Aᵀ fp32 over stacked slots, + fused W8A8 quantization
  lora_gemm        (K2)                    FP8 GEMM (W8A8 or W8A16) + h·B_slotᵀ, DoRA g, bias epilogue
  fp8_lora_linear                          one engine projection: K1 then K2
  lora_linear, LoRALinearRef               the training linear (Triton autograd Function on CUDA)
  dora_row_norm, dora_column_scale         DoRA's factored row norm on the FP8 codes and g = m / n (dora.py)
  dora_linear, DoRALinearRef               the DoRA training linear (g in K2's epilogue; dora_triton.py on CUDA)
Import cost: Triton is imported only by the kernel modules (lora_shrink, lora_gemm, fp8_triton,
linear_triton); `rlfp8.kernels` itself imports them lazily so CPU-only users never need Triton.
"""
from __future__ import annotations

from . import dispatch
from .fp8 import (FP8_DTYPE, FP8_MAX, MIN_SCALE, dequantize_weight, quantize_activation, quantize_activation_ref,
                  quantize_weight, quantize_weight_ref)
from .linear import LoRALinearRef, dense_lora_linear, lora_linear, lora_linear_forward_ref
from .dora import (DoRALinearRef, dense_dora_linear, dora_column_scale, dora_linear, dora_row_norm,
                   weight_sq_norm)
from .metadata import LoRAMeta, build_lora_meta

_LAZY = {
    "lora_shrink": "lora_shrink", "lora_shrink_ref": "lora_shrink", "lora_shrink_triton": "lora_shrink",
    "ShrinkOut": "lora_shrink", "ShrinkConfig": "lora_shrink", "shrink_config": "lora_shrink",
    "lora_gemm": "lora_gemm", "lora_gemm_ref": "lora_gemm", "lora_gemm_triton": "lora_gemm",
    "fp8_lora_linear": "lora_gemm", "GemmConfig": "lora_gemm", "gemm_config": "lora_gemm",
    "LORA_PRECISIONS": "lora_gemm",
    "lora_linear_triton": "linear_triton", "LoRALinearTriton": "linear_triton",
    "DoRALinearTriton": "dora_triton", "norm_pieces_triton": "dora_triton", "col_dot_triton": "dora_triton",
    "quantize_weight_triton": "fp8_triton", "quantize_activation_triton": "fp8_triton",
}

__all__ = ["dispatch", "FP8_DTYPE", "FP8_MAX", "MIN_SCALE", "dequantize_weight", "quantize_activation",
           "quantize_activation_ref", "quantize_weight", "quantize_weight_ref", "LoRALinearRef",
           "dense_lora_linear", "lora_linear", "lora_linear_forward_ref", "LoRAMeta", "build_lora_meta",
           "DoRALinearRef", "dense_dora_linear", "dora_column_scale", "dora_linear", "dora_row_norm", "weight_sq_norm",
           *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'rlfp8.kernels' has no attribute {name!r}")
