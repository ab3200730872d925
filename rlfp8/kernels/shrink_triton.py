"""K1: the multi-adapter LoRA down-projection h = x·Aᵀ (fp32), fused with the per-token FP8 activation
quantization of the W8A8 mode, over vLLM-style adapter-sorted segments.

Shapes (T tokens, K input features, S slots, r rank, L slices: 3 for qkv, 2 for gate_up, else 1):
  x [T, K] bf16/fp16;  A: one tensor or a tuple of L tensors [S, r, K] (or vLLM's [S, 1, r, K]) in x.dtype;
  h [L, T, r] fp32 (vLLM's shrink buffer layout): h[l, t] = x[t] · A_l[slot(t)]ᵀ, fp32 accumulation of
  exact bf16 products; rows of tokens without adapter (slot -1) are not written;
  quant "div"|"recip" (W8A8): also x_q [T, K] float8_e4m3fn and x_scale [T, 1] fp32, bit-equal to
  fp8.quantize_activation_ref (same row helpers as rlfp8.kernels.fp8_triton).

Triton kernel, one 1-D launch of two kinds of programs:
  * W8A8 only, first: ⌈T/QBLOCK_M⌉ quantization programs, each quantizing QBLOCK_M consecutive tokens over
    the full K (one row per program for K >= 4096; one pass over x when K <= 4096), in token order: the
    quantization does not depend on the adapters, so it needs neither the segments nor the split (the
    per-segment layout it replaced, and why: bench/README.md, "K1's quantization programs").
  * SPLIT_K · ⌈T/BLOCK_M⌉ · L · segments shrink programs (split index fastest). A program takes BLOCK_M rows
    of one adapter segment (rows gathered through token_indices_sorted_by_lora_ids, so one A is read per
    program) and a 1/SPLIT_K share of K. With SPLIT_K > 1 every program writes its fp32 partial to a
    workspace and the last one of its tile (atomic counter, reset afterwards) sums the partials in split
    order: deterministic, so the engine's call and the trainer's forward produce the same h bit for bit.
`meta=None` means every token uses slot 0 (the trainer's one-adapter call): no metadata, same arithmetic.

Config (BLOCK_M, BLOCK_K, SPLIT_K) depends on (mode, T, K, r) only (SPLIT_K on (mode, T, K); W8A8's decode
split above 8 also on the rank, knob k1_decode_split_max), never on the adapter count or the slices, so a
row's h does not depend on which other adapters share the batch or (W8A16) on the rank padding of the engine's
slots. With the knob batch_invariant (default auto: the W8A16 calls) it does not
depend on T either (invariant_shrink_config), so vLLM's chunks of any size give the trainer's h.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import dispatch
from ._triton_utils import cdiv, check_pdl, launch, require_triton_device, split_counters
from .fp8_ref import FP8_DTYPE
from .gemm_configs import batch_invariant, block_r, cached_launch_config
from .knobs import knobs
from .fp8_triton import ROUNDING_CODE, _quant_config, _quant_rows_tile, quantize_rows_triton
from .shrink_ref import ShrinkOut, a_slices, check_lora_shrink_args
from .metadata import LoRAMeta
from .timeline import K1_END, K1_START, stamp

OP = "lora_shrink"


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


# K1's split-K cap (shares of K, each >= 512 wide), except W8A8 at decode sizes (the knob k1_decode_split_max)
SPLIT_MAX = 8


def shrink_config(M: int, K: int, r: int, split_max: int = SPLIT_MAX) -> ShrinkConfig:
    """Heuristic per token count. Small T: small row tiles and split-K, so that ~100+ programs each stream a
    short K range (the shrink is a latency problem: at T = 64 it moves ~2 MiB); large T: 64-row tiles.
    A split_max above SPLIT_MAX (W8A8 at decode sizes) is lowered while the tile's last program could not sum the
    partials unrolled (a rolled sum waits one L2 round trip per split): that choice reads the rank, which W8A8's
    engine shares with no trainer.

    Up to SPLIT_MAX the split depends on (T, K) only, never on r: the engine's slots are padded to
    max_lora_rank, the trainer's adapter is not, and the same split (= the same summation order) keeps their h
    bit-identical.
    BLOCK_M depends on T only (it picks the MMA instruction); BLOCK_K only regroups the k16 MMA steps, which
    every dot issues in k order.
    num_stages never exceeds the iterations of one split (2 iterations need 2 buffers, not 3), which keeps
    shared memory at <= ~100 KiB so that two programs fit on an SM."""
    br = block_r(r)
    bm = 16 if M <= 16 else 32 if M <= 256 else 64
    if M <= 16:
        bk = 256 if br <= 64 else 128
    elif M <= 256:
        bk = 128
    else:
        bk = 64
    m_tiles = cdiv(M, bm)
    split = max(1, min(K // 512, cdiv(128, m_tiles), split_max))
    while split > SPLIT_MAX and not _unrolled_sum(bm, shrink_rank_block(br, M), split, 4):
        split //= 2
    iters = cdiv(cdiv(K, bk), split)
    stages = max(1, min(3, iters))
    while stages > 1 and stages * (bm + shrink_rank_block(br)) * bk * 2 > 100 * 1024:
        stages -= 1
    return ShrinkConfig(bm, bk, split, num_warps=4, num_stages=stages)


def invariant_shrink_config(K: int, r: int) -> ShrinkConfig:
    """K1's config in batch-invariant mode (knob batch_invariant): shrink_config's decode choice at every T,
    a function of (K, r) only. BLOCK_K and SPLIT_K (so the shares' boundaries and their split-order sum) are
    then fixed, and so is BLOCK_M = 16, which keeps every T on the same MMA instruction (16-row tiles run on
    mma.sync; 64-row ones would take wgmma). At large T that costs more programs (an 8192-token step: 512
    row tiles x SPLIT_K), which the shrink, ~1/64 of K2's work at rank 64, absorbs (bench/lab/invariant_configs.py)."""
    return shrink_config(1, K, r)


def _unrolled_sum(block_m: int, rank_block: int, split: int, num_warps: int) -> bool:
    """The split-K sum unrolled: the partials (BLOCK_M x BR_BLOCK fp32 per split) within ~128 registers/thread."""
    return block_m * rank_block * (split - 1) <= 128 * 32 * num_warps


def _pick_shrink_config(config, M: int, K: int, r: int, mode: str) -> ShrinkConfig:
    """The caller's config, else the invariant one (knob batch_invariant for this mode: W8A16 by default), else
    the per-T heuristic; dispatch records "lora_shrink.schedule"."""
    invariant = config is None and batch_invariant(mode)
    dispatch.record(f"{OP}.schedule", "explicit" if config is not None else "batch_invariant" if invariant
                    else "tuned")
    if config is not None:
        return config
    if invariant:               # both choices are pure functions of their arguments: chosen once per key
        return cached_launch_config((OP, "invariant", K, r), lambda: invariant_shrink_config(K, r))
    split_max = knobs().k1_decode_split_max if mode == "w8a8" and M <= 16 else SPLIT_MAX
    return cached_launch_config((OP, "per_t", M, K, r, split_max, knobs().k1_decode_rank_block),
                                lambda: shrink_config(M, K, r, split_max))


# Ranks per program (a function of BLOCK_R alone): above it a tile's ranks go to several programs (the kernel).
# At rank 384 the whole rank in one program spilled ~14 KB per thread (bench/lab/rank_spills.py).
SHRINK_RANK_BLOCK = 128


def shrink_rank_block(block_r: int, M: int | None = None) -> int:
    """Ranks per program: up to SHRINK_RANK_BLOCK; at decode sizes (M <= 16) the knob k1_decode_rank_block when set,
    which multiplies K1's programs (at rank 64 and split 8, qkv has 24) without changing a bit of h."""
    rb = min(block_r, SHRINK_RANK_BLOCK)
    decode = knobs().k1_decode_rank_block
    if M is not None and M <= 16 and decode:
        rb = min(rb, decode)
    return rb


@triton.jit
def _shrink_program(
    p, is_shrink, x_ptr, a0_ptr, a1_ptr, a2_ptr, h_ptr, ws_ptr, cnt_ptr,
    sorted_ptr, ntok_ptr, start_ptr, ids_ptr, M, K, R, m_tiles,
    stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_hl, stride_hm, stride_hr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    N_SLICES: tl.constexpr, ALL_SLOT0: tl.constexpr, EVEN_K: tl.constexpr, RED_UNROLL: tl.constexpr,
    BR_BLOCK: tl.constexpr, MASK_ROWS: tl.constexpr,
    STAGES: tl.constexpr,       # the K loop's pipeline depth (its own: inside K2's grid the kernel's is K2's)
):
    """Shrink program p (split index fastest, then rank block, row tile, slice, segment) of K1: h for its rows
    and ranks, or its split's partial (the tile's last program sums them). Does nothing unless is_shrink.
    Runs in K1's own kernel and, with the knob k1_in_k2, as the first programs of K2's grid
    (gemm_triton): the same code and config, so the same h bit for bit."""
    # above rank 128 (and at decode sizes with the knob k1_decode_rank_block) a tile's ranks are cut into blocks of
    # BR_BLOCK, one program each (next to each other, so they read the same x rows from L2): the [BLOCK_M,
    # BLOCK_R] accumulator and the A tile of one program stay small, and there are more programs. Each h
    # element's sum over K is the same whatever the block (its own column of the MMA).
    RANK_BLOCKS: tl.constexpr = BLOCK_R // BR_BLOCK
    pid_sk = p % SPLIT_K
    pid_rb = (p // SPLIT_K) % RANK_BLOCKS
    pid_m = (p // (SPLIT_K * RANK_BLOCKS)) % m_tiles
    slice_id = (p // (SPLIT_K * RANK_BLOCKS * m_tiles)) % N_SLICES
    seg = p // (SPLIT_K * RANK_BLOCKS * m_tiles * N_SLICES)
    offs_m = tl.arange(0, BLOCK_M)
    m0 = pid_m * BLOCK_M
    if ALL_SLOT0:
        lora_id = seg * 0                      # slot 0 (an int32 tensor, like the loaded id)
        n_seg = M
        row_ok = m0 + offs_m < n_seg
        rows = tl.where(row_ok, m0 + offs_m, 0)
    else:
        lora_id = tl.load(ids_ptr + seg)
        n_seg = tl.load(ntok_ptr + seg)
        seg_start = tl.load(start_ptr + seg)
        row_ok = m0 + offs_m < n_seg
        rows = tl.load(sorted_ptr + seg_start + m0 + offs_m, mask=row_ok, other=0)   # token ids [BM]
    live = is_shrink & (m0 < n_seg) & (lora_id >= 0)
    if RANK_BLOCKS > 1:
        live = live & (pid_rb * BR_BLOCK < R)          # blocks past the rank (BLOCK_R is a power of 2): nothing
    if live:
        a_ptr = a0_ptr
        if N_SLICES > 1:
            if slice_id == 1:
                a_ptr = a1_ptr
        if N_SLICES > 2:
            if slice_id == 2:
                a_ptr = a2_ptr
        # This program's K range: whole BLOCK_K chunks, SPLIT_K contiguous shares.
        k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_lo = tl.multiple_of(pid_sk * k_per, BLOCK_K)
        k_hi = tl.minimum(K, k_lo + k_per)
        offs_r = pid_rb * BR_BLOCK + tl.arange(0, BR_BLOCK)
        offs_k = tl.arange(0, BLOCK_K)
        r_ok = offs_r < R
        rows64 = rows.to(tl.int64)
        x_ptrs = x_ptr + rows64[:, None] * stride_xm + (k_lo + offs_k)[None, :] * stride_xk     # [BM, BK]
        a_ptrs = (a_ptr + lora_id.to(tl.int64) * stride_as + offs_r[:, None] * stride_ar
                  + (k_lo + offs_k)[None, :] * stride_ak)                                      # [BR, BK]
        acc = tl.zeros((BLOCK_M, BR_BLOCK), dtype=tl.float32)
        for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            if EVEN_K:
                if MASK_ROWS:
                    xt = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
                else:
                    xt = tl.load(x_ptrs)
                at = tl.load(a_ptrs, mask=r_ok[:, None], other=0.0)
            else:
                k_ok = (k + offs_k) < K
                if MASK_ROWS:
                    xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                else:
                    xt = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
                at = tl.load(a_ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(xt, tl.trans(at), acc)                                                # [BM, BR]
            x_ptrs += BLOCK_K * stride_xk
            a_ptrs += BLOCK_K * stride_ak
        h_ptrs = h_ptr + slice_id * stride_hl + rows64[:, None] * stride_hm + offs_r[None, :] * stride_hr
        h_mask = row_ok[:, None] & r_ok[None, :]
        if SPLIT_K == 1:
            tl.store(h_ptrs, acc, mask=h_mask)
        else:
            # workspace [SPLIT_K, L, T, BLOCK_R] fp32, indexed by token row (each row is in one tile).
            ws_row = ws_ptr + (slice_id * M + rows64)[:, None] * BLOCK_R + offs_r[None, :]
            part_stride = N_SLICES * M * BLOCK_R
            tl.store(ws_row + pid_sk * part_stride, acc, mask=row_ok[:, None])
            tl.debug_barrier()
            tile_id = ((seg * N_SLICES + slice_id) * RANK_BLOCKS + pid_rb) * m_tiles + pid_m
            done = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT_K - 1:
                # Last program of this tile: sum the partials in split order (deterministic). Unrolled when
                # the partials fit in registers, so that all their loads are in flight at once (a rolled
                # loop waits one L2 round trip per split); same additions in the same order either way.
                acc = tl.load(ws_row, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
                if RED_UNROLL:
                    for s in tl.static_range(1, SPLIT_K):
                        acc += tl.load(ws_row + s * part_stride, mask=row_ok[:, None], other=0.0,
                                       cache_modifier=".cg")
                else:
                    for s in range(1, SPLIT_K):
                        acc += tl.load(ws_row + s * part_stride, mask=row_ok[:, None], other=0.0,
                                       cache_modifier=".cg")
                tl.store(h_ptrs, acc, mask=h_mask)
                tl.atomic_xchg(cnt_ptr + tile_id, 0, sem="relaxed", scope="gpu")


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, h_ptr, xq_ptr, xs_ptr, ws_ptr, cnt_ptr,
    sorted_ptr, ntok_ptr, start_ptr, ids_ptr,
    M, K, R, m_tiles, n_quant,
    stride_xm, stride_xk,
    stride_as, stride_ar, stride_ak,          # A slices share strides: [S, r, K]
    stride_hl, stride_hm, stride_hr,          # h [L, T, r]
    stride_qm, stride_qk, stride_xs,          # x_q [T, K], x_scale [T]
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    N_SLICES: tl.constexpr, ALL_SLOT0: tl.constexpr, QUANT: tl.constexpr, QBLOCK_M: tl.constexpr,
    QBLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, RED_UNROLL: tl.constexpr, USE_PDL: tl.constexpr,
    BR_BLOCK: tl.constexpr,     # ranks per program (shrink_rank_block): BLOCK_R // BR_BLOCK programs per tile
    MASK_ROWS: tl.constexpr,    # a tile's padding rows (past its segment) load no x (knob k1_mask_x_rows); else
                                # they re-read a valid row (their h is never stored either way)
    STAGES: tl.constexpr,       # the shrink loop's pipeline depth (= num_stages)
):
    # 1-D grid: [n_quant quantization programs (W8A8 only)] + [SPLIT_K x m_tiles x N_SLICES x segments shrink
    # programs], split index fastest.
    pid = tl.program_id(0)
    stamp(pid >= 0, K1_START, False)          # benchmark timeline only (no code by default)
    if USE_PDL:
        # Let the dependent K2 start now, at every program's start (the H200 probe: the full overlap; the
        # trigger then also comes after all of K1's programs are resident, so K2 never delays them). Safe
        # anywhere: K2 reads h / x_q only after gdc_wait, which waits for K1's completion and memory flush.
        tl.extra.cuda.gdc_launch_dependents()
    if QUANT != 0:
        if pid < n_quant:
            # per-token quantization of QBLOCK_M consecutive rows (token order: it does not depend on the
            # adapters), the same row helper and config as the stand-alone quantizer
            qrows = pid * QBLOCK_M + tl.arange(0, QBLOCK_M)
            _quant_rows_tile(x_ptr, xq_ptr, xs_ptr, qrows, qrows < M, K, stride_xm, stride_xk, stride_qm,
                             stride_qk, stride_xs, QBLOCK_M, QBLOCK_K, QUANT)
    is_shrink = pid >= n_quant
    p = tl.maximum(pid - n_quant, 0)          # quantization programs decode as shrink program 0, then skip it
    _shrink_program(p, is_shrink, x_ptr, a0_ptr, a1_ptr, a2_ptr, h_ptr, ws_ptr, cnt_ptr,
                    sorted_ptr, ntok_ptr, start_ptr, ids_ptr, M, K, R, m_tiles,
                    stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_hl, stride_hm, stride_hr,
                    BLOCK_M, BLOCK_R, BLOCK_K, SPLIT_K, N_SLICES, ALL_SLOT0, EVEN_K, RED_UNROLL, BR_BLOCK,
                    MASK_ROWS, STAGES)
    stamp(pid >= 0, K1_END, True)



def _checked_inputs(x, A, meta, quant, out, use_pdl):
    """(x with unit column stride, the A slices with one common stride), after the argument checks."""
    A3 = check_lora_shrink_args(x, a_slices(A), meta, quant, out)
    if x.dtype == torch.float32:
        raise TypeError(f"rlfp8.kernels.{OP}: the Triton kernel takes bf16/fp16 x (16-bit MMA), got fp32 "
                        f"x {tuple(x.shape)}; use the torch backend")
    require_triton_device(OP, x)
    check_pdl(OP, use_pdl)
    if x.stride(1) != 1:
        x = x.contiguous()
    if any(a.stride() != A3[0].stride() for a in A3):
        A3 = [a.contiguous() for a in A3]
    return x, A3


def lora_shrink_triton(x: torch.Tensor, A, meta: LoRAMeta | None = None, quant: str | None = None,
                       out: torch.Tensor | None = None, config: ShrinkConfig | None = None,
                       use_pdl: bool = False, mode: str | None = None) -> ShrinkOut:
    """K1 (module docstring). mode: the projection's, which picks the schedule (_pick_shrink_config); default
    "w8a8" when K1 quantizes x, else "w8a16"."""
    mode = mode or ("w8a16" if quant is None else "w8a8")
    if mode not in ("w8a16", "w8a8") or (quant is not None and mode != "w8a8"):
        raise ValueError(f"rlfp8.kernels.{OP}: mode {mode!r} with quant {quant!r}: modes 'w8a16', 'w8a8' (K1 "
                         f"quantizes x in 'w8a8' only)")
    x, A3 = _checked_inputs(x, A, meta, quant, out, use_pdl)
    M, K = x.shape
    dev = x.device
    h = _h_buffer(x, A3, meta, out)
    xq = torch.empty((M, K), dtype=FP8_DTYPE, device=dev) if quant else None
    xs = torch.empty((M, 1), dtype=torch.float32, device=dev) if quant else None
    if M == 0:
        return ShrinkOut(h, xq, xs)
    if meta is not None and meta.no_lora:
        # as vLLM: no shrink when no token has an adapter (the segment arrays are empty then); W8A8 still
        # needs x_q, from the stand-alone kernel (same row helpers, same bits)
        if quant is not None:
            xq, s = quantize_rows_triton(x, quant, OP)
            xs = s[:, None]
        return ShrinkOut(h, xq, xs)
    progs = _shrink_layout(x, A3, meta, h, config, mode)
    if quant:
        qbm, qbk, _ = _quant_config(M, K)
        n_quant = cdiv(M, qbm)
    else:
        qbm, qbk, n_quant = 1, 16, 0
    cfg = progs.config
    launch(_lora_shrink_kernel, (n_quant + progs.programs,),
           x, *progs.a3, h, xq if quant else h, xs if quant else h, progs.ws, progs.cnt, *progs.segments,
           M, K, progs.rank, progs.m_tiles, n_quant, x.stride(0), x.stride(1), *progs.a3[0].stride(),
           h.stride(0), h.stride(1), h.stride(2),
           xq.stride(0) if quant else 0, xq.stride(1) if quant else 0, xs.stride(0) if quant else 0,
           **{name.removeprefix("K1_"): v for name, v in progs.consts.items()},     # BLOCK_M, ..., STAGES
           N_SLICES=len(A3), ALL_SLOT0=meta is None, QUANT=ROUNDING_CODE[quant] if quant else 0, QBLOCK_M=qbm,
           QBLOCK_K=qbk, USE_PDL=use_pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    # K1 itself is launched in stream order (it reads x at once and has no gdc_wait); use_pdl only makes it
    # trigger its dependent K2. The workspace is returned so that the caller keeps it alive until K2 is
    # enqueued: K2 then runs beside K1 and must not get this memory from the allocator.
    return ShrinkOut(h, xq, xs, workspace=progs.out.workspace)


@dataclass
class ShrinkPrograms:
    """One call's shrink programs (no quantization) as launch arguments of `_shrink_program`: K1's own launch
    takes them, and so does K2's grid where K1 runs as its first programs (knob k1_in_k2, gemm_triton).
    `consts` are the K1_* constexprs (K1's kernel takes them without the prefix); `out` holds h and the split-K workspace (keep it alive until the launch
    is enqueued)."""
    out: ShrinkOut
    programs: int
    x: torch.Tensor
    a3: list                    # the A slices, padded to three with the first
    ws: torch.Tensor            # split-K partials (h itself without split)
    cnt: torch.Tensor           # split-K tile counters (h itself without split)
    segments: tuple             # sorted token ids, tokens per segment, segment starts, slot ids (h without metadata)
    m_tiles: int
    rank: int
    config: ShrinkConfig
    consts: dict


def _h_buffer(x, A3, meta, out):
    # without metadata every row of h is written by the kernel (one adapter, slot 0): no zero fill needed
    # (the fast path of the knob host_fast; with metadata, rows without adapter must stay 0)
    if out is not None:
        return out
    alloc = torch.empty if meta is None and knobs().host_fast else torch.zeros
    return alloc((len(A3), x.shape[0], A3[0].shape[1]), dtype=torch.float32, device=x.device)


def _shrink_layout(x, A3, meta, h, config, mode) -> ShrinkPrograms:
    M, K = x.shape
    _, r, _ = A3[0].shape
    L = len(A3)
    dev = x.device
    cfg = _pick_shrink_config(config, M, K, r, mode)
    br = block_r(r)
    m_tiles = cdiv(M, cfg.block_m)
    n_seg = 1 if meta is None else max(meta.num_active, 1)
    ws = torch.empty((cfg.split_k, L, M, br), dtype=torch.float32, device=dev) if cfg.split_k > 1 else h
    rb = shrink_rank_block(br, M)
    rank_blocks = br // rb
    cnt = split_counters(OP, n_seg * L * rank_blocks * m_tiles, dev) if cfg.split_k > 1 else h
    if meta is None:
        md = (h, h, h, h)                     # unused (ALL_SLOT0)
    else:
        md = (meta.token_indices_sorted_by_lora_ids, meta.num_tokens_per_lora, meta.lora_token_start_loc,
              meta.active_lora_ids)
    red_unroll = _unrolled_sum(cfg.block_m, rb, cfg.split_k, cfg.num_warps)
    dispatch.record(f"{OP}.rank_blocks", str(rank_blocks))
    consts = dict(K1_BLOCK_M=cfg.block_m, K1_BLOCK_R=br, K1_BLOCK_K=cfg.block_k, K1_SPLIT_K=cfg.split_k,
                  K1_EVEN_K=K % cfg.block_k == 0, K1_RED_UNROLL=red_unroll, K1_BR_BLOCK=rb,
                  K1_MASK_ROWS=knobs().k1_mask_x_rows and M <= 16, K1_STAGES=cfg.num_stages)
    out = ShrinkOut(h, None, None, workspace=ws if cfg.split_k > 1 else None)
    return ShrinkPrograms(out, cfg.split_k * rank_blocks * m_tiles * L * n_seg, x, A3 + [A3[0]] * (3 - L), ws, cnt,
                          md, m_tiles, r, cfg, consts)


def shrink_programs(x: torch.Tensor, A, meta: LoRAMeta | None = None, out: torch.Tensor | None = None,
                    mode: str = "w8a16") -> ShrinkPrograms:
    """K1's shrink programs for one call without quantization (K2's grid runs them: knob k1_in_k2), after the
    same checks as lora_shrink_triton; the config of the projection's `mode` (W8A16: the batch-invariant
    schedule the trainer shares by default; W8A8: the per-token-count one). The caller makes sure some token has
    an adapter."""
    x, A3 = _checked_inputs(x, A, meta, None, out, False)
    if x.shape[0] == 0 or (meta is not None and meta.no_lora):
        raise ValueError(f"rlfp8.kernels.{OP}: shrink_programs needs tokens with an adapter, got x "
                         f"{tuple(x.shape)}{' and metadata without adapters' if meta is not None else ''}")
    return _shrink_layout(x, A3, meta, _h_buffer(x, A3, meta, out), None, mode)
