"""K2's plain-torch reference and the argument checks both K2 paths share (no Triton).

    y = g[slot] ⊙ (scale ⊙ (x·qᵀ) + h·B_slotᵀ per slice) + bias, in fp32, one cast at the end
(the contract and shapes are in rlfp8/kernels/gemm_triton.py's docstring).
"""
from __future__ import annotations

import torch

from ._triton_utils import check_tensor, stacked_view
from .fp8_ref import ACT_ROUNDING, FP8_DTYPE, quantize_activation_ref
from .metadata import LoRAMeta

OP = "lora_gemm"


def b_slices(B) -> list[torch.Tensor]:
    return list(B) if isinstance(B, (list, tuple)) else [B]



def gemm_mode(x: torch.Tensor) -> str:
    return "w8a8" if x.dtype == FP8_DTYPE else "w8a16"


def check_lora_gemm_args(x, q, w_scale, x_scale, h, B, meta, g, bias, out_dtype, quantize_x=None):
    """(mode, B slices): "w8a8" for e4m3 x, or 16-bit x with quantize_x (K2 quantizes x per token itself with
    that rounding), else "w8a16"; a ValueError naming the argument and its shape for anything else."""
    M, K = x.shape if x.dim() == 2 else (None, None)
    check_tensor(OP, "x", x, ndim=2, dtypes=(torch.bfloat16, torch.float16, torch.float32, FP8_DTYPE))
    if quantize_x is not None:
        if quantize_x not in ACT_ROUNDING:
            raise ValueError(f"rlfp8.kernels.{OP}: quantize_x {quantize_x!r}: allowed {ACT_ROUNDING} or None")
        if x.dtype == FP8_DTYPE or x_scale is not None:
            raise ValueError(f"rlfp8.kernels.{OP}: quantize_x takes 16-bit x without x_scale (K2 quantizes it), "
                             f"got {x.dtype} x {tuple(x.shape)}, x_scale {'given' if x_scale is not None else None}")
    check_tensor(OP, "q", q, ndim=2, dtypes=(FP8_DTYPE,), device=x.device)
    N = q.shape[0]
    if q.shape[1] != K:
        raise ValueError(f"rlfp8.kernels.{OP}: q {tuple(q.shape)} must be [N, K] with K = x.shape[1] = {K}")
    if w_scale is not None:
        check_tensor(OP, "w_scale", w_scale, shape=(N,), dtypes=(torch.float32,), device=x.device)
    mode = "w8a8" if quantize_x is not None else gemm_mode(x)
    if mode == "w8a8" and quantize_x is None:
        if x_scale is None:
            raise ValueError(f"rlfp8.kernels.{OP}: FP8 x {tuple(x.shape)} (W8A8) needs x_scale [{M}, 1]")
        if x_scale.numel() != M or x_scale.dtype != torch.float32:
            raise ValueError(f"rlfp8.kernels.{OP}: x_scale must be fp32 [{M}, 1], got {x_scale.dtype} "
                             f"{tuple(x_scale.shape)}")
    elif x_scale is not None:
        raise ValueError(f"rlfp8.kernels.{OP}: x_scale is only for FP8 x (W8A8); x is {x.dtype}")
    slices = None
    if h is not None or B is not None:
        if h is None or B is None:
            raise ValueError(f"rlfp8.kernels.{OP}: the LoRA epilogue needs both h and B")
        slices = [stacked_view(OP, f"B[{i}]", b, None) for i, b in enumerate(b_slices(B))]
        if not 1 <= len(slices) <= 3:
            raise ValueError(f"rlfp8.kernels.{OP}: 1 to 3 B slices are supported, got {len(slices)}")
        r = slices[0].shape[2]
        check_tensor(OP, "h", h, shape=(len(slices), M, r), dtypes=(torch.float32,), device=x.device)
        for i, b in enumerate(slices):
            check_tensor(OP, f"B[{i}]", b, dtypes=(torch.bfloat16, torch.float16, torch.float32), device=x.device)
            if b.shape[0] != slices[0].shape[0] or b.shape[2] != r:
                raise ValueError(f"rlfp8.kernels.{OP}: B slices must share slots and rank: B[0] "
                                 f"{tuple(slices[0].shape)}, B[{i}] {tuple(b.shape)}")
        if sum(b.shape[1] for b in slices) != N:
            raise ValueError(f"rlfp8.kernels.{OP}: B slice widths {[b.shape[1] for b in slices]} must sum to "
                             f"N = q.shape[0] = {N}")
        if meta is not None:
            meta.validate(OP, M)
            if meta.max_loras > slices[0].shape[0]:
                raise ValueError(f"rlfp8.kernels.{OP}: metadata has {meta.max_loras} slots but B has "
                                 f"{slices[0].shape[0]} (shape {tuple(slices[0].shape)})")
    if g is not None:
        S = slices[0].shape[0] if slices else None
        check_tensor(OP, "g", g, shape=(S, N), dtypes=(torch.float32,), device=x.device)
        if slices is None:
            raise ValueError(f"rlfp8.kernels.{OP}: DoRA g needs the LoRA epilogue (h, B)")
    if bias is not None:
        check_tensor(OP, "bias", bias, shape=(N,), dtypes=(torch.bfloat16, torch.float16, torch.float32),
                     device=x.device)
    if out_dtype not in (None, torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"rlfp8.kernels.{OP}: out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    return mode, slices


def lora_gemm_ref(x, q, w_scale, *, x_scale=None, h=None, B=None, meta: LoRAMeta | None = None, g=None,
                  bias=None, out_dtype=None, quantize_x=None, **_ignored) -> torch.Tensor:
    """Plain torch, fp32: acc = x·qᵀ; scale; + h·B_slotᵀ per slice and slot; · g; + bias; one cast.
    quantize_x: x (16-bit) is first quantized per token as fp8.quantize_activation does (W8A8)."""
    mode, slices = check_lora_gemm_args(x, q, w_scale, x_scale, h, B, meta, g, bias, out_dtype, quantize_x)
    if quantize_x is not None:
        x, x_scale = quantize_activation_ref(x, quantize_x)
    M, K = x.shape
    out_dtype = out_dtype or (torch.bfloat16 if mode == "w8a8" else x.dtype)
    acc = x.float() @ q.float().t()                                                # [M, N]
    if w_scale is not None:
        acc = acc * (w_scale[None, :] * x_scale.reshape(M, 1)) if mode == "w8a8" else acc * w_scale[None, :]
    elif mode == "w8a8":
        acc = acc * x_scale.reshape(M, 1)
    if slices is not None:
        slots = (torch.zeros(M, dtype=torch.long, device=x.device) if meta is None
                 else meta.token_lora_mapping.long())
        offs = [0]
        for b in slices:
            offs.append(offs[-1] + b.shape[1])
        for s in torch.unique(slots).tolist():
            if s < 0:
                continue
            rows = (slots == s).nonzero().squeeze(1)
            for i, b in enumerate(slices):
                acc[rows, offs[i]:offs[i + 1]] += h[i, rows] @ b[s].float().t()
            if g is not None:
                acc[rows] *= g[s][None, :]
    if bias is not None:
        acc = acc + bias.float()[None, :]
    return acc.to(out_dtype)
