"""FP8 formats and their plain-torch references (no Triton): per-output-channel weight quantization and per-token activation quantization.

Contract (docs/DESIGN.md): q float8_e4m3fn [N, K] (out x in, nn.Linear layout), scale fp32 [N],
w ~= scale[:, None] * q, with
    scale = max(amax_row / 448, 1 / (448 * 512)),   q = cast_rne(clamp(w / scale, -448, 448)).
One function produces the codes for the engine and for the trainer, so two copies are bit-identical.
The clamp before the cast matters: torch 2.11's float8 cast is not saturating (|x| >= 464 -> NaN),
torch 2.13's is, Triton's GPU cast (cvt.rn.satfinite) is; clamping first makes all three agree.

Activations (W8A8 only) use the same formula per row of x. vLLM's CUDA op
(dynamic_per_token_scaled_fp8_quant) divides (`x / s`); its Inductor-compiled Python path multiplies
by the reciprocal (`x * (1 / s)`); the two can differ by one rounding step, so both are selectable.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# 1 / (448 * 512), the smallest scale (keeps all-zero rows finite), as vLLM's kernels use it.
MIN_SCALE = float(torch.tensor(1.0 / (448.0 * 512.0), dtype=torch.float32))

ACT_ROUNDING = ("div", "recip")


def _rowwise_scale(x: torch.Tensor) -> torch.Tensor:
    """max(amax_row / 448, MIN_SCALE) with an IEEE fp32 division on every device.

    The divisor is a tensor on x's device, never a Python number: torch's CUDA `t / 448.0` treats the
    number as a CPU scalar and computes `t * fl(1/448)` (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu,
    "this may lose one bit of precision"), which differs from `amax / 448` in the last bit for some amax.
    vLLM's CUDA op, Triton's div_rn and torch's CPU kernel all divide exactly; so does this (full_like, not
    new_tensor: no host-to-device copy, so it also runs inside CUDA graph capture)."""
    amax = x.abs().amax(dim=-1).to(torch.float32)
    return torch.clamp(amax / torch.full_like(amax, FP8_MAX), min=MIN_SCALE)


def quantize_weight_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (q [N, K] float8_e4m3fn, scale [N] fp32)."""
    if w.dim() != 2:
        raise ValueError(f"quantize_weight: w must be 2-D [out, in], got shape {tuple(w.shape)}")
    scale = _rowwise_scale(w)                                   # [N]
    q = torch.clamp(w.to(torch.float32) / scale[:, None], -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_activation_ref(x: torch.Tensor, rounding: str = "div") -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scale [M, 1] fp32), per token (row).

    rounding="div": x / s, bit-equal to vLLM's CUDA dynamic_per_token_scaled_fp8_quant.
    rounding="recip": x * (1 / s), vLLM's QuantFP8.forward_native as Inductor compiles it.
    """
    if rounding not in ACT_ROUNDING:
        raise ValueError(f"activation rounding {rounding!r}: allowed values are {ACT_ROUNDING}")
    if x.dim() != 2:
        raise ValueError(f"quantize_activation: x must be 2-D [tokens, in], got shape {tuple(x.shape)}")
    scale = _rowwise_scale(x)[:, None]                          # [M, 1]
    xf = x.to(torch.float32)
    y = xf / scale if rounding == "div" else xf * scale.reciprocal()
    return torch.clamp(y, -FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """scale[:, None] * q in fp32, then cast: the oracle's dense weight (tests, PEFT export, bf16 arm)."""
    return (q.to(torch.float32) * scale[:, None].to(torch.float32)).to(dtype)
