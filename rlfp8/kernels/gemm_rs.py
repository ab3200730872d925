"""K2's W8A16 main loop for many tokens, written in Gluon (Triton's explicit-layout dialect): the trainer's
forward and dx GEMMs (8k-token steps) and long prefills without metadata.

    y[t, n] = bf16( g[n] · ( s_w[n] · Σ_k x[t, k] · widen(q[n, k])  +  Σ_j h[t, j] · B[n, j] )  +  bias[n] )
    dx GEMM: q read transposed (q is the stored codes' view qᵀ), no s_w (it is in x = gy)

The same arithmetic, instruction for instruction, as K2's swap-AB loop with its large-token config (wgmma
m64 n256 k16, A = the widened weight rows, B = the x tile, k16 chunks in k order, fp32 accumulation; then
the scale, the two 16-bit LoRA MMAs on h = hi + lo (per rank chunk of 32 above rank 64), DoRA's g, bias, one
rounding): the results are bit-identical to
K2's Triton kernel (gemm_triton; checked on the GPU for every training shape, tests/gpu), so the matched
property holds whichever of the two runs on either side.

Why a second kernel: Triton's pipeliner runs this loop with a CTA-wide barrier per k-step, pointer x loads
and one code stream for both warpgroups, so the widening and the wgmma do not overlap. Here (CUTLASS's "RS" warp-specialized mainloop):
  * partitions: one TMA warp loads the x tile [BM tokens, BK] and the e4m3 tile [2·64 rows, BK] of step i
    into ring slot i % S (one `ready` barrier per slot); two MMA partitions, one warpgroup each, own 64
    weight rows. A warpgroup loads its e4m3 rows straight from the slot into wgmma's register-A fragment
    (one 16-bit LDS per k-pair), widens them in registers (PRMT trick, exact) and issues the async wgmma
    with the x slot as the shared-memory B operand; after wait(1) retired step i-1's wgmma it arrives on
    `consumed[(i-1) % S]` (count 2: both warpgroups). The warpgroups never wait for each other.
  * register hygiene, else ptxas serializes every wgmma (C7513/C7515; tests/kernel compiles this kernel for
    sm_90a and checks for those warnings): two k-steps per loop iteration with the A fragments alternating
    between two register sets, each kept live (_keep) until the wait that retires its wgmma; the first two
    steps peeled, so no zero-filled accumulator reaches the loop exit on a path that skips the wgmmas.
  * epilogue: scale; LoRA (h·Bᵀ, h fp32 split into bf16 hi + lo as K2's "bf16x2"): once both warpgroups
    retired their last wgmma (mbarrier `epi`, phase 0) the ring is free; each warpgroup writes half of the
    tile's h rows (hi into slot 0, lo into slot 1) and its B tile (slot 2), fenced; after phase 1 each runs
    B·h_hiᵀ then B·h_loᵀ with both operands in shared memory (a register-sourced B tile there makes ptxas
    serialize every wgmma of the kernel, C7512). Above rank 64, K2's rank chunks of 32 the same way, one epi
    phase each, alternating between columns 0:32 and 32:64 of the slots, the next chunk's h loads in flight
    during the current chunk's wgmmas (_lora_rank_chunks). DoRA's g; bias; the output tile goes through
    shared memory so that each thread stores 16 contiguous bytes.
Its measured speed against cuBLAS and the Triton loop: bench/README.md, "K2's Gluon main loop".

Limits (the caller, lora_gemm_triton, routes everything else to the Triton kernel and records which ran):
bf16 x, one adapter without metadata (the trainer; no gather; DoRA's g [1, N] allowed), rank <= 512, K % 128 == 0,
N % 128 == 0, sm_90, more than 512 tokens (below, the Triton kernel is faster: bench/README.md).
Gluon kernels do not run under TRITON_INTERPRET: the CPU tests compile this one for sm_90a (ptxas) and check
the protocol; the numerics are GPU tests against the reference and against K2.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._triton_utils import cdiv, launch
from .gemm_configs import RANK_CHUNK, RANK_CHUNK_FROM, block_r
from .widen import E4M3X2_TO_BF16_PTX

OP = "lora_gemm"
BM, BN, BK, STAGES, GROUP_M = 256, 128, 64, 4, 8     # tokens, weight rows (2 warpgroups x 64), k-step, ring
MAX_RANK = 512        # up to 64 in one piece (h hi, h lo, B: one ring slot's columns each), above in chunks of 32
MMA_REGS, LOAD_REGS, LAUNCH_REGS = 232, 24, 168       # per thread; 384 threads x 168 fit the register file
# above rank 64 the worker MMA warpgroup gets 8 more (the default one then gets 240 instead of 248 of the same
# budget): the next rank chunk's h prefetch spilled two registers at 232
MMA_REGS_CHUNKED = 240
_LOAD_REGS = gl.constexpr(LOAD_REGS)


def supported(x: torch.Tensor, q: torch.Tensor, rank: int | None, *, gather: bool) -> str | None:
    """None if this kernel can run the call, else why not (recorded by the caller)."""
    if not x.is_cuda:
        return "not a CUDA tensor"
    if x.dtype != torch.bfloat16:
        return f"x dtype {x.dtype}"
    if gather:
        return "metadata (gather)"
    if rank is not None and rank > MAX_RANK:
        return f"rank {rank} > {MAX_RANK}"
    N, K = q.shape
    if K % (2 * BK) or N % BN:
        return f"shape N={N}, K={K} (needs N % {BN} == 0, K % {2 * BK} == 0)"
    if not (q.stride(1) == 1 or q.stride(0) == 1):
        return "q is neither row-major nor a transposed row-major view"
    if (x.stride(0) * 2) % 16 or x.data_ptr() % 16 or q.data_ptr() % 16:
        return "x / q not 16-byte aligned for TMA"
    if _capability(x.device) != (9, 0):
        return "not sm_90"
    return None


_caps: dict = {}


def _capability(device: torch.device) -> tuple[int, int]:
    if device not in _caps:
        _caps[device] = torch.cuda.get_device_capability(device)
    return _caps[device]


@gluon.jit
def _e4m3x2_to_bf16(codes):
    """Exact e4m3 -> bf16 on two codes per 32-bit register (the A fragment's k-pairs): byte and sign spread
    (PRMT), exponent/mantissa moved into bf16's fields, times 2^120 (bias 127 - 7); widen._e4m3x2_to_bf16."""
    return gl.inline_asm_elementwise(
        asm=E4M3X2_TO_BF16_PTX,
        constraints="=r,r", args=[codes.to(gl.uint8, bitcast=True)], dtype=gl.bfloat16, is_pure=True, pack=2)


@gluon.jit
def _keep(x):
    """A zero-instruction use of x (tied in/out registers): x's registers stay live up to here, so no later value
    takes them while an asynchronous wgmma may still read them."""
    return gl.inline_asm_elementwise("", "=r,0", [x], dtype=x.dtype, is_pure=False, pack=2)


@gluon.jit
def _tile_offsets(M, N, TM: gl.constexpr, TN: gl.constexpr, GROUP_M: gl.constexpr):
    # grouped order: GROUP_M token tiles sweep all weight tiles (x and q tiles stay in L2)
    pid = gl.program_id(0)
    num_m = gl.cdiv(M, TM)
    num_n = gl.cdiv(N, TN)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = gl.minimum(num_m - first_m, GROUP_M)
    return (first_m + (pid % per_group) % group_size) * TM, ((pid % per_group) // group_size) * TN


@gluon.jit
def _loader(descs, rings, bars, offs, TRANS_Q: gl.constexpr):
    """One warp: x and e4m3 tiles of step i into slot i % S once every MMA warpgroup released step i - S."""
    x_desc, q_desc = descs
    x_ring, q_ring = rings
    ready, consumed = bars
    off_t, off_w, k_tiles = offs
    S: gl.constexpr = x_ring.type.shape[0]
    BKc: gl.constexpr = x_ring.type.shape[2]
    nbytes: gl.constexpr = x_desc.block_type.nbytes + q_desc.block_type.nbytes
    for i in range(k_tiles):
        s = i % S
        mbarrier.wait(consumed.index(s), ((i // S) & 1) ^ 1)          # fresh barrier: the first lap passes
        mbarrier.expect(ready.index(s), nbytes)
        tma.async_copy_global_to_shared(x_desc, [off_t, i * BKc], ready.index(s), x_ring.index(s))
        if TRANS_Q:
            tma.async_copy_global_to_shared(q_desc, [i * BKc, off_w], ready.index(s), q_ring.index(s))
        else:
            tma.async_copy_global_to_shared(q_desc, [off_w, i * BKc], ready.index(s), q_ring.index(s))


@gluon.jit
def _operand(q_ring, ready, i, a_layout: gl.constexpr, WG: gl.constexpr, TRANS_Q: gl.constexpr):
    """Wait for step i's slot; this warpgroup's 64 e4m3 rows straight into the A fragment, widened."""
    S: gl.constexpr = q_ring.type.shape[0]
    s = i % S
    mbarrier.wait(ready.index(s), (i // S) & 1)
    if TRANS_Q:
        w_tile = q_ring.index(s).slice(WG * 64, 64, dim=1).permute((1, 0))    # [64 out, BK red] of [BK, BN]
    else:
        w_tile = q_ring.index(s).slice(WG * 64, 64)                            # [64 rows, BK]
    return _e4m3x2_to_bf16(w_tile.load(a_layout))


# above RANK_CHUNK_FROM, K2's rank chunk (gemm_configs.rank_chunk): the same k16 steps in the same order; two
# chunks side by side fill a ring slot's BK columns
assert 2 * RANK_CHUNK == BK, (RANK_CHUNK, BK)
_RANK_CHUNK = gl.constexpr(RANK_CHUNK)
_RANK_CHUNK_FROM = gl.constexpr(RANK_CHUNK_FROM)


@gluon.jit
def _load_rank_chunk(lora_args, r0, off_t, off_w, M, HALF: gl.constexpr, WG: gl.constexpr):
    """Ranks [r0, r0 + 32) of this warpgroup's half of the tile's h rows ([HALF, 32] fp32) and of its 64 B rows
    ([64, 32] bf16), zeros beyond M and R as K2's masked chunk loads (none at all past R: no memory traffic)."""
    h_ptr, b_ptr, stride_hm, stride_bn, stride_br, R = lora_args
    h_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                         order=[1, 0])
    offs_hr = r0 + gl.arange(0, _RANK_CHUNK, layout=gl.SliceLayout(0, h_l))
    r_ok = offs_hr < R
    offs_ht = off_t + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, h_l))
    hv = gl.load(h_ptr + offs_ht[:, None].to(gl.int64) * stride_hm + offs_hr[None, :],
                 mask=(offs_ht < M)[:, None] & r_ok[None, :], other=0.0)
    rows_b = off_w + WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, h_l))
    bt = gl.load(b_ptr + rows_b[:, None].to(gl.int64) * stride_bn + offs_hr[None, :] * stride_br,
                 mask=r_ok[None, :], other=0.0).to(gl.bfloat16)
    return hv, bt


@gluon.jit
def _store_rank_chunk(x_ring, hv, bt, WG: gl.constexpr, COL: gl.constexpr):
    """A loaded chunk into columns COL:COL + 32 of ring slots 0 (h hi), 1 (h lo) and 2 (B), fenced for wgmma."""
    HALF: gl.constexpr = hv.type.shape[0]
    h_hi = hv.to(gl.bfloat16)
    hi32 = (h_hi.to(gl.uint16, bitcast=True).to(gl.uint32) << 16).to(gl.float32, bitcast=True)   # exact, as K2
    x_ring.index(0).slice(COL, _RANK_CHUNK, dim=1).slice(WG * HALF, HALF).store(h_hi)
    x_ring.index(1).slice(COL, _RANK_CHUNK, dim=1).slice(WG * HALF, HALF).store((hv - hi32).to(gl.bfloat16))
    x_ring.index(2).slice(COL, _RANK_CHUNK, dim=1).slice(WG * 64, 64).store(bt)
    fence_async_shared()                           # generic-proxy stores -> wgmma (async proxy) reads


@gluon.jit
def _rank_chunk_mma(acc, x_ring, epi, WG: gl.constexpr, COL: gl.constexpr, PARITY: gl.constexpr):
    """Once both warpgroups stored the chunk in columns COL:+32 (epi's next phase, parity PARITY): K2's
    _lora_mma on it, B·h_hiᵀ then B·h_loᵀ, retired before returning (so the chunk after next may overwrite it)."""
    mbarrier.arrive(epi)
    mbarrier.wait(epi, PARITY)
    b_s = x_ring.index(2).slice(COL, _RANK_CHUNK, dim=1).slice(WG * 64, 64)
    acc = warpgroup_mma(b_s, x_ring.index(0).slice(COL, _RANK_CHUNK, dim=1).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(b_s, x_ring.index(1).slice(COL, _RANK_CHUNK, dim=1).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))


@gluon.jit
def _lora_rank_chunks(acc, x_ring, epi, lora_args, off_t, off_w, M, WG: gl.constexpr):
    """acc += B·hᵀ above rank 64 in K2's rank chunks of 32 (gemm_triton._lora_rank_chunks: chunks in rank order,
    hi then lo each), alternating between columns 0:32 and 32:64 of ring slots 0-2; the next chunk's loads are
    in flight during this chunk's barrier and wgmmas. One epi phase per chunk: passing chunk c's phase means
    the other warpgroup retired chunk c-1's wgmmas, so chunk c+1 may overwrite the columns chunk c-1 used.
    Phase 0 (the main loop's end) is behind; chunk c completes phase c + 1."""
    R = lora_args[5]
    HALF: gl.constexpr = x_ring.type.shape[1] // 2
    hv, bt = _load_rank_chunk(lora_args, 0, off_t, off_w, M, HALF, WG)
    for r0 in range(0, R, 2 * _RANK_CHUNK):
        _store_rank_chunk(x_ring, hv, bt, WG, 0)
        hv, bt = _load_rank_chunk(lora_args, r0 + _RANK_CHUNK, off_t, off_w, M, HALF, WG)
        acc = _rank_chunk_mma(acc, x_ring, epi, WG, 0, 1)
        if r0 + _RANK_CHUNK < R:
            _store_rank_chunk(x_ring, hv, bt, WG, _RANK_CHUNK)
            hv, bt = _load_rank_chunk(lora_args, r0 + 2 * _RANK_CHUNK, off_t, off_w, M, HALF, WG)
            acc = _rank_chunk_mma(acc, x_ring, epi, WG, _RANK_CHUNK, 0)
    return acc


@gluon.jit
def _mma(rings, bars, offs, out_args, lora_args, WG: gl.constexpr, TRANS_Q: gl.constexpr,
         HAS_SCALE: gl.constexpr, HAS_LORA: gl.constexpr, HAS_G: gl.constexpr, HAS_BIAS: gl.constexpr,
         BR: gl.constexpr):
    """Warpgroup WG: acc[64 weight rows, BM tokens] += widen(q rows) · x_stageᵀ over K; then the epilogue."""
    x_ring, q_ring = rings
    ready, consumed, epi = bars
    off_t, off_w, k_tiles = offs
    y_ptr, sw_ptr, bias_ptr, g_ptr, stride_gn, M, N = out_args
    S: gl.constexpr = x_ring.type.shape[0]
    BMc: gl.constexpr = x_ring.type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BMc, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=layout, k_width=2)

    # ---- main loop (module docstring: two steps per iteration, the first two peeled; K % 2·BK == 0)
    a0 = _operand(q_ring, ready, 0, a_layout, WG, TRANS_Q)
    acc = warpgroup_mma(a0, x_ring.index(0).permute((1, 0)), gl.zeros([64, BMc], gl.float32, layout),
                        use_acc=False, is_async=True)
    a1 = _operand(q_ring, ready, 1, a_layout, WG, TRANS_Q)
    acc = warpgroup_mma(a1, x_ring.index(1 % S).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))          # step 0 retired
    a0 = _keep(a0)
    mbarrier.arrive(consumed.index(0))
    for i in range(2, k_tiles, 2):
        a0 = _operand(q_ring, ready, i, a_layout, WG, TRANS_Q)
        acc = warpgroup_mma(a0, x_ring.index(i % S).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))      # step i-1 retired
        a1 = _keep(a1)
        mbarrier.arrive(consumed.index((i - 1) % S))
        a1 = _operand(q_ring, ready, i + 1, a_layout, WG, TRANS_Q)
        acc = warpgroup_mma(a1, x_ring.index((i + 1) % S).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))      # step i retired
        a0 = _keep(a0)
        mbarrier.arrive(consumed.index(i % S))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

    # ---- epilogue (same operations in the same order as gemm_triton's kernel: identical bits)
    rows = off_w + WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))      # output columns [64]
    if HAS_SCALE:
        acc = acc * gl.load(sw_ptr + rows)[:, None]
    if HAS_LORA:
        h_ptr, b_ptr, stride_hm, stride_bn, stride_br, R = lora_args
        # phase 0: both warpgroups retired every wgmma, so the ring (all TMA writes landed) is free for h and B
        mbarrier.arrive(epi)
        mbarrier.wait(epi, 0)
        # slot 0 <- h_hi, slot 1 <- h_lo ([BM, BR] bf16, this warpgroup writes half of the tokens, 32 at a time:
        # the accumulator stays live meanwhile), slot 2 rows WG*64:+64 <- this warpgroup's B tile [64, BR].
        # Both LoRA operands come from shared memory: a register-sourced B tile here makes ptxas serialize
        # every wgmma of the kernel (C7512, insufficient registers).
        if BR <= _RANK_CHUNK_FROM:
            HALF: gl.constexpr = BMc // 2
            PIECE: gl.constexpr = 32
            h_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[2, 16],
                                                 warps_per_cta=[4, 1], order=[1, 0])
            offs_hr = gl.arange(0, BR, layout=gl.SliceLayout(0, h_l))
            for p in gl.static_range(HALF // PIECE):
                offs_ht = off_t + WG * HALF + p * PIECE + gl.arange(0, PIECE, layout=gl.SliceLayout(1, h_l))
                ok = (offs_ht < M)[:, None] & (offs_hr < R)[None, :]
                hv = gl.load(h_ptr + offs_ht[:, None].to(gl.int64) * stride_hm + offs_hr[None, :], mask=ok, other=0.0)
                h_hi = hv.to(gl.bfloat16)
                # bf16 -> fp32 as a 16-bit shift (exact), as gemm_triton._lora_mma does
                hi32 = (h_hi.to(gl.uint16, bitcast=True).to(gl.uint32) << 16).to(gl.float32, bitcast=True)
                x_ring.index(0).slice(0, BR, dim=1).slice(WG * HALF + p * PIECE, PIECE).store(h_hi)
                x_ring.index(1).slice(0, BR, dim=1).slice(WG * HALF + p * PIECE, PIECE).store(
                    (hv - hi32).to(gl.bfloat16))
            rows_b = off_w + WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, h_l))
            bt = gl.load(b_ptr + rows_b[:, None].to(gl.int64) * stride_bn + offs_hr[None, :] * stride_br,
                         mask=(offs_hr < R)[None, :], other=0.0).to(gl.bfloat16)             # [64, BR]
            b_s = x_ring.index(2).slice(0, BR, dim=1).slice(WG * 64, 64)
            b_s.store(bt)
            fence_async_shared()                       # generic-proxy stores -> wgmma (async proxy) reads
            mbarrier.arrive(epi)                       # phase 1: both halves of h written
            mbarrier.wait(epi, 1)
            # K2's order: B · h_hiᵀ (k16 steps in rank order), then B · h_loᵀ
            acc = warpgroup_mma(b_s, x_ring.index(0).slice(0, BR, dim=1).permute((1, 0)), acc)
            acc = warpgroup_mma(b_s, x_ring.index(1).slice(0, BR, dim=1).permute((1, 0)), acc)
        else:
            acc = _lora_rank_chunks(acc, x_ring, epi, lora_args, off_t, off_w, M, WG)
        if HAS_G:
            # DoRA: after the whole h·Bᵀ, before the bias, as K2's ALL_SLOT0 branch, and through a select as there
            # (so the compiler treats the multiply and the bias add alike in both kernels: identical bits). The
            # token mask of K2's select is left out (tokens past M are not stored; its per-token predicates spilled)
            col_ok = rows < N
            gv = gl.load(g_ptr + rows * stride_gn, mask=col_ok, other=1.0)
            acc = gl.where(col_ok[:, None], acc * gv[:, None], acc)
    if HAS_BIAS:
        acc = acc + gl.load(bias_ptr + rows).to(gl.float32)[:, None]
    # through shared memory into 8 consecutive output columns per thread (16-byte stores)
    out_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[8, 4], warps_per_cta=[1, 4],
                                           order=[0, 1])
    y = gl.convert_layout(acc.to(y_ptr.dtype.element_ty), out_l)
    offs_c = off_w + WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, out_l))
    offs_t = off_t + gl.arange(0, BMc, layout=gl.SliceLayout(0, out_l))
    gl.store(y_ptr + offs_t[None, :].to(gl.int64) * N + offs_c[:, None], y, mask=(offs_t < M)[None, :])


@gluon.jit
def _lora_gemm_rs_kernel(x_desc, q_desc, y_ptr, sw_ptr, bias_ptr, h_ptr, b_ptr, g_ptr, M, N, K, R,
                         stride_hm, stride_bn, stride_br, stride_gn,
                         TRANS_Q: gl.constexpr, HAS_SCALE: gl.constexpr, HAS_LORA: gl.constexpr,
                         HAS_G: gl.constexpr, HAS_BIAS: gl.constexpr, BR: gl.constexpr, STAGES: gl.constexpr,
                         GROUP_M: gl.constexpr, MMA_REGS: gl.constexpr):
    BMc: gl.constexpr = x_desc.block_type.shape[0]
    BKc: gl.constexpr = x_desc.block_type.shape[1]
    if TRANS_Q:
        BNc: gl.constexpr = q_desc.block_type.shape[1]
    else:
        BNc: gl.constexpr = q_desc.block_type.shape[0]
    gl.static_assert(BNc == 128, "two MMA warpgroups of 64 weight rows")
    off_t, off_w = _tile_offsets(M, N, BMc, BNc, GROUP_M)
    k_tiles = K // BKc
    x_ring = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BMc, BKc], x_desc.layout)
    q_ring = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    consumed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    epi = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(consumed.index(i), count=2)                       # both MMA warpgroups
    mbarrier.init(epi, count=2)
    fence_async_shared()
    rings = (x_ring, q_ring)
    offs = (off_t, off_w, k_tiles)
    out_args = (y_ptr, sw_ptr, bias_ptr, g_ptr, stride_gn, M, N)
    lora_args = (h_ptr, b_ptr, stride_hm, stride_bn, stride_br, R)
    mma_bars = (ready, consumed, epi)
    gl.warp_specialize([
        (_mma, (rings, mma_bars, offs, out_args, lora_args, 0, TRANS_Q, HAS_SCALE, HAS_LORA, HAS_G, HAS_BIAS,
                  BR)),
        (_mma, (rings, mma_bars, offs, out_args, lora_args, 1, TRANS_Q, HAS_SCALE, HAS_LORA, HAS_G, HAS_BIAS,
                  BR)),
        (_loader, ((x_desc, q_desc), rings, (ready, consumed), offs, TRANS_Q)),
    ], [4, 1], [MMA_REGS, _LOAD_REGS])


def launch_args(x: torch.Tensor, q: torch.Tensor, w_scale, h=None, B=None, bias=None, out=None, g=None):
    """(kernel, grid, args, kwargs) of one launch (CPU tensors work too: the descriptors only record).
    x [M, K] bf16; q [N, K] e4m3 row-major, or the transposed view of stored codes [K, N] (dx GEMM);
    w_scale [N] fp32 or None; h [1, M, r] fp32 and B [1, N, r] (any strides) or None; bias [N] or None;
    g [1, N] fp32 (DoRA's column scale, with h and B) or None."""
    M, K = x.shape
    N = q.shape[0]
    trans = q.stride(1) != 1
    x_desc = TensorDescriptor.from_tensor(x, [BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16))
    q_block = [BK, BN] if trans else [BN, BK]
    q_desc = TensorDescriptor.from_tensor(q.t() if trans else q, q_block,       # q.t(): the stored codes [K, N]
                                          gl.NVMMASharedLayout.get_default_for(q_block, gl.float8e4nv))
    if h is not None:
        h2, b2 = h[0], B[0]                                                     # [M, r], [N, r]
        if h2.stride(1) != 1:
            h2 = h2.contiguous()
        r = b2.shape[1]
        lora = (h2, b2, r, h2.stride(0), b2.stride(0), b2.stride(1))
    else:
        r = 0
        lora = (out, out, 0, 0, 0, 0)                                           # unused pointers
    has_g = g is not None and h is not None
    args = (x_desc, q_desc, out, out if w_scale is None else w_scale, out if bias is None else bias,
            lora[0], lora[1], g[0] if has_g else out, M, N, K, *lora[2:], g.stride(1) if has_g else 0)
    kwargs = dict(TRANS_Q=trans, HAS_SCALE=w_scale is not None, HAS_LORA=h is not None, HAS_G=has_g,
                  HAS_BIAS=bias is not None,
                  BR=block_r(r), STAGES=STAGES, GROUP_M=GROUP_M,
                  MMA_REGS=MMA_REGS if block_r(r) <= RANK_CHUNK_FROM else MMA_REGS_CHUNKED, num_warps=4,
                  maxnreg=LAUNCH_REGS)
    grid = (cdiv(M, BM) * (N // BN),)
    return _lora_gemm_rs_kernel, grid, args, kwargs


def lora_gemm_rs(x, q, w_scale, h=None, B=None, bias=None, out=None, g=None) -> torch.Tensor:
    """Run the kernel (the caller checked `supported`); returns out [M, N] (x.dtype)."""
    if out is None:
        out = torch.empty((x.shape[0], q.shape[0]), dtype=x.dtype, device=x.device)
    kernel, grid, args, kwargs = launch_args(x, q, w_scale, h, B, bias, out, g)
    launch(kernel, grid, *args, **kwargs)
    return out
