"""rlfp8.kernels: FP8 formats, the K1/K2 LoRA kernels shared by engine and trainer, the training linear.

Every op has a Triton kernel and a plain-torch reference; `dispatch` picks one per call and records it
(`dispatch.report()`), Triton on CUDA tensors and the reference on the CPU by default, never silently.
One op = `<concept>.py` (the public entry: dispatch) + `<concept>_triton.py` (kernel + launcher) +
`<concept>_ref.py` (reference + argument checks), concept = fp8 | shrink (K1) | gemm (K2) | linear
(docs/ARCHITECTURE.md, "Kernels"). No module is named like a public function, so `rlfp8.kernels.<name>`
is always the function.

  quantize_weight / quantize_activation    FP8 e4m3 per output channel / per token (fp8, fp8_triton, fp8_ref)
  build_lora_meta, LoRAMeta                vLLM-layout adapter-sorted segments (metadata)
  lora_shrink      (K1)                    h = x·Aᵀ fp32 over stacked slots, + fused W8A8 quantization (shrink*)
  lora_gemm        (K2)                    FP8 GEMM (W8A8 or W8A16) + h·B_slotᵀ, DoRA g, bias epilogue (gemm*)
                                           (configs: gemm_configs; PTX widenings: widen; Gluon: gemm_rs)
  fp8_lora_linear                          one engine projection: K1 then K2 (projection)
  lora_linear, LoRALinearRef               the training linear (Triton autograd Function on CUDA)
  dora_row_norm, dora_column_scale         DoRA's factored row norm on the FP8 codes and g = m / n (dora.py)
  dora_linear, DoRALinearRef               the DoRA training linear (g in K2's epilogue; dora_triton.py on CUDA)
  knobs                                    the kernel knobs (config `kernels.*`, RLFP8_* overrides)
Import cost: Triton is imported only by the kernel modules (*_triton, gemm_rs, widen); `rlfp8.kernels`
imports them lazily so CPU-only users never need Triton.
"""
from __future__ import annotations

from . import dispatch, knobs
from .fp8 import (FP8_DTYPE, FP8_MAX, MIN_SCALE, dequantize_weight, quantize_activation, quantize_activation_ref,
                  quantize_weight, quantize_weight_ref)
from .dora import (DoRALinearRef, dense_dora_linear, dora_column_scale, dora_linear, dora_row_norm,
                   weight_sq_norm)
from .gemm import lora_gemm
from .gemm_ref import lora_gemm_ref
from .linear import dense_lora_linear, lora_linear
from .linear_ref import LoRALinearRef, lora_linear_forward_ref
from .metadata import LoRAMeta, build_lora_meta
from .projection import fp8_lora_linear
from .shrink import lora_shrink
from .shrink_ref import ShrinkOut, lora_shrink_ref

_LAZY = {
    "lora_shrink_triton": "shrink_triton", "ShrinkConfig": "shrink_triton", "shrink_config": "shrink_triton",
    "lora_gemm_triton": "gemm_triton", "LORA_PRECISIONS": "gemm_triton",
    "GemmConfig": "gemm_configs", "gemm_config": "gemm_configs",
    "lora_linear_triton": "linear_triton", "LoRALinearTriton": "linear_triton",
    "DoRALinearTriton": "dora_triton", "norm_pieces_triton": "dora_triton", "col_dot_triton": "dora_triton",
    "quantize_weight_triton": "fp8_triton", "quantize_activation_triton": "fp8_triton",
}

__all__ = ["dispatch", "knobs", "FP8_DTYPE", "FP8_MAX", "MIN_SCALE", "dequantize_weight", "quantize_activation",
           "quantize_activation_ref", "quantize_weight", "quantize_weight_ref", "LoRALinearRef",
           "dense_lora_linear", "lora_linear", "lora_linear_forward_ref", "LoRAMeta", "build_lora_meta",
           "DoRALinearRef", "dense_dora_linear", "dora_column_scale", "dora_linear", "dora_row_norm", "weight_sq_norm",
           "lora_gemm", "lora_gemm_ref", "fp8_lora_linear", "lora_shrink", "ShrinkOut", "lora_shrink_ref", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'rlfp8.kernels' has no attribute {name!r}")
