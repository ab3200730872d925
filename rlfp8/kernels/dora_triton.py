"""DoRA's Triton kernels (references in rlfp8.kernels.dora) and the DoRA training linear on CUDA.

  norm_pieces_triton: U = diag(s_w)·(Q·Aᵀ) [N, r] and ‖W‖²_row [N] straight from the e4m3 codes, one pass over
      Q per rank block (grid: row blocks x rank blocks), no dense W. Precision "bf16x2" (GPU default): the code
      tile widened to bf16 (exact) and A = A_hi + A_lo split into two bf16 tiles, two tensor-core dots with fp32
      accumulation (~2^-17 relative per product, vs ~1e-3 for tf32); "ieee": fp32 FMA dots (slow, exact fp32).
  col_dot_triton: colsum(dy ⊙ (y − bias)) [N] fp32, one pass over dy and y; grid (column blocks, token
      chunks), each chunk's partial to its own fp32 row, summed in chunk order (deterministic).
  DoRALinearTriton: forward = K1 (lora_shrink) then K2 (lora_gemm) with g = m/n in the epilogue (the
      engine's DoRA arithmetic: one fused compose, y rounded once); backward = the LoRA backward
      (linear_triton.lora_backward_triton) with w_scale·g and g·B_c, dB scaled by g, dm from col_dot.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import dispatch
from ._triton_utils import cdiv, check_tensor, launch, next_pow2, require_triton_device
from .dora_ref import NORM_PRECISIONS, OP_COLDOT, OP_NORM, _check_base, column_scale_from_norm, dm_from_col_dot
from .linear_triton import lora_backward_triton
from .gemm_configs import NUM_SMS_HINT
from .gemm_triton import lora_gemm_triton
from .shrink_triton import lora_shrink_triton


@triton.jit
def _norm_pieces_kernel(q_ptr, sw_ptr, a_ptr, u_ptr, wsq_ptr, N, K, R,
                        stride_qn, stride_qk, stride_ar, stride_ak, stride_un, stride_ur,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                        WANT_WSQ: tl.constexpr, SPLIT_A: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_r = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    n_ok = offs_n < N
    r_ok = offs_r < R
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)                  # Q·Aᵀ tile
    sq = tl.zeros((BLOCK_N,), dtype=tl.float32)                           # Σ_k Q²
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = tl.load(q_ptr + rows[:, None] * stride_qn + offs_k[None, :] * stride_qk,
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)                           # [BN, BK] e4m3
        a = tl.load(a_ptr + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                    mask=r_ok[None, :] & k_ok[:, None], other=0.0)                           # [BK, BR] fp32
        # each K tile's product is summed on its own and then added: a chain of K / BLOCK_K additions instead
        # of K (the H200 measured 5-30x cuBLAS's fp32 error with one running sum over K)
        if SPLIT_A:
            w16 = w.to(tl.bfloat16)                                       # exact: e4m3 ⊂ bf16
            a_hi = a.to(tl.bfloat16)
            part = tl.dot(w16, a_hi)
            part = tl.dot(w16, (a - a_hi.to(tl.float32)).to(tl.bfloat16), part)
            acc += part
        else:
            part = tl.dot(w.to(tl.float32), a, input_precision="ieee")
            # an fma, not +=: Triton folds `acc + dot(a, b)` into `dot(a, b, acc)` (one running sum over K again:
            # the H200 measured 7x cuBLAS's fp32 error); fma(part, 1, acc) rounds as the add does
            acc = tl.fma(part, 1.0, acc)
        if WANT_WSQ:
            wf = w.to(tl.float32)
            sq += tl.sum(wf * wf, axis=1)
    sw = tl.load(sw_ptr + offs_n, mask=n_ok, other=0.0)
    tl.store(u_ptr + rows[:, None] * stride_un + offs_r[None, :] * stride_ur, acc * sw[:, None],
             mask=n_ok[:, None] & r_ok[None, :])
    if WANT_WSQ:
        if pid_r == 0:
            tl.store(wsq_ptr + offs_n, sq * sw * sw, mask=n_ok)


def norm_pieces_triton(q, scale, A, want_w_sq: bool = True, precision: str = "bf16x2",
                       block_n: int = 128, block_k: int = 64, max_block_r: int = 128, num_warps: int = 8,
                       num_stages: int = 3):
    """(‖W‖²_row [N] fp32 or None, U = W·Aᵀ [N, r] fp32); reference: dora.norm_pieces_ref."""
    _check_base(q, scale, A)
    if precision not in NORM_PRECISIONS:
        raise ValueError(f"rlfp8.kernels.{OP_NORM}: precision {precision!r}: allowed {NORM_PRECISIONS}")
    check_tensor(OP_NORM, "A", A, ndim=2, dtypes=(torch.float32,), device=q.device)
    require_triton_device(OP_NORM, q, A)
    dispatch.record(f"{OP_NORM}.precision", precision)
    N, K = q.shape
    R = A.shape[0]
    U = torch.empty((N, R), dtype=torch.float32, device=q.device)
    w_sq = torch.empty(N, dtype=torch.float32, device=q.device) if want_w_sq else U
    if N == 0 or R == 0:
        return (w_sq if want_w_sq else None), U
    block_r = min(max(16, next_pow2(R)), max_block_r)
    grid = (cdiv(N, block_n), cdiv(R, block_r))
    launch(_norm_pieces_kernel, grid, q, scale, A, U, w_sq, N, K, R,
           q.stride(0), q.stride(1), A.stride(0), A.stride(1), U.stride(0), U.stride(1),
           BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=block_r, WANT_WSQ=want_w_sq, SPLIT_A=precision == "bf16x2",
           num_warps=num_warps, num_stages=num_stages)
    return (w_sq if want_w_sq else None), U


@triton.jit
def _col_dot_kernel(dy_ptr, y_ptr, bias_ptr, part_ptr, T, N, T_CHUNK,
                    stride_dt, stride_dn, stride_yt, stride_yn, stride_pc,
                    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t_lo = pid_c * T_CHUNK
    t_hi = tl.minimum(T, t_lo + T_CHUNK)
    for t0 in range(t_lo, t_hi, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        ok = (offs_t < t_hi)[:, None] & n_ok[None, :]
        rows = offs_t.to(tl.int64)
        d = tl.load(dy_ptr + rows[:, None] * stride_dt + offs_n[None, :] * stride_dn, mask=ok, other=0.0)
        z = tl.load(y_ptr + rows[:, None] * stride_yt + offs_n[None, :] * stride_yn, mask=ok, other=0.0)
        z = z.to(tl.float32)
        if HAS_BIAS:
            z = tl.where(ok, z - b[None, :], 0.0)
        acc += tl.sum(d.to(tl.float32) * z, axis=0)
    tl.store(part_ptr + pid_c * stride_pc + offs_n, acc, mask=n_ok)


def col_dot_triton(dy, y, bias=None, block_t: int = 32, block_n: int = 256, chunks: int | None = None,
                   num_warps: int = 4):
    """colsum(dy ⊙ (y − bias)) [N] fp32; reference: dora.col_dot_ref. dy, y [T, N] (16-bit or fp32)."""
    check_tensor(OP_COLDOT, "dy", dy, ndim=2, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    check_tensor(OP_COLDOT, "y", y, shape=tuple(dy.shape), device=dy.device)
    T, N = dy.shape
    if bias is not None:
        check_tensor(OP_COLDOT, "bias", bias, shape=(N,), device=dy.device)
    require_triton_device(OP_COLDOT, dy)
    n_blocks = cdiv(N, block_n)
    if chunks is None:                                     # ~4 programs per SM for a memory-bound pass
        chunks = cdiv(4 * NUM_SMS_HINT, n_blocks)
    chunks = max(1, min(chunks, cdiv(max(T, 1), block_t)))
    t_chunk = cdiv(cdiv(max(T, 1), chunks), block_t) * block_t
    chunks = cdiv(max(T, 1), t_chunk)
    part = torch.empty((chunks, N), dtype=torch.float32, device=dy.device)
    if N == 0:
        return part.sum(0)
    launch(_col_dot_kernel, (n_blocks, chunks), dy, y, bias if bias is not None else dy, part, T, N, t_chunk,
           dy.stride(0), dy.stride(1), y.stride(0), y.stride(1), part.stride(0),
           BLOCK_T=block_t, BLOCK_N=block_n, HAS_BIAS=bias is not None, num_warps=num_warps)
    return part[0] if chunks == 1 else part.sum(0)


class DoRALinearTriton(torch.autograd.Function):
    """Autograd over (x, A, B, m); q, scale, bias frozen buffers; norm [N] detached (module docstring)."""

    @staticmethod
    def forward(ctx, x, q, scale, A, B, m, norm, lora_scale, bias):
        K, N = x.shape[-1], q.shape[0]
        x2 = x.reshape(-1, K)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        g = column_scale_from_norm(m, norm).contiguous()                         # [N] fp32
        A_c = A.to(x.dtype)                                                        # [r, K]
        B_c = (B * lora_scale).to(x.dtype)                                         # [N, r]
        h = lora_shrink_triton(x2, A_c[None], None).h                              # [1, T, r] fp32
        y = lora_gemm_triton(x2, q, scale, h=h, B=B_c[None], g=g[None], bias=bias)  # g in K2's epilogue
        ctx.save_for_backward(x2, q, scale, A, B, A_c, h, m, g, y, bias)
        ctx.lora_scale = lora_scale
        ctx.x_shape = x.shape
        return y.reshape(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, dy):
        x2, q, scale, A, B, A_c, h, m, g, y, bias = ctx.saved_tensors
        s = ctx.lora_scale
        needs = ctx.needs_input_grad
        N = q.shape[0]
        B_g = (g[:, None] * B.float() * s).to(x2.dtype)                          # g·B_c, rounded once
        dx, dA, dB = lora_backward_triton(dy, x2, q, scale * g, A_c, B_g, h, s, ctx.x_shape, needs[0],
                                          needs[3], needs[4])
        if dB is not None:
            dB = (g[:, None] * dB).to(B.dtype)
        if dA is not None:
            dA = dA.to(A.dtype)
        dm = None
        if needs[5]:
            dy2 = dy.reshape(-1, N)
            dispatch.record(OP_COLDOT, "triton")
            dm = dm_from_col_dot(col_dot_triton(dy2 if dy2.stride(-1) == 1 else dy2.contiguous(), y, bias),
                                 m).to(m.dtype)
        return dx, None, None, dA, dB, dm, None, None, None
