#!/usr/bin/env python
"""Exploration: a Hopper (sm_90a) W8A16 GEMM written in Gluon (triton.experimental.gluon, Triton 3.6),
    y[M, N] (bf16) = (x[M, K] bf16 · widen(q[N, K] e4m3)ᵀ) · s_w[N]      (fp32 accumulation, one rounding)
to test whether warp specialization closes the gap of our plain-Triton W8A16 kernel (K2,
rlfp8/kernels/gemm_triton.py) to cuBLAS bf16 at prefill/training sizes (1.28-1.45x cuBLAS at M = 8192). There,
Triton widens the weight tile into wgmma's register-A operand with 1-2 byte LDS and a CTA-wide BAR.SYNC every
k-step, so widening and MMA do not overlap.

Design (tokens on wgmma's M side, acc[BM, BN] fp32 in registers, one output tile per program, grouped order):
  * "ws" variants (warp-specialized, as CUTLASS's mixed-input kernels), partitions:
      - x loader (1 warp): TMA x[off_m:+BM, k:+BK] bf16 into an S-stage ring;
      - q loader (1 warp): TMA q[off_n:+BN, k:+BK] e4m3 into its own S-stage ring, so the weight ring can run
        ahead of the x ring (the widening consumes it a step before the MMA does);
      - widening partition (4 warps): 16-byte LDS of the e4m3 stage in a blocked layout, exact e4m3 -> bf16
        (PRMT trick of widen._e4m3x4_to_bf16: no F2F), 16-byte STS into a W-stage bf16 ring with the
        NVMMA (128B-swizzled) layout wgmma reads B from, fence_async_shared, one arrive on "widened";
      - MMA partition (the default one, 4 or 8 warps = 1 or 2 warpgroups): waits x_ready + widened, issues
        async wgmma (A = x stage, B = widened stage permuted to [BK, BN], both from shared memory), keeps one
        wgmma in flight (warpgroup_mma_wait(1)), then arrives "consumed" for the previous k-step; epilogue
        acc · s_w[n] -> bf16, masked store from the wgmma accumulator layout.
  * "nows" variant (no warp specialization, the simpler baseline in the same dialect): all 8 warps widen and
    MMA; TMA ring of S stages (x and q on one mbarrier) S-1 steps ahead, widened ring of 3 stages. Per k-step:
    issue wgmma i, widen step i+1 while it runs, wait(1), one CTA barrier (every warp's widened stores must
    land before any wgmma reads them), refill. Widening *after* the wait(1) instead makes ptxas serialize
    every wgmma (C7515, "non wgmma instructions defining accumulator registers"), checked in --compile-only.
Widening into shared memory costs shared-memory bandwidth (e4m3 read 1 B + bf16 write 2 B per weight element,
per token tile, on top of TMA writes and wgmma reads), so the tile shapes favour many tokens per weight tile
(BM = 256: a weight tile is widened once for 256 tokens) or a wide BN. The widened tile as wgmma's
register-A operand (CUTLASS's RS mainloop, with q pre-shuffled along K so each thread's fragment is 16
contiguous bytes) would avoid that round trip; not tried here.

mbarrier protocol of the ws kernel (four arrays of S barriers, count 1, indexed by k-step i % S: x_ready,
q_ready (TMA expect-tx), widened (widening -> MMA and q loader), consumed (MMA -> x loader and widening); Gluon's
mbarrier.arrive is one arrive by one elected thread of the partition, so multi-warp partitions first sync
their warps with gl.thread_barrier()):
  barrier s completes once per k-step s, s + S, s + 2S, ...; waiting for the event of step i is waiting for
  completion number i // S, parity (i // S) & 1. A producer reusing a slot waits for the event of step i - S
  (or i - W for the widened ring), i.e. parity ((i // S) & 1) ^ 1, which a fresh barrier (phase 0 in
  progress) reports complete at once: the first uses do not wait. Parity waits are unambiguous because no
  barrier can get two completions ahead of a waiter (needs STAGES >= W_STAGES, asserted); W_STAGES >= 2 since
  one wgmma stays in flight. No deadlock at the end: the MMA releases steps 0..k_tiles-2 (step i-1 at step i)
  and the producers need releases only up to step k_tiles-1-W <= k_tiles-2. --compile-only also runs a
  randomly interleaved Python model of the four partitions (simulate_ws_protocol) over several (S, W,
  k_tiles): no deadlock, no slot overwritten under a reader.
  Cross-proxy ordering: widened STS (generic proxy) -> fence_async_shared -> arrive widened -> wgmma (async
  proxy); e4m3 LDS -> the same fence -> arrive widened -> TMA overwrite of that slot (async proxy); wgmma
  reads retire at warpgroup_mma_wait before the consumed arrive.
  Known cost: Triton's shared-memory hazard analysis adds a partition barrier (BAR.SYNC) before most
  mbarrier ops (2 per k-step in the MMA and widening loops, see the SASS histogram); they only sync the
  warps of one partition, never the whole CTA.

Modes:
  --compile-only   compile every variant for sm_90a (GPUTarget("cuda", 90, 32)) on this machine, no GPU:
                   registers / spills (ptxas -v), shared memory, and a SASS opcode histogram of the main loops
                   (cuobjdump bundled with Triton); plus the CPU checks: reference, exact widening (PRMT
                   emulated for all 256 codes), the mbarrier protocol model. Gluon kernels do not run
                   under TRITON_INTERPRET (tried: "0 active drivers"), so numerics need the GPU run.
  (default)        on an H200: per variant and shape, max rel. error vs the fp32 torch reference (fails above
                   2e-2), median µs of --reps CUDA-graph replays with L2 flushed (bench.kernels.Timer), against
                   cuBLAS bf16 (F.linear on the pre-widened weight) and K2 (lora_gemm_triton, its tuned config).

    python bench/lab/explore_gluon_w8a16.py --compile-only
    python bench/lab/explore_gluon_w8a16.py --out bench/results/gluon_w8a16_h200.json      # ~1 min on an H200
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from rlfp8.kernels import gemm_rs  # noqa: E402
from rlfp8.kernels.gemm_rs import _tile_offsets  # noqa: E402  (grouped tile order, same as the package)
from rlfp8.kernels._triton_utils import compile_like_jit  # noqa: E402
from rlfp8.kernels.widen import E4M3X4_TO_BF16_PTX  # noqa: E402

SHAPES = ((8192, 6144, 4096), (8192, 4096, 4096), (8192, 4096, 12288), (8192, 24576, 4096))   # (M, N out, K in)


# ------------------------------------------------------------------------------------------------ variants
@dataclass(frozen=True)
class Variant:
    name: str
    ws: bool              # warp-specialized (loaders + widening partition) or all warps do everything
    BM: int               # tokens per tile (wgmma M side)
    BN: int               # weight rows per tile (wgmma N side)
    BK: int
    stages: int           # TMA ring depth (x and q rings each)
    w_stages: int         # widened bf16 ring depth
    num_warps: int        # MMA warps (the default partition when ws)
    mma_warps_n: int      # warpgroups side by side along N (1: the warpgroups split BM; 2: they split BN)
    widen_warps: int = 4
    widen_regs: int = 96
    maxnreg: int = 128    # ws: registers/thread at launch (the compiler redistributes them per partition)
    group_m: int = 8
    widened_chunk: int = 0   # weight rows per widening STS round (0: the whole BN tile in one store; smaller
    #                          chunks bound the bf16 registers but cost a partition barrier per chunk, see
    #                          _widen_stage)
    rs: bool = False      # rlfp8.kernels.gemm_rs (register-A mainloop; the other fields are documentation)
    trans_q: bool = False  # rs only: the backward's dx GEMM, dx[M, K] = gy[M, N] · q[N, K] (codes read transposed)


VARIANTS = [
    # 2 MMA warpgroups, each 128 tokens x 128 weight rows; the widened tile serves 256 tokens
    Variant("ws_m256n128", ws=True, BM=256, BN=128, BK=64, stages=4, w_stages=2, num_warps=8, mma_warps_n=1),
    # 2 MMA warpgroups side by side along N, each 128 x 128; 256 weight rows widened per tile
    Variant("ws_m128n256", ws=True, BM=128, BN=256, BK=64, stages=3, w_stages=2, num_warps=8, mma_warps_n=2,
            widen_regs=128),
    # 1 MMA warpgroup, 128 x 128 tile (the smallest footprint; most shared-memory traffic per FMA)
    Variant("ws_m128n128", ws=True, BM=128, BN=128, BK=64, stages=4, w_stages=2, num_warps=4, mma_warps_n=1),
    # no warp specialization: 8 warps widen step i+1 while wgmma i runs, one CTA barrier per k-step
    Variant("nows_m256n128", ws=False, BM=256, BN=128, BK=64, stages=4, w_stages=3, num_warps=8, mma_warps_n=1),
    # register-A (CUTLASS's RS mainloop): rlfp8.kernels.lora_gemm_rs, the kernel K2 dispatches to at many
    # tokens (its tile, ring and epilogue are fixed there; the sweep that chose them is in
    # bench/results/explore_gluon_rs_h200.json, made by this script's rs_* variants at commit 2275170)
    Variant("rs", ws=True, rs=True, BM=256, BN=128, BK=64, stages=4, w_stages=0, num_warps=4, mma_warps_n=1),
    Variant("rsT", ws=True, rs=True, trans_q=True, BM=256, BN=128, BK=64, stages=4, w_stages=0, num_warps=4,
            mma_warps_n=1),
]


# ------------------------------------------------------------------------------------------------ kernels
@gluon.jit
def _e4m3x4_to_bf16(codes):
    """Exact e4m3 -> bf16 (inline PTX, GPU code only), four codes per 32-bit register: the PRMT trick of
    rlfp8.kernels.widen._e4m3x4_to_bf16 (see its docstring; bit-identical to a conversion for all 254
    finite codes; the NaN codes 0x7f/0xff come out as +-480, the quantizer never produces them)."""
    return gl.inline_asm_elementwise(
        asm=E4M3X4_TO_BF16_PTX,
        constraints="=r,=r,r", args=[codes.to(gl.uint8, bitcast=True)], dtype=gl.bfloat16, is_pure=True, pack=4)


@gluon.constexpr_function
def _mma_layout(BM, BN, num_warps, mma_warps_n):
    # wgmma accumulator layout: warpgroups ([4, 1] warp atom) stacked along M, or 2 side by side along N;
    # instruction N = the warpgroup's column count (<= 256)
    warps = [num_warps // mma_warps_n, mma_warps_n]
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, BN // mma_warps_n, 16])


@gluon.constexpr_function
def _widen_layout(BK, num_warps):
    # 16 consecutive e4m3 codes (16 bytes) per thread along K, BK // 16 threads per row
    tk = BK // 16
    return gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[32 // tk, tk], warps_per_cta=[num_warps, 1],
                            order=[1, 0])


@gluon.jit
def _widen_stage(q_stage, w_stage, BN: gl.constexpr, BK: gl.constexpr, CHUNK: gl.constexpr, num_warps: gl.constexpr):
    """q_stage [BN, BK] e4m3 (smem, NVMMA 64B swizzle) -> w_stage [BN, BK] bf16 (smem, NVMMA 128B swizzle):
    16-byte LDS, PRMT widening, 2 x 16-byte STS per thread and 16 codes. All LDS first, then widen + STS
    CHUNK rows at a time (bounds the bf16 registers): the compiler's shared-memory hazard analysis cannot tell
    the two rings apart inside a partition and would put a barrier between every STS chunk and a later LDS."""
    layout: gl.constexpr = _widen_layout(BK, num_warps)
    codes = ()
    for c in gl.static_range(BN // CHUNK):
        codes = codes + (q_stage.slice(c * CHUNK, CHUNK).load(layout), )       # [CHUNK, BK] e4m3
    for c in gl.static_range(BN // CHUNK):
        w_stage.slice(c * CHUNK, CHUNK).store(_e4m3x4_to_bf16(codes[c]))       # [CHUNK, BK] bf16


@gluon.jit
def _store_tile(acc, y_ptr, sw_ptr, off_m, off_n, M, N, layout: gl.constexpr,
                BM: gl.constexpr, BN: gl.constexpr):
    # y[off_m:+BM, off_n:+BN] = bf16(acc · s_w[n]), straight from the wgmma accumulator layout
    offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    sw = gl.load(sw_ptr + offs_n, mask=offs_n < N, other=0.0)
    y = (acc * sw[None, :]).to(gl.bfloat16)
    ptrs = y_ptr + offs_m[:, None].to(gl.int64) * N + offs_n[None, :]
    gl.store(ptrs, y, mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


# ---- warp-specialized kernel: partitions ----
# Barriers (arrays of S = STAGES, indexed by k-step i % S, count 1 each; module docstring for the parities):
#   x_ready[s]  : TMA bytes of x step i landed              (x loader expect-tx -> MMA waits)
#   q_ready[s]  : TMA bytes of q step i landed              (q loader expect-tx -> widening waits)
#   widened[s]  : bf16 tile of step i stored and fenced     (widening arrives -> MMA waits, q loader waits:
#                 the e4m3 slot s is free again once step i is widened)
#   consumed[s] : wgmma of step i retired                   (MMA arrives -> x loader waits for slot s,
#                 widening waits for the widened slot (i % W) it is about to overwrite: step i - W's)
# One barrier per event (not per consumer) keeps one mbarrier arrive per partition and k-step. Waiting on
# widened / consumed by parity is unambiguous as long as STAGES >= W_STAGES: no barrier can complete a phase
# twice ahead of a waiter (e.g. consumed[(i - W) % S] completing step i - W + S needs widened step
# i - W + S >= i, which the waiting widening partition has not produced yet).
# Worker arguments (the same tuple for each; worker arguments cannot be tensors, scalars are fine):
#   descs = (x_desc, q_desc); rings = (x_ring, q_ring, w_ring); bars = (x_ready, q_ready, widened, consumed);
#   offs = (off_m, off_n, k_tiles)
@gluon.jit
def _tma_ring_producer(desc, ring, ready, free, row, k_tiles):
    # step i: wait until `free` saw step i - S (parity trick: none for i < S), then TMA tile (row, i·BK) into
    # slot i % S, completing `ready` by its byte count
    BK: gl.constexpr = desc.block_type.shape[1]
    S: gl.constexpr = ring.type.shape[0]
    for i in range(k_tiles):
        s = i % S
        mbarrier.wait(free.index(s), ((i // S) & 1) ^ 1)
        mbarrier.expect(ready.index(s), desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [row, i * BK], ready.index(s), ring.index(s))


@gluon.jit
def _ws_x_loader(descs, rings, bars, offs, CHUNK: gl.constexpr):
    x_ready, q_ready, widened, consumed = bars
    off_m, off_n, k_tiles = offs
    # an x slot is free once the wgmma of step i - S retired
    _tma_ring_producer(descs[0], rings[0], x_ready, consumed, off_m, k_tiles)


@gluon.jit
def _ws_q_loader(descs, rings, bars, offs, CHUNK: gl.constexpr):
    x_ready, q_ready, widened, consumed = bars
    off_m, off_n, k_tiles = offs
    # an e4m3 slot is free once step i - S was widened
    _tma_ring_producer(descs[1], rings[1], q_ready, widened, off_n, k_tiles)


@gluon.jit
def _ws_widen(descs, rings, bars, offs, CHUNK: gl.constexpr):
    x_desc, q_desc = descs
    x_ring, q_ring, w_ring = rings
    x_ready, q_ready, widened, consumed = bars
    off_m, off_n, k_tiles = offs
    BN: gl.constexpr = q_desc.block_type.shape[0]
    BK: gl.constexpr = q_desc.block_type.shape[1]
    S: gl.constexpr = q_ring.type.shape[0]
    W: gl.constexpr = w_ring.type.shape[0]
    for i in range(k_tiles):
        s = i % S
        mbarrier.wait(q_ready.index(s), (i // S) & 1)               # e4m3 tile of step i landed
        # widened slot i % W was last read by wgmma i - W: wait for consumed[(i - W) % S], completion number
        # (i - W) // S; for i < W the parity is 1 and a fresh barrier passes at once
        j = i - W + S
        mbarrier.wait(consumed.index(j % S), ((j // S) & 1) ^ 1)
        _widen_stage(q_ring.index(s), w_ring.index(i % W), BN, BK, CHUNK, gl.num_warps())
        fence_async_shared()        # my STS -> wgmma (async proxy); my LDS -> the next TMA write of slot s
        gl.thread_barrier()         # all widening warps stored and fenced before the single elected arrive
        mbarrier.arrive(widened.index(s))


@gluon.jit
def _ws_mma(rings, bars, offs, y_ptr, sw_ptr, M, N,
            BM: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr, MMA_WARPS_N: gl.constexpr):
    x_ring, q_ring, w_ring = rings
    x_ready, q_ready, widened, consumed = bars
    off_m, off_n, k_tiles = offs
    S: gl.constexpr = x_ring.type.shape[0]
    W: gl.constexpr = w_ring.type.shape[0]
    layout: gl.constexpr = _mma_layout(BM, BN, num_warps, MMA_WARPS_N)
    acc = gl.zeros([BM, BN], gl.float32, layout)
    for i in range(k_tiles):
        s = i % S
        mbarrier.wait(x_ready.index(s), (i // S) & 1)
        mbarrier.wait(widened.index(s), (i // S) & 1)
        # acc[BM, BN] += x_stage[BM, BK] · w_stage[BN, BK]ᵀ
        acc = warpgroup_mma(x_ring.index(s), w_ring.index(i % W).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))      # wgmma i-1 retired (this warpgroup)
        gl.thread_barrier()         # ... and in every MMA warpgroup, before the single elected arrive
        mbarrier.arrive(consumed.index((i + S - 1) % S), pred=i > 0)  # release step i - 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    _store_tile(acc, y_ptr, sw_ptr, off_m, off_n, M, N, layout, BM, BN)


@gluon.jit
def w8a16_ws_kernel(x_desc, q_desc, y_ptr, sw_ptr, M, N, K,
                    STAGES: gl.constexpr, W_STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                    MMA_WARPS_N: gl.constexpr, WIDEN_WARPS: gl.constexpr, WIDEN_REGS: gl.constexpr,
                    CHUNK: gl.constexpr, num_warps: gl.constexpr):
    gl.static_assert(STAGES >= W_STAGES, "parity waits on widened/consumed need STAGES >= W_STAGES")
    gl.static_assert(W_STAGES >= 2, "one wgmma stays in flight: widening step i needs step i-W retired")
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = q_desc.block_type.shape[0]
    off_m, off_n = _tile_offsets(M, N, BM, BN, GROUP_M)
    k_tiles = gl.cdiv(K, BK)

    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    x_ring = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)       # bf16
    q_ring = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BN, BK], q_desc.layout)       # e4m3
    w_ring = gl.allocate_shared_memory(gl.bfloat16, [W_STAGES, BN, BK], w_layout)           # widened
    x_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    widened = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    consumed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(x_ready.index(i), count=1)
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(widened.index(i), count=1)
        mbarrier.init(consumed.index(i), count=1)

    descs = (x_desc, q_desc)
    rings = (x_ring, q_ring, w_ring)
    bars = (x_ready, q_ready, widened, consumed)
    offs = (off_m, off_n, k_tiles)
    gl.warp_specialize([
        (_ws_mma, (rings, bars, offs, y_ptr, sw_ptr, M, N, BM, BN, num_warps, MMA_WARPS_N)),
        (_ws_widen, (descs, rings, bars, offs, CHUNK)),
        (_ws_x_loader, (descs, rings, bars, offs, CHUNK)),
        (_ws_q_loader, (descs, rings, bars, offs, CHUNK)),
    ], [WIDEN_WARPS, 1, 1], [WIDEN_REGS, 24, 24])


# ---- non-specialized kernel ----
@gluon.jit
def w8a16_pipelined_kernel(x_desc, q_desc, y_ptr, sw_ptr, M, N, K,
                           STAGES: gl.constexpr, W_STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                           MMA_WARPS_N: gl.constexpr, CHUNK: gl.constexpr, num_warps: gl.constexpr):
    # k-step i: issue wgmma i, widen step i+1 while it runs, wait(1) (wgmma i-1 retired), CTA barrier, refill
    # the TMA stage of step i-1 with step i-1+S. Step i+1 widens into slot (i+1) % 3, last read by wgmma i-2:
    # every warpgroup retired it at its wait(1) of step i-1, before the CTA barrier of step i-1 (with 2 slots,
    # the other warpgroup's wgmma i-1 could still be reading it).
    gl.static_assert(W_STAGES == 3, "three widened slots (see above)")
    gl.static_assert(STAGES >= 2, "S - 1 TMA steps in flight")
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = q_desc.block_type.shape[0]
    off_m, off_n = _tile_offsets(M, N, BM, BN, GROUP_M)
    k_tiles = gl.cdiv(K, BK)
    stage_bytes: gl.constexpr = x_desc.block_type.nbytes + q_desc.block_type.nbytes

    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    x_ring = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    q_ring = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BN, BK], q_desc.layout)
    w_ring = gl.allocate_shared_memory(gl.bfloat16, [W_STAGES, BN, BK], w_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())   # x + q bytes of a step
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)

    # prologue: steps 0 .. S-2 in flight, step 0 widened
    for i in gl.static_range(STAGES - 1):
        pred = i < k_tiles
        mbarrier.expect(ready.index(i), stage_bytes, pred=pred)
        tma.async_copy_global_to_shared(x_desc, [off_m, i * BK], ready.index(i), x_ring.index(i), pred=pred)
        tma.async_copy_global_to_shared(q_desc, [off_n, i * BK], ready.index(i), q_ring.index(i), pred=pred)
    mbarrier.wait(ready.index(0), 0)
    _widen_stage(q_ring.index(0), w_ring.index(0), BN, BK, CHUNK, num_warps)
    fence_async_shared()
    gl.thread_barrier()

    layout: gl.constexpr = _mma_layout(BM, BN, num_warps, MMA_WARPS_N)
    acc = gl.zeros([BM, BN], gl.float32, layout)
    for i in range(k_tiles):
        s = i % STAGES
        acc = warpgroup_mma(x_ring.index(s), w_ring.index(i % W_STAGES).permute((1, 0)), acc, is_async=True)
        nxt = i + 1
        if nxt < k_tiles:
            ns = nxt % STAGES
            mbarrier.wait(ready.index(ns), (nxt // STAGES) & 1)
            _widen_stage(q_ring.index(ns), w_ring.index(nxt % W_STAGES), BN, BK, CHUNK, num_warps)
            fence_async_shared()
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        gl.thread_barrier()     # widened step i+1 complete; wgmma i-1 retired in every warpgroup
        # load step i+S-1 into stage (i-1) % S: at i = 0 the stage the prologue left empty, later the stage of
        # step i-1 (x read by wgmma i-1, q widened at step i-2: both done, see the barrier above)
        ref = i + STAGES - 1
        rs = ref % STAGES
        pred = ref < k_tiles
        mbarrier.expect(ready.index(rs), stage_bytes, pred=pred)
        tma.async_copy_global_to_shared(x_desc, [off_m, ref * BK], ready.index(rs), x_ring.index(rs), pred=pred)
        tma.async_copy_global_to_shared(q_desc, [off_n, ref * BK], ready.index(rs), q_ring.index(rs), pred=pred)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    _store_tile(acc, y_ptr, sw_ptr, off_m, off_n, M, N, layout, BM, BN)


# ------------------------------------------------------------------------------------------------ host side
def make_args(v: Variant, x: torch.Tensor, q: torch.Tensor, s_w: torch.Tensor, y: torch.Tensor):
    """(kernel, grid, args, kwargs) of one launch; works on CPU tensors too (descriptors only record)."""
    M, K = x.shape
    N = q.shape[0]
    x_layout = gl.NVMMASharedLayout.get_default_for([v.BM, v.BK], gl.bfloat16)
    q_layout = gl.NVMMASharedLayout.get_default_for([v.BN, v.BK], gl.float8e4nv)
    x_desc = TensorDescriptor.from_tensor(x, [v.BM, v.BK], x_layout)
    q_desc = TensorDescriptor.from_tensor(q, [v.BN, v.BK], q_layout)
    if v.rs:
        # rsT: x is gy [M, N_red], q the stored codes [N_red, K_out] read transposed, y [M, K_out], no scale
        return gemm_rs.launch_args(x, q.t() if v.trans_q else q, None if v.trans_q else s_w, out=y)
    grid = (triton.cdiv(M, v.BM) * triton.cdiv(N, v.BN),)
    common = dict(STAGES=v.stages, W_STAGES=v.w_stages, GROUP_M=v.group_m, MMA_WARPS_N=v.mma_warps_n,
                  CHUNK=v.widened_chunk or v.BN, num_warps=v.num_warps)
    if v.ws:
        return (w8a16_ws_kernel, grid, (x_desc, q_desc, y, s_w, M, N, K),
                dict(common, WIDEN_WARPS=v.widen_warps, WIDEN_REGS=v.widen_regs, maxnreg=v.maxnreg))
    return w8a16_pipelined_kernel, grid, (x_desc, q_desc, y, s_w, M, N, K), common


def gluon_w8a16(v: Variant, x, q, s_w, y=None):
    y = torch.empty(x.shape[0], q.shape[0], dtype=torch.bfloat16, device=x.device) if y is None else y
    kernel, grid, args, kwargs = make_args(v, x, q, s_w, y)
    kernel[grid](*args, **kwargs)
    return y


def ref(x: torch.Tensor, q: torch.Tensor, s_w: torch.Tensor) -> torch.Tensor:
    """fp32 reference: y[M, N] = bf16((x · (q · s_w[:, None])ᵀ) in fp32)."""
    return (x.float() @ (q.float() * s_w.float()[:, None]).t()).to(torch.bfloat16)


def max_rel_err(y: torch.Tensor, y_ref: torch.Tensor) -> float:
    return ((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max().clamp_min(1e-30)).item()


def make_inputs(M, N, K, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, device=device, generator=g).to(torch.bfloat16)                   # [M, K]
    q = (torch.randn(N, K, device=device, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)  # [N, K]
    s_w = torch.rand(N, device=device, generator=g) * 1e-3 + 1e-4                           # [N] fp32
    return x, q, s_w


# ------------------------------------------------------------------------------------------------ compile-only
def compile_for(kernel, args, kwargs, target):
    """What kernel[grid](*args, **kwargs) would compile on `target`, without a GPU."""
    return compile_like_jit(kernel, args, kwargs, target)


def _nvidia_bin(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def ptxas_report(ptx: str) -> dict:
    """Registers / spills / smem as ptxas -v reports them (same flags as Triton's make_cubin)."""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([_nvidia_bin("ptxas"), "-lineinfo", "-v", "--gpu-name=sm_90a", str(src), "-o",
                            str(Path(d) / "k.cubin")], capture_output=True, text=True)
    log = r.stderr + r.stdout
    regs = re.findall(r"Used (\d+) registers", log)
    spill_st = re.findall(r"(\d+) bytes spill stores", log)
    spill_ld = re.findall(r"(\d+) bytes spill loads", log)
    stack = re.findall(r"(\d+) bytes stack frame", log)
    warnings = [ln.split("ptxas info    : ", 1)[-1][:160] for ln in log.splitlines() if "Performance" in ln]
    return dict(regs=int(regs[-1]) if regs else None, warnings=warnings,
                spill_stores=int(spill_st[-1]) if spill_st else None,
                spill_loads=int(spill_ld[-1]) if spill_ld else None, stack=int(stack[-1]) if stack else None,
                log=log.strip())


SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")


def sass_listing(cubin: bytes) -> list[tuple[int, str, str]]:
    """[(address, opcode, operands)] in program order (cuobjdump -sass of the cubin)."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.cubin"
        p.write_bytes(cubin)
        out = subprocess.run([_nvidia_bin("cuobjdump"), "-sass", str(p)], capture_output=True, text=True).stdout
    return [(int(m.group(1), 16), m.group(2), m.group(3).strip()) for m in map(SASS_LINE.search, out.splitlines())
            if m]


def main_loops(items) -> dict[str, list[str]]:
    """Opcodes of the innermost loop (backward branch) issuing wgmma and of the one widening (PRMT)."""
    loops = []
    for addr, op, operands in items:
        m = re.match(r"0x([0-9a-f]+)", operands)
        if op == "BRA" and m and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            loops.append([o for a, o, _ in items if start <= a <= addr])
    found = {}
    for name, prefix in (("mma", "HGMMA"), ("widen", "PRMT")):
        with_op = [lp for lp in loops if any(o.startswith(prefix) for o in lp)]
        if with_op:
            found[name] = min(with_op, key=len)
    return found


KEY_OPS = ("HGMMA", "WARPGROUP", "LDS", "STS", "PRMT", "HMUL2", "F2F", "F2FP", "LOP3", "SHF", "IMAD.SHL", "BAR",
           "SYNCS", "UTMALDG", "LDG", "STG", "STL", "LDL", "SETMAXNREG")


def histogram(opcodes: list[str]) -> dict:
    c = collections.Counter(opcodes)
    keep = {k: v for k, v in c.items() if any(k.startswith(p) for p in KEY_OPS)}
    top = dict(c.most_common(10))
    return dict(sorted({**top, **keep}.items(), key=lambda kv: -kv[1]))


def compile_only(variants, args) -> list[dict]:
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    M, N, K = SHAPES[0]
    # CPU tensors: the descriptors and pointers only feed the specialization (shapes, strides, 16-byte alignment)
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    s_w = torch.empty(N, dtype=torch.float32)
    rows = []
    for v in variants:
        t0 = time.time()
        x = torch.empty(M, N if v.trans_q else K, dtype=torch.bfloat16)
        y = torch.empty(M, K if v.trans_q else N, dtype=torch.bfloat16)
        try:
            kernel, grid, kargs, kwargs = make_args(v, x, q, s_w, y)
            ck = compile_for(kernel, kargs, kwargs, target)
            rep = ptxas_report(ck.asm["ptx"])
            items = sass_listing(ck.asm["cubin"])
            all_ops = [op for _, op, _ in items]
            row = dict(variant=v.name, ok=True, regs=rep["regs"], spill_stores=rep["spill_stores"],
                       spill_loads=rep["spill_loads"], ptxas_warnings=rep["warnings"], smem=ck.metadata.shared,
                       num_warps=ck.metadata.num_warps,
                       sass_total=len(all_ops), whole_kernel=histogram(all_ops),
                       main_loops={k: dict(length=len(lp), hist=histogram(lp)) for k, lp in main_loops(items).items()},
                       compile_s=round(time.time() - t0, 1), config=asdict(v))
            if args.dump:
                d = Path(args.dump) / v.name
                d.mkdir(parents=True, exist_ok=True)
                for key in ("ttgir", "ptx"):
                    (d / f"k.{key}").write_text(ck.asm[key])
                (d / "k.cubin").write_bytes(ck.asm["cubin"])
                (d / "ptxas.log").write_text(rep["log"])
        except Exception as e:  # one variant failing must not hide the others
            row = dict(variant=v.name, ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}", config=asdict(v))
        rows.append(row)
        print_compile_row(row)
    return rows


def print_compile_row(r: dict) -> None:
    if not r["ok"]:
        print(f"== {r['variant']}: COMPILE FAILED\n{r['error']}\n", flush=True)
        return
    print(f"== {r['variant']}: regs {r['regs']}  spills st/ld {r['spill_stores']}/{r['spill_loads']} B  "
          f"smem {r['smem']} B ({r['smem'] / 1024:.1f} KiB)  warps {r['num_warps']}  "
          f"SASS {r['sass_total']} instr  ({r['compile_s']} s)")
    for w in r["ptxas_warnings"]:
        print("   ptxas:", w)
    print("   whole kernel:", ", ".join(f"{k} {v}" for k, v in r["whole_kernel"].items()))
    for name, lp in r["main_loops"].items():
        print(f"   {name} loop ({lp['length']} instr):", ", ".join(f"{k} {v}" for k, v in lp["hist"].items()))
    print(flush=True)


def cpu_self_check() -> None:
    """What runs without a GPU: the reference's math, shapes and dtypes (Gluon kernels cannot be interpreted)."""
    x, q, s_w = make_inputs(64, 48, 96, "cpu")
    y = ref(x, q, s_w)
    assert y.shape == (64, 48) and y.dtype == torch.bfloat16
    # exactness of the widening the kernels rely on: every finite e4m3 code is a bf16 value
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = torch.isfinite(codes.float())
    assert torch.equal(codes.float()[finite], codes.to(torch.bfloat16).float()[finite])
    # emulation of the PRMT widening on every finite code, bit for bit (as tests/kernel/test_widen.py does)
    b = torch.arange(256, dtype=torch.int32)
    half = (b | torch.where(b >= 128, 0xFF00, 0)) & 0xFFFF          # prmt: code byte + replicated sign byte
    bits = ((half << 4) & 0x87F0).to(torch.int16)                 # shl 4, mask sign | eeeemmm << 4
    emulated = bits.view(torch.bfloat16).float() * 2.0 ** 120
    assert torch.equal(emulated[finite], codes.float()[finite]), "PRMT widening emulation mismatch"
    y2 = (x.float() @ q.to(torch.bfloat16).float().t() * s_w[None, :]).to(torch.bfloat16)
    err = max_rel_err(y2, y)
    assert err < 1e-2, err
    print(f"CPU self-check ok: reference shape/dtype, e4m3 -> bf16 exact, PRMT emulation exact on 254 finite "
          f"codes, scale-after-sum vs scale-before-sum max rel err {err:.1e}", flush=True)


# ------------------------------------------------------------------------------------------------ protocol check
class _SimBarrier:
    """An mbarrier with count 1: `completed` phases so far; try_wait.parity(p) passes iff completed % 2 != p."""

    def __init__(self):
        self.completed = 0

    def passes(self, parity: int) -> bool:
        return self.completed % 2 != parity


def simulate_ws_protocol(S: int, W: int, k_tiles: int, rng) -> None:
    """Randomly interleaved model of w8a16_ws_kernel's four partitions (same parity formulas, TMA and wgmma
    completing at random later times), asserting what each step reads is the right k-step's data and that no
    slot is overwritten while a reader may still use it. Raises on deadlock or hazard. CPU only; it checks the
    protocol, not the hardware or the compiler."""
    x_ready, q_ready, widened, consumed = ([_SimBarrier() for _ in range(S)] for _ in range(4))
    x_slot, q_slot, w_slot = [None] * S, [None] * S, [None] * W      # k-step whose data a slot holds
    inflight_tma = []                                                 # (ring, slot, step, barrier)
    wgmma_inflight = []                                               # k-steps issued and not retired

    def x_loader():
        for i in range(k_tiles):
            s = i % S
            yield consumed[s], ((i // S) & 1) ^ 1
            assert all(j % S != s for j in wgmma_inflight), f"x slot {s} overwritten under wgmma"
            x_slot[s] = "loading"
            inflight_tma.append((x_slot, s, i, x_ready[s]))

    def q_loader():
        for i in range(k_tiles):
            s = i % S
            yield widened[s], ((i // S) & 1) ^ 1
            assert q_slot[s] in (None, i - S), f"q slot {s} overwritten before step {i - S} was widened"
            q_slot[s] = "loading"
            inflight_tma.append((q_slot, s, i, q_ready[s]))

    def widen():
        for i in range(k_tiles):
            s = i % S
            yield q_ready[s], (i // S) & 1
            j = i - W + S
            yield consumed[j % S], ((j // S) & 1) ^ 1
            assert q_slot[s] == i, f"widening step {i} read q slot holding {q_slot[s]}"
            assert all(jj % W != i % W for jj in wgmma_inflight), f"w slot {i % W} overwritten under wgmma"
            assert w_slot[i % W] in (None, i - W), "w slot overwritten before its wgmma was issued"
            w_slot[i % W] = i
            widened[s].completed += 1

    def mma():
        for i in range(k_tiles):
            s = i % S
            yield x_ready[s], (i // S) & 1
            yield widened[s], (i // S) & 1
            assert x_slot[s] == i and w_slot[i % W] == i, f"wgmma {i} operands {x_slot[s]}, {w_slot[i % W]}"
            wgmma_inflight.append(i)
            yield "wgmma_wait", 1
            if i > 0:
                consumed[(i + S - 1) % S].completed += 1
        yield "wgmma_wait", 0

    actors = [x_loader(), q_loader(), widen(), mma()]
    blocked = [next(a) for a in actors]                    # each actor's current wait condition
    done = [False] * 4
    for _ in range(100000):
        runnable = []
        for n, cond in enumerate(blocked):
            if done[n]:
                continue
            if cond[0] == "wgmma_wait":
                runnable.append(n) if len(wgmma_inflight) <= cond[1] else None
            elif cond[0].passes(cond[1]):
                runnable.append(n)
        events = runnable + [("tma", t) for t in range(len(inflight_tma))] + (["retire"] if wgmma_inflight else [])
        if not events:
            if all(done):
                return
            raise AssertionError(f"deadlock: S={S} W={W} k_tiles={k_tiles}")
        ev = events[rng.randrange(len(events))]
        if ev == "retire":
            wgmma_inflight.pop(0)                          # the oldest wgmma completes
        elif isinstance(ev, tuple):
            ring, slot, step, bar = inflight_tma.pop(ev[1])
            ring[slot] = step
            bar.completed += 1                             # expect-tx arrive + all bytes landed
        else:
            try:
                blocked[ev] = next(actors[ev])
            except StopIteration:
                done[ev] = True
    raise AssertionError("simulation did not finish")


def check_ws_protocol() -> None:
    import random
    rng = random.Random(0)
    configs = sorted({(v.stages, v.w_stages) for v in VARIANTS if v.ws and not v.rs} | {(2, 2), (3, 3), (5, 2)})
    for S, W in configs:
        for k_tiles in (1, 2, 3, 5, 8, 13):
            for _ in range(40):
                simulate_ws_protocol(S, W, k_tiles, rng)
    # the model does catch a deadlock: one widened slot with one wgmma kept in flight (hence the static_assert)
    try:
        simulate_ws_protocol(4, 1, 2, rng)
        raise RuntimeError("protocol model missed the W_STAGES=1 deadlock")
    except AssertionError as e:
        assert "deadlock" in str(e), e
    print(f"mbarrier protocol model ok (warp-specialized kernel): (stages, w_stages) in {configs}, "
          f"k_tiles 1..13, 40 random interleavings each: no deadlock, no slot hazard "
          f"(and W_STAGES=1 deadlocks, as it must)", flush=True)


# ------------------------------------------------------------------------------------------------ GPU run
def run_with_watchdog(fn, seconds: float, on_timeout=None):
    """fn() then torch.cuda.synchronize(); a deadlocked mbarrier would hang forever, so give up after
    `seconds`: on_timeout() (save what we have), print, and exit the process hard (a hung kernel cannot be
    cancelled; every later launch would queue behind it)."""
    done = threading.Event()

    def watchdog():
        if not done.wait(seconds):
            if on_timeout is not None:
                on_timeout()
            print(f"WATCHDOG: no completion after {seconds} s (mbarrier deadlock?); exiting", flush=True)
            os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        out = fn()
        torch.cuda.synchronize()
        return out
    finally:
        done.set()


def gpu_main(variants, args) -> None:
    from bench.kernels import Timer
    from rlfp8.kernels.gemm_configs import gemm_config
    from rlfp8.kernels.gemm_triton import lora_gemm_triton

    def k2(x, q, s_w):
        # the Triton kernel with its tuned config (an explicit config bypasses the dispatch to lora_gemm_rs)
        cfg = gemm_config("w8a16", x.shape[0], q.shape[0], x.shape[1], "cuda", transposed=q.stride(1) != 1)
        return lora_gemm_triton(x, q, s_w, config=cfg)

    dev = "cuda"
    timer = Timer(args.reps)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                command=" ".join([Path(sys.executable).name] + sys.argv), reps=args.reps)
    rows, failed = [], set()
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out_path.write_text(json.dumps({**meta, "rows": rows}, indent=1))

    for M, N, K in SHAPES:
        t0 = time.time()
        x, q, s_w = make_inputs(M, N, K, dev)
        y_ref = ref(x, q, s_w)
        w16 = (q.float() * s_w[:, None]).to(torch.bfloat16)                # [N, K] cuBLAS baseline weight
        cublas_us = timer.graph_us(lambda: torch.nn.functional.linear(x, w16))
        try:
            ours_err = max_rel_err(k2(x, q, s_w), y_ref)
            ours_us = timer.graph_us(lambda: k2(x, q, s_w))
        except Exception as e:
            print(f"lora_gemm_triton failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            ours_err, ours_us = None, None
        print(f"\n[{M}x{N}x{K}] cuBLAS bf16 {cublas_us:8.1f} us | ours K2 (Triton) "
              f"{ours_us if ours_us is None else round(ours_us, 1)} us (err {ours_err})", flush=True)
        fwd = (x, y_ref, cublas_us, ours_us, ours_err)
        dx = None
        for v in variants:
            if v.trans_q and dx is None:
                # the backward's dx GEMM on the same codes: dx[M, K] = gy[M, N] · q[N, K] (no scale: it is in gy)
                gy = (torch.randn(M, N, device=dev) * 1e-2).to(torch.bfloat16)
                dx_ref = (gy.float() @ q.float()).to(torch.bfloat16)
                q16 = q.to(torch.bfloat16)
                dx_cublas = timer.graph_us(lambda: gy @ q16)
                try:
                    dx_err = max_rel_err(k2(gy, q.t(), None), dx_ref)
                    dx_ours = timer.graph_us(lambda: k2(gy, q.t(), None))
                except Exception as e:
                    print(f"lora_gemm_triton (dx) failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    dx_err, dx_ours = None, None
                print(f" dx [{M}x{K}x{N}] cuBLAS bf16 {dx_cublas:8.1f} us | ours K2 {dx_ours} us (err {dx_err})",
                      flush=True)
                dx = (gy, dx_ref, dx_cublas, dx_ours, dx_err)
            x_in, y_ref, cublas_us, ours_us, ours_err = dx if v.trans_q else fwd
            row = dict(variant=v.name, gemm="dx" if v.trans_q else "fwd", M=M, N=N, K=K,
                       cublas_us=round(cublas_us, 2),
                       ours_triton_us=None if ours_us is None else round(ours_us, 2), ours_triton_err=ours_err)
            if v.name in failed:
                rows.append(dict(row, error="failed on an earlier shape"))
                continue
            try:
                y = torch.empty(M, K if v.trans_q else N, dtype=torch.bfloat16, device=dev)
                # first launch (compiles) under the watchdog: a phase bug shows up as a hang here
                rows.append(dict(row, error=f"hung: no completion within {args.watchdog_s} s (watchdog)"))
                run_with_watchdog(lambda: gluon_w8a16(v, x_in, q, s_w, y), args.watchdog_s, on_timeout=save)
                rows.pop()                                                   # it did complete
                err = max_rel_err(y, y_ref)
                row["max_rel_err"] = err
                if not (err <= 2e-2):                                        # also catches NaN
                    raise RuntimeError(f"wrong result: max rel err {err}")
                if v.rs:
                    # same MMAs as K2's swap-AB loop (m64 x BM x k16 in k order, fp32 acc): same bits?
                    k2_y = k2(x_in, q.t(), None) if v.trans_q else k2(x_in, q, s_w)
                    row["bits_equal_k2"] = bool(torch.equal(y, k2_y))
                kernel, grid, kargs, kwargs = make_args(v, x_in, q, s_w, y)  # descriptors built outside the graph
                us = timer.graph_us(lambda: kernel[grid](*kargs, **kwargs))
                row.update(us=round(us, 2), ratio_vs_cublas=round(us / cublas_us, 3),
                           ratio_vs_ours_triton=None if ours_us is None else round(us / ours_us, 3))
                print(f"  {v.name:16s} {us:8.1f} us  {us / cublas_us:5.2f}x cuBLAS  err {err:.1e}", flush=True)
            except Exception as e:
                failed.add(v.name)
                row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                print(f"  {v.name:16s} FAILED {row['error'][:300]}", flush=True)
            rows.append(row)
            save()
        print(f"  ({time.time() - t0:.1f} s)", flush=True)
        x = q = w16 = y_ref = y = fwd = dx = gy = q16 = dx_ref = None      # free before the next shape
        torch.cuda.empty_cache()
    save()
    print(f"\n{'variant':16s} {'M':>5s} {'N':>6s} {'K':>6s} {'us':>8s} {'cuBLAS':>8s} {'K2':>8s} {'x cuBLAS':>8s} "
          f"{'err':>8s}")
    for r in rows:
        if "us" in r:
            print(f"{r['variant']:16s} {r['M']:5d} {r['N']:6d} {r['K']:6d} {r['us']:8.1f} {r['cublas_us']:8.1f} "
                  f"{r['ours_triton_us'] or float('nan'):8.1f} {r['ratio_vs_cublas']:8.3f} {r['max_rel_err']:8.1e}")
        else:
            print(f"{r['variant']:16s} {r['M']:5d} {r['N']:6d} {r['K']:6d}  {r.get('error', '')[:80]}")
    print(f"wrote {out_path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90a without a GPU and report")
    ap.add_argument("--variants", default="all", help=f"comma list of {[v.name for v in VARIANTS]} or 'all'")
    ap.add_argument("--out", default="/tmp/gluon_w8a16.json")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--watchdog-s", type=float, default=30.0, help="per-variant first-launch limit (s)")
    ap.add_argument("--dump", default=None, help="--compile-only: write ttgir/ptx/cubin per variant here")
    a = ap.parse_args(argv)
    names = [v.name for v in VARIANTS] if a.variants == "all" else a.variants.split(",")
    unknown = set(names) - {v.name for v in VARIANTS}
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}")
    variants = [v for v in VARIANTS if v.name in names]
    if a.compile_only:
        cpu_self_check()
        check_ws_protocol()
        rows = compile_only(variants, a)
        Path(a.out).write_text(json.dumps(dict(triton=triton.__version__, torch=torch.__version__,
                                               command=" ".join(sys.argv), target="cuda sm_90a", rows=rows),
                                          indent=1))
        print(f"wrote {a.out}")
        return
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --compile-only on a machine without a GPU")
    gpu_main(variants, a)


if __name__ == "__main__":
    main()
