"""Triton FP8 quantizers: per-output-channel weights and per-token activations (rows of a 2-D tensor).

Bit-exact to rlfp8.kernels.fp8's references (the contract in docs/DESIGN.md):
    scale = max(amax_row / 448, 1/(448*512))        amax exact (max is order-free), fp32 true division
    q     = cast_rne(clamp(x / scale, -448, 448))     "div"   (vLLM's CUDA dynamic_per_token_scaled_fp8_quant)
    q     = cast_rne(clamp(x * (1/scale), ...))        "recip" (vLLM's QuantFP8.forward_native)
Divisions use tl.math.div_rn: Triton lowers `/` on fp32 to the approximate `div.full.f32` (2 ulp), which
would break bit-exactness; div_rn is `div.rn.f32` (IEEE). The clamp precedes the cast (torch 2.11's cast is
not saturating; Triton's cvt.rn.satfinite is).

The row helpers (_rows_scale, _rows_quant / _quant_codes) are shared with K1 (lora_shrink) and K2 (lora_gemm's
quantize_x), so the fused W8A8 quantizations and the stand-alone one are the same arithmetic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import cdiv, check_pdl, check_tensor, launch, next_pow2, require_triton_device
from .fp8_ref import ACT_ROUNDING, FP8_DTYPE, FP8_MAX, MIN_SCALE

ROUNDING_CODE = {"div": 1, "recip": 2}


@triton.jit
def _rows_scale(amax):
    """amax [BM] fp32 -> scale [BM] fp32 = max(amax / 448, 1/(448*512)), IEEE division."""
    return tl.maximum(tl.math.div_rn(amax, 448.0), 1.0 / (448.0 * 512.0))


@triton.jit
def _quant_codes(v, s, ROUNDING: tl.constexpr):
    """v fp32 tile, s its per-token scales broadcast against it (s[:, None] for token rows, s[None, :] for token
    columns) -> e4m3 codes; ROUNDING 1 = x / s, 2 = x * (1 / s)."""
    if ROUNDING == 1:
        # zeros (and masked lanes, loaded as 0) skip the division: div.rn.f32's fast path is range-checked
        # (FCHK), and we believe a zero or subnormal dividend takes the slow subroutine. In the first H200
        # run, K1's quantization of mostly-padding row tiles (T = 1) cost ~5x that of full ones (T = 16,
        # same config), which fits. The result is the same either way (+-0 / s = +-0).
        nz = v != 0.0
        y = tl.where(nz, tl.math.div_rn(tl.where(nz, v, s), s), v)
    else:
        y = v * tl.math.div_rn(1.0, s)
    return tl.clamp(y, -448.0, 448.0).to(tl.float8e4nv)


@triton.jit
def _rows_quant(v, scale, ROUNDING: tl.constexpr):
    """v [BM, BK] fp32, scale [BM] fp32 -> e4m3 codes [BM, BK]; ROUNDING 1 = x / s, 2 = x * (1 / s)."""
    return _quant_codes(v, scale[:, None], ROUNDING)


@triton.jit
def _quant_rows_tile(x_ptr, q_ptr, s_ptr, rows, row_ok, K, stride_xm, stride_xk, stride_qm, stride_qk,
                     stride_s, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROUNDING: tl.constexpr):
    """Quantize rows `rows` [BLOCK_M] (gathered row indices; row_ok masks padding) over the full K.
    Two passes over K (amax, then codes; the second re-reads x from L2), one when K <= BLOCK_K."""
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_qm
    if K <= BLOCK_K:  # whole row in registers
        m = row_ok[:, None] & (offs_k[None, :] < K)
        v = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=m, other=0.0).to(tl.float32)   # [BM, BK]
        scale = _rows_scale(tl.max(tl.abs(v), axis=1))                                          # [BM]
        tl.store(q_rows + offs_k[None, :] * stride_qk, _rows_quant(v, scale, ROUNDING), mask=m)
    else:
        amax = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            m = row_ok[:, None] & ((k0 + offs_k)[None, :] < K)
            v = tl.load(x_rows + (k0 + offs_k)[None, :] * stride_xk, mask=m, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = _rows_scale(tl.max(amax, axis=1))
        for k0 in range(0, K, BLOCK_K):
            m = row_ok[:, None] & ((k0 + offs_k)[None, :] < K)
            v = tl.load(x_rows + (k0 + offs_k)[None, :] * stride_xk, mask=m, other=0.0).to(tl.float32)
            tl.store(q_rows + (k0 + offs_k)[None, :] * stride_qk, _rows_quant(v, scale, ROUNDING), mask=m)
    tl.store(s_ptr + rows * stride_s, scale, mask=row_ok)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_xk, stride_qm, stride_qk, stride_s,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROUNDING: tl.constexpr, USE_PDL: tl.constexpr):
    # grid (cdiv(M, BLOCK_M),): BLOCK_M rows per program.
    if USE_PDL:
        # a dependent K2 may launch now: it reads the codes only after gdc_wait (this kernel complete, flushed)
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    _quant_rows_tile(x_ptr, q_ptr, s_ptr, rows, row_ok, K, stride_xm, stride_xk, stride_qm, stride_qk, stride_s,
                     BLOCK_M, BLOCK_K, ROUNDING)


def _quant_config(M: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps): at most 4096 elements per tile (32 fp32 registers per thread at 4 warps),
    so a row of K <= 4096 (every Qwen3 hidden size but the MLP's 12288) is read once and quantized in
    registers (one pass); longer rows take two passes (amax, then codes from L2). One row per program for
    K >= 4096: M programs, enough for every M. K1's fused quantization (lora_shrink) uses the same config."""
    block_k = min(next_pow2(K), 4096)
    block_m = max(1, min(16, 4096 // block_k, next_pow2(M)))
    return block_m, block_k, 4


def quantize_rows_triton(x: torch.Tensor, rounding: str, op: str,
                         use_pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32, last dim any stride) -> (q [M, K] e4m3 contiguous, scale [M] fp32).
    use_pdl: the kernel triggers its programmatic dependent's launch at its start."""
    check_tensor(op, "x", x, ndim=2, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    if rounding not in ACT_ROUNDING:
        raise ValueError(f"activation rounding {rounding!r}: allowed values are {ACT_ROUNDING}")
    require_triton_device(op, x)
    check_pdl(op, use_pdl)
    M, K = x.shape
    q = torch.empty((M, K), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return q, s.fill_(MIN_SCALE)
    bm, bk, nw = _quant_config(M, K)
    launch(_quant_rows_kernel, (cdiv(M, bm),), x, q, s, M, K, x.stride(0), x.stride(1),
           q.stride(0), q.stride(1), s.stride(0), BLOCK_M=bm, BLOCK_K=bk, ROUNDING=ROUNDING_CODE[rounding],
           USE_PDL=use_pdl, num_warps=nw)
    return q, s


def quantize_weight_triton(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] float8_e4m3fn, scale [N] fp32), bit-equal to fp8.quantize_weight_ref."""
    return quantize_rows_triton(w, "div", "quantize_weight")


def quantize_activation_triton(x: torch.Tensor, rounding: str = "div",
                               use_pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scale [M, 1] fp32), bit-equal to fp8.quantize_activation_ref."""
    q, s = quantize_rows_triton(x, rounding, "quantize_activation", use_pdl)
    return q, s[:, None]


assert FP8_MAX == 448.0  # the kernels hard-code the e4m3 range
