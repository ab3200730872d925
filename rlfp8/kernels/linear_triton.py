"""The training linear on CUDA: autograd over (x, A, B) on FP8 codes q [N, K] + per-row scale [N].

Forward = the engine's W8A16 projection with one adapter and no metadata (K1 `lora_shrink` for
h = x·A_cᵀ in fp32, then K2 `lora_gemm` with the adapter's h·B_cᵀ in the epilogue), with the reference's
operand roundings: A_c = A.to(x.dtype), B_c = (B·s).to(x.dtype) (s folded into B as vLLM stores it).
It calls the same kernels with the same configs as `fp8_lora_linear(..., mode="w8a16")`, so for the same
rows (same T, same projection) engine and trainer outputs are bit-identical (the matched property).

Backward (dy [T, N], no bf16 copy of the weight ever exists):
  dh = dy·B_c              [T, r]  fp32 (cuBLAS bf16 MMA, fp32 output)
  dx = dy·(s_w ⊙ q) + dh·A_c  [T, K]: K2 on the transposed FP8 view qᵀ [K, N] (strides (1, K)); the codes
       are widened and scaled per reduction index in registers (s_w·q rounded once to x.dtype: the only
       rounding the fp32 reference does not have, |err| <= 2^-9 relative per weight, a bf16 weight's
       rounding), dh·A_c added in the epilogue (A_cᵀ read as the epilogue's "B", h = dh fp32);
  dA = dhᵀ·x  [r, K],  dB = s·dyᵀ·h  [N, r]: bf16 MMA with fp32 output (dh and h rounded to bf16 as PEFT's
       bf16 LoRA does), cast to the parameters' dtype.
x must be bf16 or fp16 (the kernels' 16-bit MMA); other dtypes raise (use the torch reference).
"""
from __future__ import annotations

import torch

from . import dispatch
from .lora_gemm import lora_gemm_triton
from .lora_shrink import lora_shrink_triton

OP = "lora_linear"


_MM_OUT_DTYPE: dict[tuple, bool] = {}


def _mm_out_dtype_ok(a: torch.Tensor) -> bool:
    """Does torch.mm(16-bit, 16-bit, out_dtype=fp32) exist here (torch >= 2.8 on CUDA)? Probed once per
    (device type, dtype) outside any CUDA graph capture, so no failing call is ever captured."""
    key = (a.device.type, a.dtype)
    if key not in _MM_OUT_DTYPE:
        ok = False
        if a.is_cuda and not torch.cuda.is_current_stream_capturing():
            try:
                t = torch.ones(16, 16, dtype=a.dtype, device=a.device)
                ok = torch.mm(t, t, out_dtype=torch.float32).dtype == torch.float32
            except (TypeError, RuntimeError, NotImplementedError):
                ok = False
        _MM_OUT_DTYPE[key] = ok
    return _MM_OUT_DTYPE[key]


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for 16-bit operands with an fp32 result (fp32 accumulation, no output rounding)."""
    if _mm_out_dtype_ok(a):
        dispatch.record("lora_linear.lora_grads", "mm_out_fp32")
        return torch.mm(a, b, out_dtype=torch.float32)
    # no mm(out_dtype=) on this device/torch: 16-bit result widened (recorded, never silent)
    dispatch.record("lora_linear.lora_grads", "mm_16bit_out")
    return torch.mm(a, b).float()


class LoRALinearTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, q, scale, A, B, lora_scale, bias):
        K = x.shape[-1]
        N = q.shape[0]
        x2 = x.reshape(-1, K)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        h = A_c = B_c = None
        if A is not None:
            A_c = A.to(x.dtype)                                                 # [r, K]
            B_c = (B * lora_scale).to(x.dtype)                                  # [N, r]
            h = lora_shrink_triton(x2, A_c[None], None).h                       # [1, T, r] fp32
            y = lora_gemm_triton(x2, q, scale, h=h, B=B_c[None], bias=bias)
        else:
            y = lora_gemm_triton(x2, q, scale, bias=bias)
        ctx.save_for_backward(x2, q, scale, A, B, A_c, B_c, h)
        ctx.lora_scale = lora_scale
        ctx.x_shape = x.shape
        return y.reshape(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, dy):
        x2, q, scale, A, B, A_c, B_c, h = ctx.saved_tensors
        s = ctx.lora_scale
        N = q.shape[0]
        dy2 = dy.reshape(-1, N).to(x2.dtype)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        dx = dA = dB = None
        dh = _mm_f32(dy2, B_c) if A is not None else None                      # [T, r] fp32
        if ctx.needs_input_grad[0]:
            if A is not None:
                dx = lora_gemm_triton(dy2, q.t(), scale, w_scale_axis="reduction", h=dh[None],
                                      B=A_c.t()[None], out_dtype=x2.dtype)
            else:
                dx = lora_gemm_triton(dy2, q.t(), scale, w_scale_axis="reduction", out_dtype=x2.dtype)
            dx = dx.reshape(ctx.x_shape)
        if A is not None and ctx.needs_input_grad[3]:
            dA = _mm_f32(dh.to(x2.dtype).t(), x2).to(A.dtype)                   # [r, K]
        if B is not None and ctx.needs_input_grad[4]:
            dB = (s * _mm_f32(dy2.t(), h[0].to(x2.dtype))).to(B.dtype)          # [N, r]
        return dx, None, None, dA, dB, None, None


def lora_linear_triton(x, q, scale, A, B, lora_scale: float, bias=None):
    """x [..., K] bf16/fp16; q [N, K] e4m3, scale [N] fp32; A [r, K], B [N, r] (None = no adapter)."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"rlfp8.kernels.{OP}: the Triton training linear takes bf16/fp16 x, got {x.dtype} "
                        f"{tuple(x.shape)}; use backend 'torch' for other dtypes")
    if x.shape[-1] != q.shape[1]:
        raise ValueError(f"rlfp8.kernels.{OP}: x {tuple(x.shape)} does not match q {tuple(q.shape)} ([N, K])")
    if A is not None:
        if A.dim() != 2 or A.shape[1] != q.shape[1]:
            raise ValueError(f"rlfp8.kernels.{OP}: A must be [r, K={q.shape[1]}], got {tuple(A.shape)}")
        if B is None or B.dim() != 2 or B.shape != (q.shape[0], A.shape[0]):
            raise ValueError(f"rlfp8.kernels.{OP}: B must be [N={q.shape[0]}, r={A.shape[0]}], got "
                             f"{None if B is None else tuple(B.shape)}")
    return LoRALinearTriton.apply(x, q, scale, A, B, lora_scale, bias)
