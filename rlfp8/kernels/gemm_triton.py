"""K2: the FP8 base GEMM with every adapter's up-projection, DoRA scale and bias in its epilogue.

    y[t, n] = g[slot(t), n] · ( scale[t, n] · acc[t, n]  +  h[l(n), t] · B_l(n)[slot(t), n - off_l]ᵀ ) + bias[n]
    acc = x · qᵀ (fp32),  scale = s_x[t]·s_w[n] (W8A8: FP8 MMA on x_q)  or  s_w[n] (W8A16: the FP8 weight tile
    widened to x.dtype in registers, 16-bit MMA, fp32 accumulation). Rows with slot -1 get no LoRA and no g.

Shapes: x [T, K] (bf16/fp16, or e4m3 codes with x_scale [T, 1] for W8A8); q [N, K] e4m3, w_scale [N] fp32;
h [L, T, r] fp32 from K1 (lora_shrink); B: one tensor or L slice tensors [S, N_l, r] (vLLM's [S, 1, N_l, r]
accepted), Σ N_l = N, slice l covering output columns [off_l, off_l + N_l) of the concatenated weight (qkv,
gate_up: one GEMM over the row-concatenated weight, B per slice exactly as vLLM stores it), s already folded
into B; g [S, N] fp32 (DoRA); bias [N]; y [T, N] in out_dtype (default bf16), written once in token order,
rounded once.

Kernel strategy (Hopper):
  * W8A16 calls above 512 tokens without metadata (the trainer's forward and dx GEMMs, long prefills) go
    to lora_gemm_rs (Gluon, warp-specialized, the same MMAs and epilogue: bit-identical) when it supports
    them; dispatch records "lora_gemm.mainloop" = gluon_rs | triton. An explicit `config` keeps this kernel.
  * W8A16 swap_ab: each k-step's wgmmas retire before the next widening (SYNC_A): their register A operand is
    read asynchronously, and keeping them in flight let ptxas hand their registers to the next tile (garbage
    tiles on the H200, bench/lab/stress_determinism.py).
  * swap-AB: the program computes the transposed tile accᵀ [BLOCK_N, BLOCK_M] = W_tile · x_tileᵀ, so the
    weight rows fill the 64-row wgmma M side even for a handful of tokens (BLOCK_M = 16 at decode), and in
    W8A16 the widened weight tile is the register-sourced A operand of wgmma (no round trip through shared
    memory), x the shared-memory B operand (K-major, as wgmma wants for both bf16 and fp8). The widening
    avoids the F2F conversion pipe (_e4m3_to_bf16, GemmConfig.widen).
  * the other orientation (GemmConfig.swap_ab=False): acc [BLOCK_M, BLOCK_N] = x_tile · W_tileᵀ, tokens on
    the MMA's M side, the (widened) weight tile as the shared-memory B operand, transposed once before the
    epilogue. The weight tile then reaches registers 16 bytes per thread (the swap_ab register layout reads
    2 bytes per load), so the four-codes-per-register widening (_e4m3x4_to_bf16) needs no packing; below
    64 tokens Triton runs it on mma.sync. It can win W8A16 at decode sizes; with 64+ tokens Triton waits for
    each wgmma before refilling the widened tile, and swap_ab wins (bench/README.md).
    The tuner picks per (mode, bucket, K, N class); both orientations give the matched property, since the
    engine and the trainer take the same config for the same T.
  * split-K for small T: SPLIT_K programs share a tile; each writes its fp32 partial to a workspace and
    bumps the tile's counter. On the GPU, when SPLIT_K is 2/4/8 and leaves >= 16 tokens per program, every
    program waits for the count to complete and sums the partials in split order for its BLOCK_M // SPLIT_K
    tokens, then runs the epilogue on them (dispatch records "lora_gemm.split_k" = distributed); else (and
    in the interpreter, which runs programs one after another) the last program to arrive sums the whole
    tile (last_program; its counter reset afterwards), the sum unrolled while the partials fit in ~64
    registers per thread. Same additions per element either way: deterministic, identical bits, the
    epilogue sees the full sum before the single rounding. The distributed reduction exists because the
    tile's partials are then reloaded by SPLIT_K SMs instead of one (measured: bench/README.md).
  * rows: with metadata, a tile's rows come from vLLM's token_indices_sorted_by_lora_ids (adapter-sorted), so
    a tile touches few adapters; the epilogue loops over the distinct slots of its rows (ascending), each
    iteration one small dot B_slot_tile [BLOCK_N, r] · h_rowsᵀ [r, BLOCK_M] into the fp32 accumulator
    (by default two 16-bit MMAs on h = hi + lo, see LORA_PRECISIONS), reading only the tile's columns of B.
    Above rank 64 each slot's dot runs over rank chunks of 32 in rank order (gemm_configs.rank_chunk), so h and B
    never sit in registers / shared memory whole (at rank 384 they did: smaller tiles, spills).
    Three variants with the same arithmetic: no metadata (the trainer: one slot, no loop); one adapter
    (per-slot masked loads, fewest registers); more than one adapter (PIPE_SLOTS: h loaded once per slice,
    the next slot's B tile prefetched, so a tile with 16-32 slots waits for one memory round trip instead of
    two per slot).
  * decode (<= 16 tokens, knob k2_prefetch_epilogue): the epilogue's operands that K1 does not write (s_w, s_x,
    the rows' slots, the first slot's B tile at rank <= 64 without the slot pipeline) are loaded ahead of the
    epilogue, so their DRAM round trips do not follow the wait for h one after another: before the main loop
    (after any early PDL wait) and held in registers across it; right after it, before the split-K exchange and
    the wait (nothing held across the loop); or split (scales and slots before, the B tile after). Same values,
    same arithmetic: the same bits.
  * the wait point for h is explicit: with USE_PDL a `gdc_wait()` sits right before the epilogue reads h
    (before the main loop in W8A8 when its x_q also comes from K1: PDL_WAIT_EARLY), so K2 launched as K1's programmatic
    dependent (rlfp8.kernels.projection) overlaps K1 with its main loop. In W8A8 the first-wave programs
    only ask L2 for the first bytes of their weight rows before the wait (_prefetch_weight_rows). Nothing
    before the wait reads what K1 writes; gdc_wait returns once K1 has completed and flushed. The
    interpreter cannot run gdc_*, hence the constexpr guard.
  * quantize_x (W8A8 on 16-bit x; the engine's decode calls, knob k2_quant_x_tokens): every program first forms
    its tokens' scales over the whole row (amax pass over x, from L2), then quantizes each x tile in registers
    before the FP8 MMA, with fp8_triton's helpers (the same codes as fp8.quantize_activation, so the same bits
    as a quantizer kernel + K2). Meant to save the quantizer's launch at decode sizes (and under PDL K2 then
    needs nothing of K1 before its epilogue); off by default, since the H200 measured it slower (bench/README.md,
    session 16). Pointer x loads only (no TMA), no distributed split-K reduction (a program holds its whole
    tile's scales).
  * configs per token bucket (gemm_configs); a tuned table (rlfp8/kernels/tuned/<gpu>.json, written by
    bench/kernel_bench.py --tune) overrides the heuristics. Configs are keyed by (mode, token bucket, K, N class)
    where the N class only separates N <= 8192 from wider weights, so the q/k/v row views of a fused qkv
    (and o_proj) get the same split as the fused call: a row's result does not depend on the view.

Same (T, mode, K, N class) => same arithmetic order for a row, whatever else is in the batch: the matched
property (engine W8A16 call and trainer forward bit-identical on the same rows) rests on this. With the knob
batch_invariant (default auto: W8A16) the order does not depend on T either: one ReductionSchedule per
weight shape (gemm_configs.invariant_gemm_config), so vLLM's chunks of any size match the trainer's batch.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from . import dispatch
from ._triton_utils import (cdiv, check_pdl, check_tensor, device_sms, launch, max_shared_mem, programs_per_sm,
                            require_triton_device, split_counters)
from .gemm_configs import (GLUON_SCHEDULE, M_BUCKETS, NUM_SMS_HINT, SM90_MAX_SMEM, WIDENINGS, GemmConfig,
                           batch_invariant, block_r, cached_launch_config, config_source, fit_smem,
                           gemm_config_and_source, invariant_gemm_config, m_bucket, rank_chunk, same_sums, smem_bytes)
from .knobs import K2_PREFETCH_EPILOGUE, knobs
from .gemm_ref import check_lora_gemm_args
from .fp8_triton import ROUNDING_CODE, _quant_codes, _rows_scale
from .metadata import LoRAMeta
from .shrink_triton import ShrinkPrograms, _shrink_program
from .timeline import K1_END, K1_START, K2_END, K2_MAINLOOP_END, K2_START, K2_WAIT_ENTER, K2_WAIT_EXIT, stamp
from .widen import _e4m3_to_bf16, _e4m3x2_to_bf16, _e4m3x4_to_bf16, _keep

OP = "lora_gemm"
# How the epilogue multiplies h (fp32) by B (16-bit): "bf16x2" (default) splits h = hi + lo into two
# 16-bit values and runs two 16-bit MMAs (B is exact in 16 bits, so h·Bᵀ keeps ~2^-17 relative accuracy at
# a third of tf32x3's cost); "bf16" rounds h once (vLLM's expand does this); "tf32x3"/"tf32"/"ieee" are
# tl.dot's fp32 modes (ieee = FMA, exact fp32 products). The matched property needs engine and trainer to
# use the same mode: both take this default.
LORA_PRECISIONS = ("bf16x2", "bf16", "tf32x3", "tf32", "ieee")


@triton.jit
def _lora_mma(acc, bt, hT, LORA_PREC: tl.constexpr, LORA_DT: tl.constexpr):
    """acc [BN, BM] += B tile [BN, BR] · h [BR, BM] (fp32 h; see LORA_PRECISIONS for the 16-bit split)."""
    if LORA_PREC == "bf16x2" or LORA_PREC == "bf16":
        b16 = bt.to(LORA_DT)
        h_hi = hT.to(LORA_DT)
        acc = tl.dot(b16, h_hi, acc)
        if LORA_PREC == "bf16x2":
            if LORA_DT == tl.bfloat16:
                # bf16 -> fp32 as a 16-bit shift (exact; .to(tl.float32) costs one F2F per element on sm_90)
                hi32 = (h_hi.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            else:
                hi32 = h_hi.to(tl.float32)
            acc = tl.dot(b16, (hT - hi32).to(LORA_DT), acc)
    else:
        acc = tl.dot(bt.to(tl.float32), hT, acc, input_precision=LORA_PREC)
    return acc


# The epilogue's rank chunk, a function of BLOCK_R (so of the rank) alone: gemm_configs.rank_chunk
_rank_chunk = triton.constexpr_function(rank_chunk)


@triton.jit
def _lora_rank_chunks(acc, h_tile, b_tile, b_mask, row_sel, offs_r, R, stride_hr, stride_br, BR_CHUNK: tl.constexpr,
                      LORA_PREC: tl.constexpr, LORA_DT: tl.constexpr):
    """acc += B_slot[tile columns, :R] · h[:R, rows row_sel] above rank 64: the rank chunks in rank order, the same
    two 16-bit MMAs each. h_tile [BR_CHUNK, BM], b_tile [BN, BR_CHUNK] (the slot's) and b_mask (columns and
    ranks < R) are chunk 0's. Not software-pipelined: its staging buffers cost the registers the chunks save."""
    for r0 in tl.range(0, R, BR_CHUNK, num_stages=1):
        ok = (r0 + offs_r) < R
        hT = tl.load(h_tile + r0 * stride_hr, mask=row_sel[None, :] & ok[:, None], other=0.0)
        bt = tl.load(b_tile + r0 * stride_br, mask=b_mask & ok[None, :], other=0.0)
        acc = _lora_mma(acc, bt, hT, LORA_PREC, LORA_DT)
    return acc


@triton.jit
def _slot_g(acc, g_ptr, slot, stride_gs, offs_n, stride_gn, col_ok, sel):
    """DoRA: the columns of this slot's rows (sel) times g[slot] (after the slot's whole h·Bᵀ)."""
    gv = tl.load(g_ptr + slot.to(tl.int64) * stride_gs + offs_n * stride_gn, mask=col_ok, other=1.0)
    return tl.where(sel[None, :] & col_ok[:, None], acc * gv[:, None], acc)


@triton.jit
def _lora_slot_chunks_pipelined(acc, slots, h_tile, b_tile, stride_bs, offs_r, col_ok, R, stride_hr, stride_br,
                                g_ptr, stride_gs, offs_n, stride_gn, HAS_G: tl.constexpr, BR_CHUNK: tl.constexpr,
                                LORA_PREC: tl.constexpr, LORA_DT: tl.constexpr):
    """PIPE_SLOTS above rank 64: the (slot, rank chunk) pairs in the per-slot loop's order (slots ascending, the
    chunks of each in rank order, g after a slot's last chunk: the same MMAs, the same bits), each pair's h and
    B chunks loaded before the previous pair's MMAs, so a tile with many slots waits for one memory round trip
    per pair at most, not two. h_tile / b_tile: rank chunk 0's pointers (slot 0's B)."""
    cur = tl.min(tl.where(slots >= 0, slots, _BIG))
    r0 = cur * 0
    hT = tl.load(h_tile, mask=(slots == cur)[None, :] & (offs_r < R)[:, None], other=0.0)
    bt = tl.load(b_tile + tl.where(cur < _BIG, cur, 0).to(tl.int64) * stride_bs,
                 mask=col_ok[:, None] & (offs_r < R)[None, :] & (cur < _BIG), other=0.0)
    while cur < _BIG:
        last = r0 + BR_CHUNK >= R                       # this pair is the slot's last chunk
        nxt = tl.where(last, tl.min(tl.where(slots > cur, slots, _BIG)), cur)
        r_nxt = tl.where(last, 0, r0 + BR_CHUNK)
        r_ok = (r_nxt + offs_r) < R
        hT_next = tl.load(h_tile + r_nxt * stride_hr, mask=(slots == nxt)[None, :] & r_ok[:, None], other=0.0)
        bt_next = tl.load(b_tile + (r_nxt * stride_br + tl.where(nxt < _BIG, nxt, 0).to(tl.int64) * stride_bs),
                          mask=col_ok[:, None] & r_ok[None, :] & (nxt < _BIG), other=0.0)
        acc = _lora_mma(acc, bt, hT, LORA_PREC, LORA_DT)
        if HAS_G:
            if last:
                acc = _slot_g(acc, g_ptr, cur, stride_gs, offs_n, stride_gn, col_ok, slots == cur)
        hT = hT_next
        bt = bt_next
        cur = nxt
        r0 = r_nxt
    return acc


# W8A8 with PDL: bytes of each weight row (from the program's first k) asked into L2 before the early wait,
# while K1 runs. The first-wave programs of gate_up at decode hold ~400 x 64 rows: 1 KiB per row keeps that
# at ~25 MiB, about what HBM delivers during K1 (~5 us) and half the H200's L2.
_PDL_PREFETCH_ROW = tl.constexpr(1024)


@triton.jit
def _prefetch_weight_rows(w_ptr, n_ld, stride_wn, pid_k, K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """cp.async.bulk.prefetch.L2 of the first _PDL_PREFETCH_ROW bytes of this program's K range of each of its
    weight rows (the host checks 16-byte aligned rows and K, stride_wk = 1). Reads nothing K1 writes."""
    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = pid_k * k_per
    nbytes = tl.minimum(tl.minimum(K, k_lo + k_per) - k_lo, _PDL_PREFETCH_ROW)
    if nbytes > 0:
        rows = (w_ptr + n_ld.to(tl.int64) * stride_wn + k_lo).to(tl.int64, bitcast=True)
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;", "=r,l,r",
                                  [rows, tl.zeros_like(n_ld) + nbytes], dtype=tl.int32, is_pure=False, pack=1)


def _amax_chunk(block_m: int, block_k: int) -> int:
    """The columns per step of K2's amax pass: the whole tile at most 4096 fp32 values (32 registers per thread
    at 4 warps), at least 16."""
    return min(block_k, max(16, 4096 // block_m))


_amax_chunk_cx = triton.constexpr_function(_amax_chunk)


@triton.jit
def _rows_amax(x_ptr, rows64, m_ok, K, stride_xm, stride_xk, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """max |x| over each of the tile's token rows [BLOCK_M] (padding rows: 0), in chunks of _amax_chunk, the chunk
    loads software-pipelined (unpipelined, each chunk waited one L2 round trip before the next was asked for)."""
    CHUNK: tl.constexpr = _amax_chunk_cx(BLOCK_M, BLOCK_K)
    offs_k = tl.arange(0, CHUNK)
    x_rows = x_ptr + rows64[:, None] * stride_xm
    amax = tl.zeros((BLOCK_M, CHUNK), tl.float32)
    for k0 in tl.range(0, K, CHUNK, num_stages=4):
        v = tl.load(x_rows + (k0 + offs_k)[None, :] * stride_xk, mask=m_ok[:, None] & ((k0 + offs_k) < K)[None, :],
                    other=0.0)
        amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
    return tl.max(amax, axis=1)


@triton.jit
def _epilogue_row_operands(sw_ptr, sx_ptr, slot_ptr, n_ld, rows64, m_ok, SCALE_W: tl.constexpr, HAS_XS: tl.constexpr,
                           QUANT_X: tl.constexpr, HAS_LORA: tl.constexpr, ALL_SLOT0: tl.constexpr,
                           PREFETCH_ROWS: tl.constexpr):
    """PREFETCH_EPI's small operands: (s_w [BN], s_x [BM], the rows' slots [BM]), each the epilogue's own load, or 0
    where the epilogue does not take it from here."""
    sw = 0.0
    sx = 0.0
    slots = 0
    if SCALE_W == 1:
        sw = tl.load(sw_ptr + n_ld)
    if PREFETCH_ROWS:
        if HAS_XS:
            if not QUANT_X:
                sx = tl.load(sx_ptr + rows64)
        if HAS_LORA:
            if not ALL_SLOT0:
                slots = tl.load(slot_ptr + rows64, mask=m_ok, other=-1)
    return sw, sx, slots


@triton.jit
def _first_b_tile(b0_ptr, b1_ptr, b2_ptr, slots, offs_n, pid_n, N, R, end0, end1, stride_bs0, stride_bs1, stride_bs2,
                  stride_bn, stride_br, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, N_SLICES: tl.constexpr,
                  ALL_SLOT0: tl.constexpr):
    """PREFETCH_EPI's B tile: (the tile [BN, BR], the slice holding the tile's first column, the first slot). The
    elements the slice loop loads for that slice and the first slot (a tile straddling two slices loads the second
    one's in the loop). The slot's offset goes into the row pointer and its "none" into the column mask, so that no
    [BN, BR] pointer or mask is shared with the epilogue's (held across the main loop, it cost registers)."""
    tile_lo = pid_n * BLOCK_N
    first_slice = 0
    first_slot = 0
    if N_SLICES == 1:
        first_lo = 0
        first_hi = end0
        first_b = b0_ptr
        first_bs = stride_bs0
    else:
        first_slice = (tile_lo >= end0).to(tl.int32) + (tile_lo >= end1).to(tl.int32)   # (ends past L: N)
        first_lo = tl.where(first_slice == 0, 0, tl.where(first_slice == 1, end0, end1))
        first_hi = tl.where(first_slice == 0, end0, tl.where(first_slice == 1, end1, N))
        first_b = tl.where(first_slice == 0, b0_ptr, tl.where(first_slice == 1, b1_ptr, b2_ptr))
        first_bs = tl.where(first_slice == 0, stride_bs0, tl.where(first_slice == 1, stride_bs1, stride_bs2))
    offs_r = tl.arange(0, BLOCK_R)
    if ALL_SLOT0:
        first_row = first_b
        first_cols = (offs_n >= first_lo) & (offs_n < first_hi)
    else:
        # the while loop's first slot (none: the tile's rows have no adapter, nothing to load)
        first_slot = tl.min(tl.where(slots >= 0, slots, _BIG))
        first_row = first_b + tl.where(first_slot < _BIG, first_slot, 0).to(tl.int64) * first_bs
        first_cols = (offs_n >= first_lo) & (offs_n < first_hi) & (first_slot < _BIG)
    first_col = tl.where(first_cols, offs_n - first_lo, 0).to(tl.int64)
    bt_first = tl.load(first_row + first_col[:, None] * stride_bn + offs_r[None, :] * stride_br,
                       mask=first_cols[:, None] & (offs_r < R)[None, :], other=0.0)
    return bt_first, first_slice, first_slot


# calls of at most this many tokens (decode) load the epilogue's operands that K1 does not write ahead of the
# epilogue (knob k2_prefetch_epilogue: where)
PREFETCH_EPI_TOKENS = 16
PREFETCH_EPI_CODES = {place: code for code, place in enumerate(K2_PREFETCH_EPILOGUE)}   # the kernel's PREFETCH_EPI
_PIPE_SLOTS_OVERRIDE: bool | None = None     # tests only: force the multi-adapter epilogue variant on or off
_BIG = tl.constexpr(1 << 30)    # "no more slots" sentinel (kernels may only read constexpr globals)


# ----------------------------------------------------------------------------------------------------------
# kernel
@triton.jit
def _lora_gemm_kernel(
    w_ptr, x_ptr, y_ptr, sw_ptr, sx_ptr,          # w_ptr: pointer, or a TensorDescriptor when W_TMA
    wq_ptr,                                       # the codes' pointer (w_ptr's tensor): the L2 prefetch's rows
    h_ptr, b0_ptr, b1_ptr, b2_ptr, slot_ptr, perm_ptr, g_ptr, bias_ptr,
    part_ptr, cnt_ptr,
    k1_x_ptr, k1_a0_ptr, k1_a1_ptr, k1_a2_ptr, k1_ws_ptr, k1_cnt_ptr,     # K1's programs in this grid (K1_PROGRAMS)
    k1_sorted_ptr, k1_ntok_ptr, k1_start_ptr, k1_ids_ptr, k1_sync_ptr,
    k1_m_tiles, k1_programs, k1_consumers,
    k1_stride_xm, k1_stride_xk, k1_stride_as, k1_stride_ar, k1_stride_ak,
    M, N, K, R, end0, end1,
    stride_wn, stride_wk, stride_xm, stride_xk, stride_ym, stride_yn,
    stride_hl, stride_hm, stride_hr,
    stride_bs0, stride_bs1, stride_bs2,       # slot stride of each B slice ([S, N_l, r]: N_l differs)
    stride_bn, stride_br,                     # shared by every B slice
    stride_gs, stride_gn,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr, RED_UNROLL: tl.constexpr,
    DIST_RED: tl.constexpr,     # split-K: every program reduces BLOCK_M // SPLIT_K tokens (else the last one all)
    WIDEN_W: tl.constexpr,      # W8A16: widen the e4m3 tile to x's dtype in registers (else FP8 MMA)
    WIDEN_ASM: tl.constexpr,    # ... 1: _e4m3_to_bf16, 2: the PRMT widening (x4 / x2 by SWAP_AB; bf16 x, GPU code), 0: .to()
    SCALE_W: tl.constexpr,      # 0 none (the backward dx GEMM: the scale is in its x), 1 per output column
    HAS_XS: tl.constexpr,       # per-token activation scale (W8A8)
    HAS_LORA: tl.constexpr, N_SLICES: tl.constexpr, BLOCK_R: tl.constexpr,   # next_pow2(rank) >= 16
    ALL_SLOT0: tl.constexpr,    # no metadata: every row uses slot 0 (trainer)
    GATHER: tl.constexpr,       # tile rows through the adapter-sorted permutation
    HAS_G: tl.constexpr, HAS_BIAS: tl.constexpr, LORA_PREC: tl.constexpr, LORA_DT: tl.constexpr,
    PIPE_SLOTS: tl.constexpr,   # epilogue variant for many adapters (h loaded once, next B prefetched); same bits
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    USE_PDL: tl.constexpr,
    PDL_WAIT_EARLY: tl.constexpr,   # wait before the main loop (W8A8: x_q is K1's); 2 = L2 prefetch of weights first
    W_TMA: tl.constexpr,        # weight tiles through TMA: 1 = descriptor over q [N, K], block [BLOCK_N, BLOCK_K];
                                # 2 = q is a transposed view (the backward's qᵀ), the descriptor is over the
                                # stored codes [K, N] with block [BLOCK_K, BLOCK_N], transposed in shared memory
    SWAP_AB: tl.constexpr,      # True: accᵀ = W·xᵀ (weight rows on wgmma's M side); False: acc = x·Wᵀ
    X_TMA: tl.constexpr,        # x tiles through TMA (x_ptr is a descriptor over x [M, K], block [BLOCK_M, BLOCK_K])
    MASK_ROWS: tl.constexpr,    # pointer x loads masked by the token rows (decode tiles, M < BLOCK_M; knob
                                # k2_mask_x_rows)
    SYNC_A: tl.constexpr,       # W8A16 swap_ab: retire each k-step's wgmmas before the next widening (see there)
    FP8_ACC: tl.constexpr,      # W8A8: max_num_imprecise_acc for the FP8 wgmma (None = Triton's sm_90 default,
                                # fast accumulation as CUTLASS's FastAccum; an int promotes every FP8_ACC k)
    QUANT_X: tl.constexpr,      # W8A8 on 16-bit x: 0 = x is e4m3 codes + x_scale; 1 ("div") / 2 ("recip") = the
                                # program quantizes its x tiles per token itself (fp8_triton's arithmetic)
    PREFETCH_EPI: tl.constexpr, # decode (knob k2_prefetch_epilogue): the epilogue's operands that K1 does not write
                                # are loaded ahead: 1 before the main loop, 2 after it, 3 split (see there)
    K1_PROGRAMS: tl.constexpr,  # the grid's first k1_programs programs are K1's shrink (knob k1_in_k2): the GEMM's
                                # programs wait on K1's counter k1_sync_ptr[0] before the epilogue
    K1_BLOCK_M: tl.constexpr, K1_BLOCK_R: tl.constexpr, K1_BLOCK_K: tl.constexpr, K1_SPLIT_K: tl.constexpr,
    K1_EVEN_K: tl.constexpr, K1_RED_UNROLL: tl.constexpr, K1_BR_BLOCK: tl.constexpr, K1_MASK_ROWS: tl.constexpr,
    K1_STAGES: tl.constexpr,    # shrink_triton.ShrinkPrograms.consts: K1's own config, so its h bits
    K1_THREADS: tl.constexpr,   # the count past K1's wait (see there): 0 = a scalar atomic at once (W8A8); 32 x
                                # num_warps = one lane's atomic, its value read at the program's end (W8A16)
):
    pid = tl.program_id(0)
    if K1_PROGRAMS:
        # K1's programs come first: dispatched before the GEMM's (the order CUTLASS's serial split-K relies on),
        # they never wait, so the GEMM programs' wait on them below cannot deadlock
        if pid < k1_programs:
            stamp(pid >= 0, K1_START, False)
            _shrink_program(pid, pid >= 0, k1_x_ptr, k1_a0_ptr, k1_a1_ptr, k1_a2_ptr, h_ptr, k1_ws_ptr, k1_cnt_ptr,
                            k1_sorted_ptr, k1_ntok_ptr, k1_start_ptr, k1_ids_ptr, M, K, R, k1_m_tiles,
                            k1_stride_xm, k1_stride_xk, k1_stride_as, k1_stride_ar, k1_stride_ak,
                            stride_hl, stride_hm, stride_hr, K1_BLOCK_M, K1_BLOCK_R, K1_BLOCK_K, K1_SPLIT_K,
                            N_SLICES, ALL_SLOT0, K1_EVEN_K, K1_RED_UNROLL, K1_BR_BLOCK, K1_MASK_ROWS, K1_STAGES)
            # every K1 program counts itself once it is done (a tile's last one after storing its h)
            tl.debug_barrier()
            tl.atomic_add(k1_sync_ptr, 1, sem="release", scope="gpu")
            stamp(pid >= 0, K1_END, True)
            return
        pid = pid - k1_programs
    # ---- tile coordinates: split index fastest, then grouped (token tiles, weight tiles) order
    pid_k = pid % SPLIT_K
    tile = pid // SPLIT_K
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_size
    pid_n = (tile % per_group) // group_size
    stamp(pid >= 0, K2_START, False)                            # benchmark timeline only (no code by default)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)            # output columns [BN]
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)            # tile positions [BM]
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    if EVEN_N:
        n_ld = offs_n                                           # no mask: keeps loads unpredicated
    else:
        n_ld = tl.where(n_ok, offs_n, 0)
    if GATHER:
        rows = tl.load(perm_ptr + offs_m, mask=m_ok, other=0)   # token ids, adapter-sorted
    else:
        rows = tl.where(m_ok, offs_m, 0)
    rows64 = rows.to(tl.int64)
    if QUANT_X:
        # every program forms its tokens' scales over the whole row (the amax does not depend on the order)
        x_scale = _rows_scale(_rows_amax(x_ptr, rows64, m_ok, K, stride_xm, stride_xk, BLOCK_M, BLOCK_K))

    if USE_PDL:
        if PDL_WAIT_EARLY:
            # x_q / x_scale come from K1 (W8A8): only the weights may be touched before the wait
            if PDL_WAIT_EARLY == 2:
                _prefetch_weight_rows(wq_ptr, n_ld, stride_wn, pid % SPLIT_K, K, BLOCK_K, SPLIT_K)
            stamp(pid == 0, K2_WAIT_ENTER, False)
            tl.extra.cuda.gdc_wait()
            stamp(pid == 0, K2_WAIT_EXIT, False)

    # ---- PREFETCH_EPI: at decode sizes the main loop is short and the epilogue's DRAM round trips after it are a
    # large part of the program, so what K1 does not write is loaded ahead (after the early wait: sx may come from
    # the PDL primary): the same values the epilogue's own loads would give. sw always; sx and the rows' slots where
    # the epilogue keeps these rows (a distributed split-K sum recomputes them per program); the first slot's B tile
    # in the one-chunk epilogues (rank <= 64) without the slot pipeline. Where (knob k2_prefetch_epilogue): 1 all
    # before the main loop, held in registers across it; 2 all right after it, before the split-K exchange and the
    # wait for h (their round trips overlap those, nothing is held across the loop); 3 the scales and slots before,
    # the B tile after
    PREFETCH_ROWS: tl.constexpr = PREFETCH_EPI != 0 and not (SPLIT_K > 1 and DIST_RED)
    PREFETCH_B: tl.constexpr = (PREFETCH_EPI != 0 and HAS_LORA and _rank_chunk(BLOCK_R) == BLOCK_R
                                and (ALL_SLOT0 or (PREFETCH_ROWS and not PIPE_SLOTS)))
    if PREFETCH_EPI == 1 or PREFETCH_EPI == 3:
        sw, sx, slots = _epilogue_row_operands(sw_ptr, sx_ptr, slot_ptr, n_ld, rows64, m_ok, SCALE_W, HAS_XS,
                                               QUANT_X, HAS_LORA, ALL_SLOT0, PREFETCH_ROWS)
    if PREFETCH_B and PREFETCH_EPI == 1:
        bt_first, first_slice, first_slot = _first_b_tile(b0_ptr, b1_ptr, b2_ptr, slots, offs_n, pid_n, N, R, end0,
                                                          end1, stride_bs0, stride_bs1, stride_bs2, stride_bn,
                                                          stride_br, BLOCK_N, BLOCK_R, N_SLICES, ALL_SLOT0)

    # ---- main loop over this split's K range (whole BLOCK_K chunks)
    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = tl.multiple_of(pid_k * k_per, BLOCK_K)              # alignment hint: full-width vector loads
    k_hi = tl.minimum(K, k_lo + k_per)
    if not W_TMA:
        w_ptrs = w_ptr + n_ld.to(tl.int64)[:, None] * stride_wn + (k_lo + offs_k)[None, :] * stride_wk  # [BN, BK]
    if SWAP_AB:
        if not X_TMA:
            x_ptrs = x_ptr + rows64[None, :] * stride_xm + (k_lo + offs_k)[:, None] * stride_xk    # [BK, BM]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        if not X_TMA:
            x_ptrs = x_ptr + rows64[:, None] * stride_xm + (k_lo + offs_k)[None, :] * stride_xk    # [BM, BK]
        acc_mn = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if W_TMA == 1:
            w = w_ptr.load([pid_n * BLOCK_N, k])                  # out-of-range rows/cols read as 0
        elif W_TMA == 2:
            w = tl.trans(w_ptr.load([k, pid_n * BLOCK_N]))
        elif EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=((k + offs_k) < K)[None, :], other=0.0)
        if X_TMA:
            xt = x_ptr.load([pid_m * BLOCK_M, k])                 # [BM, BK], zero beyond M and K
            if SWAP_AB:
                xt = tl.trans(xt)
        elif MASK_ROWS:
            # a decode tile: its padding token rows load nothing (every program reads x, so re-reading a valid
            # row for them multiplied the requests to the same few L2 lines)
            if SWAP_AB:
                xt = tl.load(x_ptrs, mask=m_ok[None, :] & ((k + offs_k) < K)[:, None], other=0.0)
            else:
                xt = tl.load(x_ptrs, mask=m_ok[:, None] & ((k + offs_k) < K)[None, :], other=0.0)
        elif EVEN_K:
            xt = tl.load(x_ptrs)
        elif SWAP_AB:
            xt = tl.load(x_ptrs, mask=((k + offs_k) < K)[:, None], other=0.0)
        else:
            xt = tl.load(x_ptrs, mask=((k + offs_k) < K)[None, :], other=0.0)
        if QUANT_X:
            if SWAP_AB:
                xt = _quant_codes(xt.to(tl.float32), x_scale[None, :], QUANT_X)
            else:
                xt = _quant_codes(xt.to(tl.float32), x_scale[:, None], QUANT_X)
        if WIDEN_W:
            if WIDEN_ASM == 2:
                if SWAP_AB:
                    wv = _e4m3x2_to_bf16(w)                       # exact, no conversion instruction
                else:
                    wv = _e4m3x4_to_bf16(w)                       # ... four codes per 32-bit register
            elif WIDEN_ASM == 1:
                wv = _e4m3_to_bf16(w)                             # exact, no F2F (bf16 x only)
            else:
                wv = w.to(xt.dtype)                               # exact: e4m3 codes fit bf16/fp16
        else:
            wv = w                                                # e4m3 x e4m3 wgmma
        if SWAP_AB:
            acc = tl.dot(wv, xt, acc, max_num_imprecise_acc=None if WIDEN_W else FP8_ACC)
            if SYNC_A:
                # wgmma reads its register A operand (the widened tile) asynchronously. Waiting for this
                # k-step's wgmmas here (a use of acc) means the next widening never writes registers an
                # in-flight wgmma still reads. Without it Triton keeps 3-7 groups in flight across k-steps and
                # ptxas reuses their A registers: on the H200 the 8192-token config with a bias gave garbage
                # (rows of weights x all tokens of a tile) in up to 30 of 30 calls. Cost: nothing at <= 64
                # tokens, ~10% at 256, ~30% at 1024 (where lora_gemm_rs runs the calls without metadata).
                acc = _keep(acc)
        else:
            # tokens on wgmma's M side, the (widened) weight tile as the shared-memory B operand
            acc_mn = tl.dot(xt, tl.trans(wv), acc_mn, max_num_imprecise_acc=None if WIDEN_W else FP8_ACC)
        if not W_TMA:
            w_ptrs += BLOCK_K * stride_wk
        if not X_TMA:
            x_ptrs += BLOCK_K * stride_xk
    if not SWAP_AB:
        acc = tl.trans(acc_mn)                                    # [BN, BM]: the epilogue's orientation
    stamp(pid == 0, K2_MAINLOOP_END, True)
    if PREFETCH_EPI == 2:
        sw, sx, slots = _epilogue_row_operands(sw_ptr, sx_ptr, slot_ptr, n_ld, rows64, m_ok, SCALE_W, HAS_XS,
                                               QUANT_X, HAS_LORA, ALL_SLOT0, PREFETCH_ROWS)
    if PREFETCH_B and PREFETCH_EPI >= 2:
        bt_first, first_slice, first_slot = _first_b_tile(b0_ptr, b1_ptr, b2_ptr, slots, offs_n, pid_n, N, R, end0,
                                                          end1, stride_bs0, stride_bs1, stride_bs2, stride_bn,
                                                          stride_br, BLOCK_N, BLOCK_R, N_SLICES, ALL_SLOT0)

    # ---- split-K: the partials are added in split order, by the tile's last program (all its tokens) or,
    # DIST_RED, by every program for its BLOCK_M // SPLIT_K tokens
    if SPLIT_K > 1:
        Np = num_n * BLOCK_N
        part_stride = num_m * BLOCK_M * Np
        p_ptrs = part_ptr + offs_m.to(tl.int64)[None, :] * Np + offs_n[:, None]
        tl.store(p_ptrs + pid_k * part_stride, acc)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if DIST_RED:
            # wait until the tile's partials have landed: four reloads of a quarter in parallel instead of
            # one program reloading the whole tile. The counter only grows (SPLIT_K per launch, uint32
            # wrap-around; one buffer per power-of-2 SPLIT_K, so a launch starts at a multiple of it) and is
            # never reset. Waiting on the tile's other programs cannot deadlock: they are consecutive program
            # ids, dispatched in order, so at most one tile is partly resident at a time and every other
            # resident program finishes (CUTLASS's serial split-K relies on the same order).
            old = done.to(tl.uint32, bitcast=True)
            target = old - (old % SPLIT_K) + SPLIT_K                   # this launch's count for the tile
            behind = (old + 1 - target).to(tl.int32, bitcast=True) < 0
            while behind:
                cur = tl.atomic_add(cnt_ptr + tile, 0, sem="acquire", scope="gpu").to(tl.uint32, bitcast=True)
                behind = (cur - target).to(tl.int32, bitcast=True) < 0
            BQ: tl.constexpr = BLOCK_M // SPLIT_K
            offs_m = pid_m * BLOCK_M + pid_k * BQ + tl.arange(0, BQ)  # this program's tokens [BQ]
            m_ok = offs_m < M
            if GATHER:
                rows = tl.load(perm_ptr + offs_m, mask=m_ok, other=0)
            else:
                rows = tl.where(m_ok, offs_m, 0)
            rows64 = rows.to(tl.int64)
            p_ptrs = part_ptr + offs_m.to(tl.int64)[None, :] * Np + offs_n[:, None]
        elif done != SPLIT_K - 1:
            return
        acc = tl.load(p_ptrs, cache_modifier=".cg")
        if RED_UNROLL:
            # all partial loads in flight at once (one L2 round trip, not one per split); same additions in
            # the same order as the rolled loop
            for s in tl.static_range(1, SPLIT_K):
                acc += tl.load(p_ptrs + s * part_stride, cache_modifier=".cg")
        else:
            for s in range(1, SPLIT_K):
                acc += tl.load(p_ptrs + s * part_stride, cache_modifier=".cg")
        if not DIST_RED:
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")

    # ---- epilogue: scales, LoRA (per slice, per slot), DoRA g, bias, one rounding
    if HAS_XS:
        if QUANT_X:
            sx = x_scale                                        # the whole tile's tokens (no DIST_RED)
        elif not PREFETCH_ROWS:
            sx = tl.load(sx_ptr + rows64)
    if SCALE_W == 1:
        if not PREFETCH_EPI:
            sw = tl.load(sw_ptr + n_ld)
        if HAS_XS:
            acc = acc * (sw[:, None] * sx[None, :])
        else:
            acc = acc * sw[:, None]
    elif HAS_XS:
        acc = acc * sx[None, :]

    if K1_PROGRAMS:
        # h comes from this grid's K1 programs: wait until all have counted themselves (acquire: their h is then
        # visible); the last of the k1_consumers programs that get past it resets both counters for the next
        # launch. K1_THREADS > 0: the count past the wait is one lane's atomic (a tensor with one element per
        # thread, the others masked), whose old value stays in that lane's register and is read only after the
        # output is stored, the reset then at the program's end: its L2 round trip overlaps the epilogue (a scalar
        # atomic's value is broadcast through shared memory at once, a round trip between the wait and the loads
        # of h). The H100 measured the late count faster for W8A16 and slower for W8A8 (bench/README.md session 23)
        stamp(pid == 0, K2_WAIT_ENTER, False)
        k1_done = tl.atomic_add(k1_sync_ptr, 0, sem="acquire", scope="gpu")
        while k1_done < k1_programs:
            k1_done = tl.atomic_add(k1_sync_ptr, 0, sem="acquire", scope="gpu")
        stamp(pid == 0, K2_WAIT_EXIT, False)
        if K1_THREADS:
            lane = tl.arange(0, K1_THREADS)
            passed = tl.atomic_add(k1_sync_ptr + 1 + lane, 1, mask=lane == 0, sem="relaxed", scope="gpu")
        elif tl.atomic_add(k1_sync_ptr + 1, 1, sem="relaxed", scope="gpu") == k1_consumers - 1:
            tl.atomic_xchg(k1_sync_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(k1_sync_ptr + 1, 0, sem="relaxed", scope="gpu")
    elif USE_PDL:
        if not PDL_WAIT_EARLY:
            stamp(pid == 0, K2_WAIT_ENTER, False)
            tl.extra.cuda.gdc_wait()                            # h comes from K1: wait only here
            stamp(pid == 0, K2_WAIT_EXIT, False)

    if HAS_LORA:
        if ALL_SLOT0:
            slots = tl.where(m_ok, 0, -1)
        elif not PREFETCH_ROWS:
            slots = tl.load(slot_ptr + rows64, mask=m_ok, other=-1)          # [BM] slot per row
        # the rank in chunks of _rank_chunk(BLOCK_R) (one chunk up to rank 64): h and B are loaded and multiplied
        # chunk by chunk, so registers and shared memory hold [BR_CHUNK, BM] + [BN, BR_CHUNK], not the whole rank
        BR_CHUNK: tl.constexpr = _rank_chunk(BLOCK_R)
        offs_r = tl.arange(0, BR_CHUNK)
        r_ok = offs_r < R
        tile_lo = pid_n * BLOCK_N
        for i in tl.static_range(N_SLICES):
            if i == 0:
                lo = 0
                hi = end0
                b_ptr = b0_ptr
                stride_bs = stride_bs0
            elif i == 1:
                lo = end0
                hi = end1
                b_ptr = b1_ptr
                stride_bs = stride_bs1
            else:
                lo = end1
                hi = N
                b_ptr = b2_ptr
                stride_bs = stride_bs2
            if (tile_lo < hi) & (tile_lo + BLOCK_N > lo):
                col_ok = (offs_n >= lo) & (offs_n < hi)
                col = tl.where(col_ok, offs_n - lo, 0).to(tl.int64)
                b_tile = b_ptr + col[:, None] * stride_bn + offs_r[None, :] * stride_br          # [BN, BR_CHUNK]
                b_mask = col_ok[:, None] & r_ok[None, :]
                h_tile = h_ptr + i * stride_hl + rows64[None, :] * stride_hm + offs_r[:, None] * stride_hr
                # (the one-chunk code stays written out here, not in a helper: an inlined call adds debug labels to
                # the PTX that change ptxas's schedule, and rank <= 64 keeps its SASS)
                if ALL_SLOT0:
                    # one slot for every row (the trainer): no loop
                    if BR_CHUNK == BLOCK_R:
                        hT = tl.load(h_tile, mask=m_ok[None, :] & r_ok[:, None], other=0.0)      # [BR, BM] fp32
                        if PREFETCH_B and (N_SLICES == 1 or first_slice == i):
                            bt = bt_first                                   # loaded before the main loop
                        else:
                            bt = tl.load(b_tile, mask=b_mask, other=0.0)
                        acc = _lora_mma(acc, bt, hT, LORA_PREC, LORA_DT)
                    else:
                        acc = _lora_rank_chunks(acc, h_tile, b_tile, b_mask, m_ok, offs_r, R, stride_hr, stride_br,
                                                BR_CHUNK, LORA_PREC, LORA_DT)
                    if HAS_G:
                        gv = tl.load(g_ptr + offs_n * stride_gn, mask=col_ok, other=1.0)
                        acc = tl.where(m_ok[None, :] & col_ok[:, None], acc * gv[:, None], acc)
                elif not PIPE_SLOTS:
                    # one adapter (at most the -1 segment beside it): per slot, masked loads of h and B (the
                    # fewest registers, which keeps small-T tiles at 3 programs per SM)
                    cur = tl.min(tl.where(slots >= 0, slots, _BIG))
                    while cur < _BIG:
                        sel = slots == cur
                        if BR_CHUNK == BLOCK_R:
                            hT = tl.load(h_tile, mask=sel[None, :] & r_ok[:, None], other=0.0)
                            if PREFETCH_B and (N_SLICES == 1 or first_slice == i) and cur == first_slot:
                                bt = bt_first                               # loaded before the main loop
                            else:
                                bt = tl.load(b_tile + cur.to(tl.int64) * stride_bs, mask=b_mask, other=0.0)
                            acc = _lora_mma(acc, bt, hT, LORA_PREC, LORA_DT)
                        else:
                            acc = _lora_rank_chunks(acc, h_tile, b_tile + cur.to(tl.int64) * stride_bs, b_mask, sel,
                                                    offs_r, R, stride_hr, stride_br, BR_CHUNK, LORA_PREC, LORA_DT)
                        if HAS_G:
                            gv = tl.load(g_ptr + cur.to(tl.int64) * stride_gs + offs_n * stride_gn, mask=col_ok,
                                         other=1.0)
                            acc = tl.where(sel[None, :] & col_ok[:, None], acc * gv[:, None], acc)
                        cur = tl.min(tl.where(slots > cur, slots, _BIG))
                elif BR_CHUNK == BLOCK_R:
                    # many adapters: a tile meets up to BLOCK_M slots. h is loaded once per slice (every row
                    # with an adapter) and each slot selects its rows in registers (the other rows are 0,
                    # exactly as with a masked load); the next slot's B tile is loaded before this slot's
                    # MMAs, so the slots cost one memory round trip in total instead of two each.
                    hT = tl.load(h_tile, mask=(slots >= 0)[None, :] & r_ok[:, None], other=0.0)
                    cur = tl.min(tl.where(slots >= 0, slots, _BIG))
                    bt = tl.load(b_tile + tl.where(cur < _BIG, cur, 0).to(tl.int64) * stride_bs,
                                 mask=b_mask & (cur < _BIG), other=0.0)
                    while cur < _BIG:
                        nxt = tl.min(tl.where(slots > cur, slots, _BIG))
                        bt_next = tl.load(b_tile + tl.where(nxt < _BIG, nxt, 0).to(tl.int64) * stride_bs,
                                          mask=b_mask & (nxt < _BIG), other=0.0)
                        sel = slots == cur
                        acc = _lora_mma(acc, bt, tl.where(sel[None, :], hT, 0.0), LORA_PREC, LORA_DT)
                        if HAS_G:
                            gv = tl.load(g_ptr + cur.to(tl.int64) * stride_gs + offs_n * stride_gn, mask=col_ok,
                                         other=1.0)
                            acc = tl.where(sel[None, :] & col_ok[:, None], acc * gv[:, None], acc)
                        bt = bt_next
                        cur = nxt
                else:
                    acc = _lora_slot_chunks_pipelined(acc, slots, h_tile, b_tile, stride_bs, offs_r, col_ok, R,
                                                      stride_hr, stride_br, g_ptr, stride_gs, offs_n, stride_gn,
                                                      HAS_G, BR_CHUNK, LORA_PREC, LORA_DT)

    if HAS_BIAS:
        acc += tl.load(bias_ptr + n_ld).to(tl.float32)[:, None]
    y_ptrs = y_ptr + rows64[None, :] * stride_ym + offs_n[:, None] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])
    if K1_PROGRAMS and K1_THREADS:
        last = (lane == 0) & (passed == k1_consumers - 1)
        tl.atomic_xchg(k1_sync_ptr + lane, 0, mask=last, sem="relaxed", scope="gpu")
        tl.atomic_xchg(k1_sync_ptr + 1 + lane, 0, mask=last, sem="relaxed", scope="gpu")
    stamp(pid >= 0, K2_END, True)


# ----------------------------------------------------------------------------------------------------------
# host side
def _lora_dt(b_dtype):
    # the 16-bit type of the split-h MMAs: B's own type (exact), bf16 for fp32 B (tests)
    return tl.float16 if b_dtype == torch.float16 else tl.bfloat16


def _rs_unsupported(x, q, slices, gather, lora_precision, use_pdl, out_dtype) -> str | None:
    """None when lora_gemm_rs can run this W8A16 call with K2's exact arithmetic, else the reason."""
    if not knobs().gemm_rs:
        return "kernel knob gemm_rs=false"
    if out_dtype != torch.bfloat16:          # its epilogue tile goes through shared memory sized for bf16
        return f"out dtype {out_dtype}"
    if lora_precision != "bf16x2" or use_pdl:
        return f"lora_precision {lora_precision}, use_pdl {use_pdl}"
    if slices is not None and (len(slices) != 1 or slices[0].shape[0] != 1 or slices[0].dtype == torch.float16):
        return "more than one B slice or slot, or fp16 B"
    try:
        from . import gemm_rs
    except ImportError as e:                    # Triton without Gluon
        return f"gluon unavailable ({e})"
    return gemm_rs.supported(x, q, None if slices is None else slices[0].shape[2], gather=bool(gather))


def _check_launch(x, mode, lora_precision, use_pdl, q):
    if lora_precision not in LORA_PRECISIONS:
        raise ValueError(f"rlfp8.kernels.{OP}: lora_precision {lora_precision!r}: allowed {LORA_PRECISIONS}")
    if x.dtype == torch.float32:
        raise TypeError(f"rlfp8.kernels.{OP}: the Triton kernel takes bf16/fp16 x (W8A16) or e4m3 x (W8A8), got "
                        f"fp32 x {tuple(x.shape)}; use the torch backend")
    require_triton_device(OP, x, q)
    check_pdl(OP, use_pdl)


def _output(x, mode, M, N, out_dtype, out):
    out_dtype = out_dtype or (torch.bfloat16 if mode == "w8a8" else x.dtype)
    if out is None:
        return torch.empty((M, N), dtype=out_dtype, device=x.device)
    check_tensor(OP, "out", out, shape=(M, N), dtypes=(out_dtype,), device=x.device)
    return out


def _pick_config(config, mode, M, N, K, q, dev) -> tuple[GemmConfig, bool]:
    """(config, invariant): the caller's config, else the batch-invariant one (knob batch_invariant), else the
    tuned one; dispatch records "lora_gemm.schedule" = explicit | batch_invariant | tuned, and where the tiles
    come from, "lora_gemm.config" = tuned | nearest_tuned | heuristic (gemm_configs.config_source)."""
    # a transposed view of the codes (the backward's qᵀ, strides (1, N)) has its own tuned entries
    transposed = q.stride(1) != 1 and q.stride(0) == 1
    invariant = config is None and batch_invariant(mode, transposed)
    dispatch.record(f"{OP}.schedule", "explicit" if config is not None else "batch_invariant" if invariant
                    else "tuned")
    kn = knobs()
    if kn.host_fast:        # the choice reads the token count only through its bucket (gemm_configs)
        key = (OP, config, mode, m_bucket(M), N, K, transposed, dev, kn)
        cfg, source = cached_launch_config(key, lambda: _checked_config(config, invariant, mode, M, N, K, dev,
                                                                        transposed))
    else:
        cfg, source = _checked_config(config, invariant, mode, M, N, K, dev, transposed)
    if source is not None:
        dispatch.record(f"{OP}.config", source)
    return cfg, invariant


def _checked_config(config, invariant, mode, M, N, K, dev, transposed) -> tuple[GemmConfig, str | None]:
    """(config, where its tiles come from: None for the caller's; the invariant config takes its tiles from the
    same choice as the tuned one)."""
    if config is not None:
        cfg, source = config, None
    elif invariant:
        cfg, source = invariant_gemm_config(mode, M, N, K, dev), config_source(mode, M, N, K, dev)
    else:
        cfg, source = gemm_config_and_source(mode, M, N, K, dev, transposed=transposed)
    if cfg.block_m < 16 or cfg.block_n < 16 or cfg.block_k < 16:
        raise ValueError(f"rlfp8.kernels.{OP}: tile dims must be >= 16 (tl.dot), got {cfg}")
    if cfg.widen not in WIDENINGS:
        raise ValueError(f"rlfp8.kernels.{OP}: config widen must be one of {WIDENINGS}, got {cfg}")
    return cfg, source


def _fit_to_device(cfg, mode, rank, device) -> GemmConfig:
    """The chosen (tuned, heuristic or invariant) config, reduced where its shared memory at this rank would
    exceed the device's limit (gemm_configs.fit_smem); dispatch records "lora_gemm.smem" = fits | fit_smem.
    An explicit config is the caller's to size and is launched as given."""
    fitted = fit_smem(cfg, mode, rank, max_shared_mem(device, SM90_MAX_SMEM))
    dispatch.record(f"{OP}.smem", "fits" if fitted == cfg else "fit_smem")
    return fitted


K1_IN_K2_MIN_STAGES = 3
# registers per thread of K2's grids with K1's programs, at most, by mode and where the epilogue's operands are
# loaded (PREFETCH_EPI: 0 in the epilogue, 1 before the main loop, 2 after it, 3 split); tests/kernel/
# test_compile_sm90.py holds the compiled decode grids to these; what _one_wave counts against the SM's 64K
K1_IN_K2_REGS = {("w8a8", 0): 128, ("w8a8", 1): 144, ("w8a8", 2): 144, ("w8a8", 3): 144,
                 ("w8a16", 0): 168, ("w8a16", 1): 232, ("w8a16", 2): 176, ("w8a16", 3): 176}


def _one_wave(cfg: GemmConfig, mode: str, rank: int, programs: int, prefetch: int, device) -> GemmConfig:
    """K1 in K2's grid (knob k1_in_k2_one_wave, both modes by default): cfg with fewer pipeline stages (not below
    K1_IN_K2_MIN_STAGES) where its `programs` (GEMM + K1) would not all be resident at once. K1's programs hold a
    GEMM program's shared memory each, and a GEMM program left out of the first wave starts only when one of them
    ends, K1's latency then lying on the GEMM's critical path. Stages only deepen the pipeline: the sums are the
    same. dispatch records "lora_gemm.k1_wave" = one | fewer_stages | two."""
    fitted, verdict = _one_wave_config(cfg, mode, rank, programs, max_shared_mem(device, SM90_MAX_SMEM),
                                       device_sms(device, NUM_SMS_HINT), K1_IN_K2_REGS[mode, prefetch])
    dispatch.record(f"{OP}.k1_wave", verdict)
    return fitted


@functools.lru_cache(maxsize=1024)      # per launch on the decode path; configs are frozen (hashable)
def _one_wave_config(cfg: GemmConfig, mode: str, rank: int, programs: int, max_shared: int, sms: int, regs: int):
    def waves(c):
        per_sm = programs_per_sm(smem_bytes(c, mode, rank), c.num_warps, max_shared, regs)
        return cdiv(programs, max(1, sms * per_sm))
    fitted = cfg
    while waves(fitted) > 1 and fitted.num_stages > K1_IN_K2_MIN_STAGES:
        fitted = dataclasses.replace(fitted, num_stages=fitted.num_stages - 1)
    if waves(fitted) > 1:
        return cfg, "two"                     # fewer stages would not bring it to one wave: keep the tuned pipeline
    return fitted, "one" if fitted == cfg else "fewer_stages"


def _split_k_buffers(cfg, m_tiles, n_tiles, dist_red, out):
    """(partials workspace, tile counters) for split-K; unused placeholders without it."""
    if cfg.split_k == 1:
        return out, out
    dev = out.device
    dispatch.record(f"{OP}.split_k", "distributed" if dist_red else "last_program")
    part = torch.empty((cfg.split_k, m_tiles * cfg.block_m, n_tiles * cfg.block_n), dtype=torch.float32,
                       device=dev)
    return part, split_counters(f"{OP}.grow{cfg.split_k}" if dist_red else OP, m_tiles * n_tiles, dev)


def _lora_args(slices, has_lora, h, N, dummy):
    """(slices L, slice ends, B pointers, rank, B strides, h strides): the epilogue's LoRA arguments."""
    if not has_lora:
        return 1, [N, N, N], [dummy] * 3, 0, (0, 0, 0, 0, 0), (0, 0, 0)
    L = len(slices)
    if any(b.stride()[1:] != slices[0].stride()[1:] for b in slices):
        slices = [b.contiguous() for b in slices]
    widths = [b.shape[1] for b in slices]
    ends = [sum(widths[:i + 1]) for i in range(L)] + [N] * (3 - L)
    b_ptrs = slices + [slices[0]] * (3 - L)
    bst = [b.stride(0) for b in b_ptrs] + list(slices[0].stride()[1:])
    return L, ends, b_ptrs, slices[0].shape[2], bst, h.stride()


def _w_operand(q, cfg):
    """q itself, or a TMA descriptor (W_TMA 1: over q [N, K]; 2: over the stored codes of a transposed view)."""
    if not cfg.w_tma:
        return q, 0
    # TMA needs a contiguous last dim with 16-byte aligned base and rows: the stored codes [N, K], or the
    # backward's transposed view qᵀ of codes stored [K, N] (described as stored, transposed in the kernel)
    from triton.tools.tensor_descriptor import TensorDescriptor
    if q.stride(1) == 1 and q.stride(0) % 16 == 0 and q.data_ptr() % 16 == 0:
        return TensorDescriptor.from_tensor(q, [cfg.block_n, cfg.block_k]), 1
    if q.stride(0) == 1 and q.stride(1) % 16 == 0 and q.data_ptr() % 16 == 0:
        return TensorDescriptor.from_tensor(q.t(), [cfg.block_k, cfg.block_n]), 2
    raise ValueError(f"rlfp8.kernels.{OP}: config w_tma needs q (or its transpose) row-major with 16-byte "
                     f"aligned rows, got q {tuple(q.shape)} strides {q.stride()}")


def _x_operand(x, cfg, gather, quantize_x):
    """x itself, or a TMA descriptor where the rows are not gathered and K2 does not quantize them (dispatch records
    which)."""
    if not cfg.x_tma:
        return x, False
    x_arg, x_tma = x, False
    if (not gather and quantize_x is None and x.stride(0) * x.element_size() % 16 == 0
            and x.data_ptr() % 16 == 0):
        from triton.tools.tensor_descriptor import TensorDescriptor
        x_arg, x_tma = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k]), True
    dispatch.record(f"{OP}.x_loads", "tma" if x_tma else "pointer")
    return x_arg, x_tma


def _pdl_wait_early(mode, use_pdl, q, K, x_from_primary=True):
    """W8A8 with x_q from K1 (or the quantizer) waits for it before its main loop; with PDL it first prefetches its
    weight rows into L2 (2) where they are plain 16-byte aligned rows, whether the main loop then reads them through
    TMA or pointers (a TMA tile would otherwise idle through the wait: bench/README.md, session 21). W8A16, and
    W8A8 with x quantized before K1 (x_from_primary=False), wait before the epilogue (False)."""
    if mode != "w8a8" or not x_from_primary:
        return False
    aligned = q.stride(1) == 1 and q.stride(0) % 16 == 0 and q.data_ptr() % 16 == 0 and K % 16 == 0
    return 2 if use_pdl and aligned else True


def _variant_flags(cfg, mode, x, meta, slices, has_lora, dist_red, x_tma) -> dict:
    """The host-chosen kernel variants: slot pipeline, unrolled split-K sum, widening, SYNC_A, FP8_ACC, masked x
    rows, the epilogue's loads ahead of it (dispatch records "lora_gemm.prefetch_epilogue" = off | before_loop |
    after_loop | split at decode sizes)."""
    kn = knobs()
    interpreting = dispatch.triton_interpreting()
    # the slot-pipelined epilogue pays off with several adapters per tile; at 256-token tiles it would spill
    pipe_slots = has_lora and meta is not None and meta.num_active > 2 and cfg.block_m <= 128
    if _PIPE_SLOTS_OVERRIDE is not None and has_lora and meta is not None:     # tests: both variants, same bits
        pipe_slots = _PIPE_SLOTS_OVERRIDE
    # the split-K sum unrolled while the partials a program reloads (BLOCK_N x its tokens, fp32, per split) fit
    # in ~64 registers/thread
    red_unroll = (cfg.block_n * (cfg.block_m // cfg.split_k if dist_red else cfg.block_m) * (cfg.split_k - 1)
                  <= 64 * 32 * cfg.num_warps)
    # decode sizes: the epilogue's operands that K1 does not write are loaded ahead of it, where the knob says; the
    # first B tile is picked among the slices at run time, so they must share a dtype (they always do in the package)
    decode = x.shape[0] <= PREFETCH_EPI_TOKENS
    where = kn.k2_prefetch_epilogue if decode and (not has_lora or len({b.dtype for b in slices}) == 1) else "off"
    prefetch_epi = PREFETCH_EPI_CODES[where]
    if decode:
        dispatch.record(f"{OP}.prefetch_epilogue", where)
    widen_asm = 0
    if mode == "w8a16" and x.dtype == torch.bfloat16 and kn.w8a16_widen == "bits" and not interpreting:
        widen_asm = {"bits": 1, "prmt": 2, "cvt": 0}[cfg.widen]
    return dict(PIPE_SLOTS=pipe_slots, RED_UNROLL=red_unroll, WIDEN_ASM=widen_asm,
                SYNC_A=kn.k2_sync_a and mode == "w8a16" and cfg.swap_ab and not interpreting,
                FP8_ACC=None if kn.fp8_precise_acc is None else min(kn.fp8_precise_acc, cfg.block_k),
                MASK_ROWS=kn.k2_mask_x_rows and not x_tma and x.shape[0] < cfg.block_m,
                PREFETCH_EPI=prefetch_epi)


def _gluon_mainloop(x, q, w_scale, h, B, slices, has_lora, gather, g, bias, lora_precision, use_pdl, out):
    """Many tokens (the trainer's steps, long prefills): the Gluon warp-specialized main loop, same bits.
    Returns its output, or None when it cannot take the call (dispatch records which ran)."""
    why = _rs_unsupported(x, q, slices if has_lora else None, gather, lora_precision, use_pdl, out.dtype)
    dispatch.record(f"{OP}.mainloop", "gluon_rs" if why is None else "triton")
    if why is not None:
        return None
    from .gemm_rs import lora_gemm_rs
    return lora_gemm_rs(x, q, w_scale, h=h if has_lora else None, B=slices[0] if has_lora else None,
                        bias=bias, out=out, g=g if has_lora else None)


def lora_gemm_triton(x, q, w_scale, *, x_scale=None, h=None, B=None, meta: LoRAMeta | None = None, g=None,
                     bias=None, out_dtype=None, out=None, config: GemmConfig | None = None, gather=None,
                     lora_precision: str = "bf16x2", use_pdl: bool = False,
                     x_from_primary: bool = True, quantize_x: str | None = None,
                     shrink: ShrinkPrograms | None = None) -> torch.Tensor:
    """K2 (module docstring). `shrink`: K1's programs of this call (shrink_triton.shrink_programs, h = its h),
    run as the first programs of this grid (knob k1_in_k2, projection.fp8_lora_linear)."""
    mode, slices = check_lora_gemm_args(x, q, w_scale, x_scale, h, B, meta, g, bias, out_dtype, quantize_x)
    _check_launch(x, mode, lora_precision, use_pdl, q)
    M, K = x.shape
    N = q.shape[0]
    out = _output(x, mode, M, N, out_dtype, out)
    if M == 0 or N == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg, invariant = _pick_config(config, mode, M, N, K, q, x.device)
    has_lora = slices is not None and not (meta is not None and meta.no_lora)
    if config is None:
        cfg = _fit_to_device(cfg, mode, slices[0].shape[2] if has_lora else 0, x.device)
    gather = (meta is not None and has_lora) if gather is None else (gather and meta is not None)
    if has_lora:                        # both main loops run the epilogue in this chunk (gemm_rs: K2's chunks)
        dispatch.record(f"{OP}.rank_chunk", str(rank_chunk(block_r(slices[0].shape[2]))))
    if shrink is not None:
        _check_shrink(shrink, h, has_lora, quantize_x)
    big_w8a16 = (shrink is None and mode == "w8a16" and config is None and m_bucket(M) == M_BUCKETS[-1]
                 and not dispatch.triton_interpreting())
    if big_w8a16 and invariant and not same_sums(cfg, GLUON_SCHEDULE, K):
        dispatch.record(f"{OP}.mainloop", "triton")     # the Gluon loop sums over K in another schedule
    elif big_w8a16:
        y = _gluon_mainloop(x, q, w_scale, h, B, slices, has_lora, gather, g, bias, lora_precision, use_pdl, out)
        if y is not None:
            return y
    m_tiles, n_tiles = cdiv(M, cfg.block_m), cdiv(N, cfg.block_n)
    # (a program quantizing x holds its whole tile's scales: it reduces the whole tile)
    dist_red = (knobs().k2_dist_red and cfg.split_k in (2, 4, 8) and cfg.block_m // cfg.split_k >= 16
                and quantize_x is None and not dispatch.triton_interpreting())
    part, cnt = _split_k_buffers(cfg, m_tiles, n_tiles, dist_red, out)
    dummy = out
    L, ends, b_ptrs, r, bst, hst = _lora_args(slices, has_lora, h, N, dummy)
    slot_t = meta.token_lora_mapping if (has_lora and meta is not None) else dummy
    perm_t = meta.token_indices_sorted_by_lora_ids if gather else dummy
    w_arg, w_tma = _w_operand(q, cfg)
    x_arg, x_tma = _x_operand(x, cfg, gather, quantize_x)
    programs = m_tiles * n_tiles * cfg.split_k
    variant = _variant_flags(cfg, mode, x, meta, slices, has_lora, dist_red, x_tma)   # (stages do not matter)
    if shrink is not None and config is None and knobs().k1_in_k2_one_wave in ("on", mode):
        cfg = _one_wave(cfg, mode, r, programs + shrink.programs, variant["PREFETCH_EPI"], x.device)
    k1_args, k1_consts = _k1_block(shrink, programs if cfg.split_k == 1 or dist_red else m_tiles * n_tiles,
                                   32 * cfg.num_warps if mode == "w8a16" else 0, dummy)
    launch(_lora_gemm_kernel, (programs + (shrink.programs if shrink is not None else 0),),
           w_arg, x_arg, out, w_scale if w_scale is not None else dummy, x_scale if x_scale is not None else dummy, q,
           h if has_lora else dummy, *b_ptrs, slot_t, perm_t, g if g is not None else dummy,
           bias if bias is not None else dummy, part, cnt, *k1_args,
           M, N, K, r, ends[0], ends[1],
           q.stride(0), q.stride(1), x.stride(0), x.stride(1), out.stride(0), out.stride(1),
           hst[0], hst[1], hst[2], *bst,
           g.stride(0) if g is not None else 0, g.stride(1) if g is not None else 0,
           BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
           GROUP_M=cfg.group_m, DIST_RED=dist_red, WIDEN_W=mode == "w8a16",
           SCALE_W=int(w_scale is not None), HAS_XS=mode == "w8a8", HAS_LORA=has_lora, N_SLICES=L,
           BLOCK_R=block_r(r), ALL_SLOT0=meta is None,
           GATHER=bool(gather), HAS_G=g is not None and has_lora, HAS_BIAS=bias is not None,
           LORA_PREC=lora_precision, LORA_DT=_lora_dt(slices[0].dtype if has_lora else None),
           EVEN_K=K % cfg.block_k == 0, EVEN_N=N % cfg.block_n == 0,
           USE_PDL=use_pdl, W_TMA=w_tma, QUANT_X=ROUNDING_CODE[quantize_x] if quantize_x else 0,
           PDL_WAIT_EARLY=_pdl_wait_early(mode, use_pdl, q, K, x_from_primary and quantize_x is None),
           SWAP_AB=cfg.swap_ab, X_TMA=x_tma, **variant,
           **k1_consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=use_pdl)
    return out


# K2's K1 constexprs when its grid runs no K1 programs
_NO_K1 = dict(K1_PROGRAMS=False, K1_BLOCK_M=16, K1_BLOCK_R=16, K1_BLOCK_K=16, K1_SPLIT_K=1, K1_EVEN_K=True,
              K1_RED_UNROLL=False, K1_BR_BLOCK=16, K1_MASK_ROWS=False, K1_STAGES=1, K1_THREADS=0)


def _k1_block(shrink: ShrinkPrograms | None, consumers: int, late_count_threads: int, dummy) -> tuple[tuple, dict]:
    """K2's K1 arguments (pointers, counts, strides) and constexprs: the shrink programs' or placeholders.
    `consumers`: how many GEMM programs reach the epilogue (the last of them resets the counters);
    `late_count_threads`: K1_THREADS (0: the count past the wait at once; K2's threads: read at the end)."""
    if shrink is None:          # the kernel's 11 k1_* pointers and 8 k1_* counts/strides, unused
        return (dummy,) * 11 + (0,) * 8, _NO_K1
    dispatch.record(f"{OP}.k1", "in_k2")
    sync = split_counters(f"{OP}.k1_sync", 2, dummy.device)     # [K1 programs done, GEMM programs past the wait]
    x = shrink.x
    args = (x, *shrink.a3, shrink.ws, shrink.cnt, *shrink.segments, sync, shrink.m_tiles, shrink.programs,
            consumers, x.stride(0), x.stride(1), *shrink.a3[0].stride())
    return args, dict(shrink.consts, K1_PROGRAMS=True, K1_THREADS=late_count_threads)


def _check_shrink(shrink: ShrinkPrograms, h, has_lora, quantize_x) -> None:
    """K1 in K2's grid writes the h that this call's epilogue reads (its shape is checked with h's)."""
    if not has_lora or h is not shrink.out.h:
        raise ValueError(f"rlfp8.kernels.{OP}: shrink programs need the adapter's B and h = their h (h "
                         f"{None if h is None else tuple(h.shape)}, B {'given' if has_lora else 'none'})")
    if quantize_x is not None:
        raise ValueError(f"rlfp8.kernels.{OP}: quantize_x={quantize_x!r} with shrink programs: K2 quantizing x "
                         f"and K1 in its grid are not combined (the quantizer kernel or the caller's codes are)")
