"""The training linear on CUDA: autograd over (x, A, B) on FP8 codes q [N, K] + per-row scale [N].

Forward = the engine's W8A16 projection with one adapter and no metadata (K1 `lora_shrink` for
h = x·A_cᵀ in fp32, then K2 `lora_gemm` with the adapter's h·B_cᵀ in the epilogue), with the reference's
operand roundings: A_c = A.to(x.dtype), B_c = (B·s).to(x.dtype) (s folded into B as vLLM stores it).
It calls the same kernels with the same configs as `fp8_lora_linear(..., mode="w8a16")`, so for the same
rows (same T, same projection) engine and trainer outputs are bit-identical (the matched property).

Backward (dy [T, N], no bf16 copy of the weight ever exists), the DESIGN contract's form:
  gy = (dy ⊙ s_w) rounded once to x.dtype [T, N],  dh = dy·B_c [T, r] fp32: one pass over dy (`dy_prep`,
       below: each program streams its token rows through N once, storing gy and accumulating dh)
  dx = gy·q + dh·A_c  [T, K]: K2 on the transposed FP8 view qᵀ [K, N] (strides (1, K)) with no scale at all,
       the codes widened exactly in registers as in the forward (the scale went into gy, so the main loop is
       the forward's W8A16 loop), dh·A_c added in the epilogue (A_cᵀ read as the epilogue's "B", h = dh);
       rounding: gy's, where the fp32 reference has none (|err| <= 2^-9 relative per element of gy);
  dA = dhᵀ·x  [r, K],  dB = s·dyᵀ·h  [N, r]: bf16 MMA with fp32 output (dh and h rounded to bf16 as PEFT's
       bf16 LoRA does), cast to the parameters' dtype.
x must be bf16 or fp16 (the kernels' 16-bit MMA); other dtypes raise (use the torch reference).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from . import dispatch
from ._triton_utils import cdiv, check_tensor, launch, max_shared_mem, next_pow2, require_triton_device
from .gemm_configs import NUM_SMS_HINT, SM90_MAX_SMEM, SMEM_SLACK
from .gemm_triton import lora_gemm_triton
from .knobs import knobs
from .shrink_triton import lora_shrink_triton

OP = "lora_linear"


@triton.jit
def _dy_prep_kernel(dy_ptr, sw_ptr, b_ptr, gy_ptr, dh_ptr, T, N, R, N_CHUNK,
                    stride_dt, stride_dn, stride_gt, stride_gn, stride_bn, stride_br, stride_hc, stride_ht, stride_hr,
                    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, HAS_B: tl.constexpr,
                    EVEN_N: tl.constexpr):
    # program (token block, column chunk): BLOCK_T rows x N_CHUNK columns of dy, read once; gy stored, the
    # chunk's partial dh [BT, r] stored to its own plane of the fp32 workspace (summed in chunk order after)
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)                   # [BT]
    t_ok = offs_t < T
    rows = tl.where(t_ok, offs_t, 0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)                # partial dh rows [BT, BR]
    n_lo = pid_c * N_CHUNK
    n_hi = tl.minimum(N, n_lo + N_CHUNK)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_hi
        if EVEN_N:
            d = tl.load(dy_ptr + rows[:, None] * stride_dt + offs_n[None, :] * stride_dn)            # [BT, BN]
            sw = tl.load(sw_ptr + offs_n)
        else:
            d = tl.load(dy_ptr + rows[:, None] * stride_dt + offs_n[None, :] * stride_dn, mask=n_ok[None, :],
                        other=0.0)
            sw = tl.load(sw_ptr + offs_n, mask=n_ok, other=0.0)
        gy = (d.to(tl.float32) * sw[None, :]).to(gy_ptr.dtype.element_ty)                            # one rounding
        tl.store(gy_ptr + rows[:, None] * stride_gt + offs_n[None, :] * stride_gn, gy,
                 mask=t_ok[:, None] & n_ok[None, :])
        if HAS_B:
            b = tl.load(b_ptr + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br,
                        mask=n_ok[:, None] & r_ok[None, :], other=0.0)                               # [BN, BR]
            acc = tl.dot(d, b, acc)                                     # 16-bit products, fp32 accumulation
    if HAS_B:
        tl.store(dh_ptr + pid_c * stride_hc + rows[:, None] * stride_ht + offs_r[None, :] * stride_hr, acc,
                 mask=t_ok[:, None] & r_ok[None, :])


def dy_prep_smem(block_t: int, block_n: int, rank: int, num_stages: int) -> int:
    """Upper bound on _dy_prep_kernel's shared memory: num_stages · (the dy tile BLOCK_T·BLOCK_N + the B_c tile
    BLOCK_N·BLOCK_R, 16-bit each) + SMEM_SLACK (checked against the compiler: tests/kernel/test_gemm_smem_fit.py)."""
    block_r = max(16, next_pow2(rank)) if rank else 0
    return num_stages * (block_t + block_r) * block_n * 2 + SMEM_SLACK


def fit_dy_prep(block_t: int, block_n: int, rank: int, num_stages: int, limit: int) -> tuple[int, int]:
    """(block_n, num_stages) within `limit` bytes: fewer stages down to 2, then narrower column tiles (down to
    16), then 1 stage. dh stays deterministic (the column chunks are whole tiles, summed in chunk order); the
    backward has no engine counterpart to match. ValueError when nothing fits."""
    while dy_prep_smem(block_t, block_n, rank, num_stages) > limit:
        if num_stages > 2:
            num_stages -= 1
        elif block_n > 16:
            block_n //= 2
        elif num_stages > 1:
            num_stages -= 1
        else:
            raise ValueError(f"rlfp8.kernels.{OP}.dy_prep: no tile fits {limit} bytes of shared memory at rank "
                             f"{rank} (BLOCK_T {block_t})")
    return block_n, num_stages


def dy_prep_triton(dy: torch.Tensor, w_scale: torch.Tensor, B_c: torch.Tensor | None = None,
                   block_t: int = 64, block_n: int = 128, chunks: int | None = None, num_warps: int = 8,
                   num_stages: int = 3):
    """gy = (dy ⊙ w_scale) rounded once to dy.dtype [T, N], and dh = dy·B_c [T, r] fp32 (None without B_c),
    reading dy once. dy [T, N] bf16/fp16; w_scale [N] fp32; B_c [N, r] in dy.dtype. Reference: linear.dy_prep_ref.

    The grid is (token blocks, column chunks): a memory-bound pass needs many programs in flight, so N is cut
    into `chunks` (default: enough for ~4 programs per SM); each chunk's partial dh goes to its own fp32 plane
    and the planes are summed in chunk order (deterministic; chunks * T * r * 4 bytes, a few MiB)."""
    check_tensor(OP, "dy", dy, ndim=2, dtypes=(torch.bfloat16, torch.float16))
    T, N = dy.shape
    check_tensor(OP, "w_scale", w_scale, shape=(N,), dtypes=(torch.float32,), device=dy.device)
    if B_c is not None:
        check_tensor(OP, "B_c", B_c, ndim=2, dtypes=(dy.dtype,), device=dy.device)
        if B_c.shape[0] != N:
            raise ValueError(f"rlfp8.kernels.{OP}: B_c must be [N={N}, r], got {tuple(B_c.shape)}")
    require_triton_device(OP, dy)
    dispatch.record(f"{OP}.dy_prep", "triton")
    gy = torch.empty((T, N), dtype=dy.dtype, device=dy.device)
    r = B_c.shape[1] if B_c is not None else 0
    fitted = fit_dy_prep(block_t, block_n, r, num_stages, max_shared_mem(dy.device, SM90_MAX_SMEM))
    dispatch.record(f"{OP}.dy_prep_smem", "fits" if fitted == (block_n, num_stages) else "fit_smem")
    block_n, num_stages = fitted
    if T == 0 or N == 0:
        return gy, (torch.zeros((T, r), dtype=torch.float32, device=dy.device) if B_c is not None else None)
    t_blocks = cdiv(T, block_t)
    n_blocks = cdiv(N, block_n)
    if chunks is None:
        chunks = cdiv(4 * NUM_SMS_HINT, t_blocks)
    chunks = max(1, min(chunks, n_blocks))
    n_chunk = cdiv(n_blocks, chunks) * block_n                   # whole BLOCK_N tiles per chunk
    chunks = cdiv(N, n_chunk)
    part = torch.empty((chunks, T, r), dtype=torch.float32, device=dy.device) if B_c is not None else gy[None]
    b = B_c if B_c is not None else gy
    launch(_dy_prep_kernel, (t_blocks, chunks), dy, w_scale, b, gy, part, T, N, r, n_chunk,
           dy.stride(0), dy.stride(1), gy.stride(0), gy.stride(1), b.stride(0), b.stride(1),
           part.stride(0), part.stride(1), part.stride(2),
           BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_R=max(16, next_pow2(r)), HAS_B=B_c is not None,
           EVEN_N=N % block_n == 0, num_warps=num_warps, num_stages=num_stages)
    if B_c is None:
        return gy, None
    return gy, (part[0] if chunks == 1 else part.sum(0))


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


_SIDE: dict = {}


def _side_stream(device) -> torch.cuda.Stream:
    """One side stream per device for the backward's LoRA-gradient GEMMs (created once: graph-capture safe)."""
    key = torch.device(device)
    if key not in _SIDE:
        _SIDE[key] = torch.cuda.Stream(device=key)
    return _SIDE[key]


def _on(stream):
    """torch.cuda.stream(stream), or no change when stream is None (CPU, interpreter)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _record(stream) -> torch.cuda.Event:
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


# The backward's dA/dB GEMMs go to a side stream only where the dx GEMM they overlap is long: the switch
# costs ~50-100 us of host time per call (stream lookups, an event, two stream contexts, the join), which
# the GPU hides only when it, not the host, is the bottleneck. Rule (knob-free): side stream when the dx GEMM
# does >= 2^36 flop (2·T·N·K; ~0.2 ms of bf16 MMA on an H200, about the call's host cost): a Qwen3-8B
# projection at 8k tokens (275 GFLOP) takes it, the quickstart's largest (8192 x 1536 x 576: 14 GFLOP) not.
# With the knob host_fast off every CUDA call takes it (the old path). Same kernels either way: same bits.
SIDE_STREAM_MIN_FLOP = 1 << 36


def _side_stream_for(dy2: torch.Tensor, K: int):
    """The side stream for this backward's dA/dB GEMMs, or None (CPU, interpreter, or a short dx GEMM)."""
    if not dy2.is_cuda:
        return None
    T, N = dy2.shape
    if knobs().host_fast and 2 * T * N * K < SIDE_STREAM_MIN_FLOP:
        return None
    return _side_stream(dy2.device)


def _adapter_operands(A, B, lora_scale: float, dtype, casts):
    """(A_c [r, K], B_c [N, r]) = (A.to(dtype), (B·s).to(dtype)): from the caller's per-parameter cache
    `casts(dtype)` (FP8LoRALinear.adapter_casts) when the knob host_fast is on, else computed here."""
    if casts is None or not knobs().host_fast:
        return A.to(dtype), (B * lora_scale).to(dtype)
    A_c, B_c = casts(dtype)
    if A_c.dtype != dtype or B_c.dtype != dtype or A_c.shape != A.shape or B_c.shape != B.shape:
        raise ValueError(f"rlfp8.kernels.{OP}: casts({dtype}) returned A_c {A_c.dtype} {tuple(A_c.shape)}, B_c "
                         f"{B_c.dtype} {tuple(B_c.shape)} for A {tuple(A.shape)}, B {tuple(B.shape)}")
    return A_c, B_c


class LoRALinearTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, q, scale, A, B, lora_scale, bias, casts=None):
        K = x.shape[-1]
        N = q.shape[0]
        x2 = x.reshape(-1, K)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        h = A_c = B_c = None
        if A is not None:
            A_c, B_c = _adapter_operands(A, B, lora_scale, x.dtype, casts)     # [r, K], [N, r]
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
        needs = ctx.needs_input_grad
        dx, dA, dB = lora_backward_triton(dy, x2, q, scale, A_c, B_c, h, ctx.lora_scale, ctx.x_shape, needs[0],
                                          A is not None and needs[3], B is not None and needs[4])
        return (dx, None, None, None if dA is None else dA.to(A.dtype), None if dB is None else dB.to(B.dtype),
                None, None, None)


def lora_backward_triton(dy, x2, q, w_scale, A_c, B_c, h, lora_scale: float, x_shape, need_dx: bool,
                         need_dA: bool, need_dB: bool):
    """The backward of the module docstring: dx (x.dtype, x_shape), dA [r, K] and dB [N, r] fp32 (None where
    not needed). x2 [T, K] 16-bit; A_c [r, K], B_c [N, r] in x2.dtype (None = no adapter); h [1, T, r] fp32.
    DoRA calls it with w_scale·g and g·B_c (linear.lora_backward_ref is the reference)."""
    s = lora_scale
    N = q.shape[0]
    dy2 = dy.reshape(-1, N).to(x2.dtype)
    if dy2.stride(-1) != 1:
        dy2 = dy2.contiguous()
    dx = dA = dB = None
    # dA and dB are skinny, memory-bound GEMMs: on CUDA they may run on a side stream while the main stream
    # runs the compute-bound dx GEMM (dB needs only dy and h: it starts at once; dA waits for dh)
    side = _side_stream_for(dy2, x2.shape[1])
    if dy2.is_cuda:
        dispatch.record(f"{OP}.grad_stream", "side" if side is not None else "main")
    main = torch.cuda.current_stream(dy2.device) if side is not None else None     # looked up once
    if side is not None:
        side.wait_stream(main)
    if A_c is not None and need_dB:
        with _on(side):
            dB = s * _mm_f32(dy2.t(), h[0].to(x2.dtype))                       # [N, r]
    dh = None
    if need_dx:
        gy, dh = dy_prep_triton(dy2, w_scale, B_c)                             # [T, N] x.dtype, [T, r] fp32
        dh_ready = _record(main) if side is not None else None
        lora = dict(h=dh[None], B=A_c.t()[None]) if A_c is not None else {}
        dx = lora_gemm_triton(gy, q.t(), None, out_dtype=x2.dtype, **lora).reshape(x_shape)
    elif A_c is not None:
        dh = _mm_f32(dy2, B_c)                                                  # [T, r] fp32
        dh_ready = _record(main) if side is not None else None
    if A_c is not None and need_dA:
        with _on(side):
            if side is not None:
                side.wait_event(dh_ready)
            dA = _mm_f32(dh.to(x2.dtype).t(), x2)                               # [r, K]
    if side is not None:                                                        # join; outputs made on the side
        main.wait_stream(side)
        for t in (dA, dB):
            if t is not None:
                t.record_stream(main)
    return dx, dA, dB


def lora_linear_triton(x, q, scale, A, B, lora_scale: float, bias=None, casts=None):
    """x [..., K] bf16/fp16; q [N, K] e4m3, scale [N] fp32; A [r, K], B [N, r] (None = no adapter);
    casts: optional dtype -> (A.to(dtype), (B·s).to(dtype)), detached, e.g. cached per parameter version."""
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
    return LoRALinearTriton.apply(x, q, scale, A, B, lora_scale, bias, casts)
