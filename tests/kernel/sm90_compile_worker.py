"""Compile every Triton kernel of rlfp8.kernels for sm_90a (GPUTarget("cuda", 90, 32)) without a GPU, with
the configs the host code picks on an H200 (Qwen3-8B projection shapes at one M per token bucket, tuned
table entries included), and print one JSON line per distinct kernel.

Run by tests/kernel/test_compile_sm90.py in a subprocess WITHOUT TRITON_INTERPRET (the interpreter replaces
@triton.jit at decoration time). The launchers are called with CPU tensors while
rlfp8.kernels._triton_utils.collect_launches() captures their launches; each distinct launch is compiled
through the JIT's own argument specialization (jit_spec/compile_spec).
    python -m tests.kernel.sm90_compile_worker [--jobs 2]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"

import torch  # noqa: E402

from rlfp8.kernels.dora_triton import col_dot_triton, norm_pieces_triton  # noqa: E402
from rlfp8.kernels import _triton_utils as tu  # noqa: E402
from rlfp8.kernels.fp8_triton import quantize_activation_triton, quantize_weight_triton  # noqa: E402
from rlfp8.kernels.linear_triton import dy_prep_triton  # noqa: E402
from rlfp8.kernels.gemm_configs import (GLUON_SCHEDULE, M_BUCKETS, GemmConfig, _measured_candidate,  # noqa: E402
                                        _tuned_table, gemm_config, invariant_gemm_config, reduction_schedule)
from rlfp8.kernels.gemm_triton import lora_gemm_triton  # noqa: E402
from rlfp8.kernels.knobs import K2_PREFETCH_EPILOGUE, restore_knobs, set_knobs  # noqa: E402
from rlfp8.kernels.shrink_triton import lora_shrink_triton, shrink_programs  # noqa: E402
from rlfp8.kernels.metadata import build_lora_meta  # noqa: E402

SHAPES = {"qkv": (4096, [4096, 1024, 1024]), "o": (4096, [4096]), "gate_up": (4096, [12288, 12288]),
          "down": (12288, [4096])}
M_REPS = [1, 24, 64, 128, 256, 300, 2048]          # one M per bucket of gemm_config.M_BUCKETS
assert len(M_REPS) == len(M_BUCKETS)
SMEM_MAX = 232448                                  # sm_90 max dynamic shared memory per block (227 KiB)
FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def _e(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype)


def collect() -> list:
    """All launches (kernel, grid, args, kwargs) the GPU paths make, one per distinct kernel + config."""
    with tu.collect_launches() as rec:
        _quantizer_and_projection_launches()
        _tma_orientation_and_widening_launches()
        _rank_and_pdl_launches()
        _k1_in_k2_launches()
        _prefetch_epilogue_launches()
        _tuned_table_launches()
        _invariant_launches()
        _large_rank_launches()
    rec.extend(_gluon_launches())
    return _distinct(rec)


def _quantizer_and_projection_launches(S: int = 4, r: int = 64) -> None:
    """The quantizers; K1/K2 for every Qwen3-8B projection at one M per bucket; the training linear."""
    quantize_activation_triton(_e(64, 4096), "div")
    quantize_activation_triton(_e(64, 4096), "recip")
    quantize_weight_triton(_e(1024, 12288))
    for name, (K, widths) in SHAPES.items():
        N = sum(widths)
        q, sw = _e(N, K, dtype=FP8), torch.empty(N)
        for M in M_REPS:
            x = _e(M, K)
            slots = torch.arange(M) % (S + 1) - 1                 # some tokens without adapter
            meta = build_lora_meta(slots, S)
            A = [_e(S, r, K) for _ in widths]
            B = [_e(S, n, r) for n in widths]
            h = torch.empty(len(widths), M, r)
            lora_shrink_triton(x, A, meta, quant="div")
            lora_gemm_triton(x, q, sw, h=h, B=B, meta=meta, g=torch.empty(S, N), bias=_e(N))
            lora_gemm_triton(_e(M, K, dtype=FP8), q, sw, x_scale=torch.empty(M, 1), h=h, B=B, meta=meta)
            lora_gemm_triton(x, q, sw)
            lora_gemm_triton(_e(M, K, dtype=FP8), q, sw, x_scale=torch.empty(M, 1))
            if M in (1, 64, 2048):        # one adapter: the epilogue without the slot pipeline
                meta1 = build_lora_meta(torch.zeros(M, dtype=torch.long), 1)
                B1 = [_e(1, n, r) for n in widths]
                lora_gemm_triton(x, q, sw, h=h, B=B1, meta=meta1)
                lora_gemm_triton(_e(M, K, dtype=FP8), q, sw, x_scale=torch.empty(M, 1), h=h, B=B1, meta=meta1)
        # the training linear at 8x1024 tokens: forward (no metadata) and backward dx (transposed codes)
        T = 8192
        x, dy = _e(T, K), _e(T, N)
        A1, B1 = _e(r, K), _e(N, r)
        lora_shrink_triton(x, A1[None], None)
        lora_gemm_triton(x, q, sw, h=torch.empty(1, T, r), B=B1[None])
        lora_gemm_triton(dy, q.t(), None, h=torch.empty(1, T, r), B=A1.t()[None])
        dy_prep_triton(dy, torch.empty(N), _e(N, r))
        norm_pieces_triton(q, sw, torch.empty(384, K))                 # DoRA's norm pieces (bf16x2)
        col_dot_triton(dy, dy)                                         # DoRA's dm column dot


def _tma_orientation_and_widening_launches(r: int = 64) -> None:
    """TMA loads, the tokens-on-M orientation, the dx GEMM variants, the tuned 64-token config, cvt."""
    # TMA weight loads (a tuning option) at three buckets, both modes
    K, N = 4096, 6144
    q, sw = _e(N, K, dtype=FP8), torch.empty(N)
    for M in (16, 64, 2048):
        for xx, xs in ((_e(M, K), None), (_e(M, K, dtype=FP8), torch.empty(M, 1))):
            mode = "w8a8" if xs is not None else "w8a16"
            cfg = dataclasses.replace(gemm_config(mode, M, N, K), w_tma=True)
            lora_gemm_triton(xx, q, sw, x_scale=xs, config=cfg)
            lora_gemm_triton(xx, q, sw, x_scale=xs, config=dataclasses.replace(cfg, x_tma=True, swap_ab=False))
            lora_gemm_triton(xx, q, sw, x_scale=xs, config=dataclasses.replace(cfg, x_tma=True, swap_ab=True))
    # the other main-loop orientation (tokens on the MMA's M side, weight tile through shared memory) with
    # the four-codes-per-register widening, at decode, small-prefill and training sizes, with one adapter
    for M in (16, 64, 2048):
        meta1 = build_lora_meta(torch.zeros(M, dtype=torch.long), 1)
        for xx, xs in ((_e(M, K), None), (_e(M, K, dtype=FP8), torch.empty(M, 1))):
            mode = "w8a8" if xs is not None else "w8a16"
            cfg = dataclasses.replace(gemm_config(mode, M, N, K), swap_ab=False, widen="prmt")
            lora_gemm_triton(xx, q, sw, x_scale=xs, config=cfg)
            lora_gemm_triton(xx, q, sw, x_scale=xs, h=torch.empty(1, M, r), B=_e(1, N, r), meta=meta1,
                             config=cfg)
    cfg = dataclasses.replace(gemm_config("w8a16", 8192, K, N, transposed=True), swap_ab=False)
    lora_gemm_triton(_e(8192, N), q.t(), None, h=torch.empty(1, 8192, r),
                     B=_e(r, K).t()[None], config=cfg)
    for swap in (True, False):                    # the dx GEMM with TMA on the stored codes and on gy
        cfg = dataclasses.replace(gemm_config("w8a16", 8192, K, N, transposed=True), swap_ab=swap, w_tma=True,
                                  x_tma=not swap)
        lora_gemm_triton(_e(8192, N), q.t(), None, h=torch.empty(1, 8192, r), B=_e(r, K).t()[None], config=cfg)
    # the 64-token config the H200 tuner chose, with one adapter (a register budget the compile test checks)
    meta1 = build_lora_meta(torch.zeros(64, dtype=torch.long), 1)
    for xx, xs in ((_e(64, K), None), (_e(64, K, dtype=FP8), torch.empty(64, 1))):
        lora_gemm_triton(xx, q, sw, x_scale=xs, h=torch.empty(3, 64, r),
                         B=[_e(1, 4096, r), _e(1, 1024, r), _e(1, 1024, r)], meta=meta1,
                         config=GemmConfig(64, 64, 128, 4, 8, 4, 4))
    # Triton's own widening (GemmConfig.widen="cvt"), for the comparison with the bit-trick widening
    cfg = dataclasses.replace(gemm_config("w8a16", 16, N, K), widen="cvt")
    lora_gemm_triton(_e(16, K), q, sw, config=cfg)


def _rank_and_pdl_launches(r: int = 64) -> None:
    """Other LoRA ranks and the PDL variants."""
    # other ranks, PDL variants
    K, N = 4096, 4096
    x, q, sw = _e(16, K), _e(N, K, dtype=FP8), torch.empty(N)
    meta = build_lora_meta(torch.arange(16) % 3 - 1, 2)
    for rr in (16, 128):
        lora_shrink_triton(x, _e(2, rr, K), meta)
        lora_gemm_triton(x, q, sw, h=torch.empty(1, 16, rr), B=_e(2, N, rr), meta=meta)
    lora_shrink_triton(x, _e(2, r, K), meta, quant="div", use_pdl=True)
    lora_gemm_triton(x, q, sw, h=torch.empty(1, 16, r), B=_e(2, N, r), meta=meta, use_pdl=True)
    K, widths = SHAPES["qkv"]
    q, sw = _e(sum(widths), K, dtype=FP8), torch.empty(sum(widths))
    # W8A8 decode (knob k2_quant_x_tokens): K2 quantizes x itself, alone and as K1's dependent (K1 only shrinks)
    for M in (1, 16):
        x, meta = _e(M, K), build_lora_meta(torch.zeros(M, dtype=torch.long), 2)
        A, B = [_e(2, r, K)] * 3, [_e(2, w, r) for w in widths]
        for rounding in ("div", "recip"):
            lora_gemm_triton(x, q, sw, quantize_x=rounding)
        so = lora_shrink_triton(x, A, meta, out=torch.empty(3, M, r), use_pdl=True)
        lora_gemm_triton(x, q, sw, h=so.h, B=B, meta=meta, use_pdl=True, x_from_primary=False, quantize_x="div")
        # knob pdl_quant_k2: W8A8 without an adapter, K2 as the quantizer's dependent (L2 prefetch, early wait)
        xq, xs = quantize_activation_triton(x, "div", use_pdl=True)
        lora_gemm_triton(xq, q, sw, x_scale=xs, use_pdl=True)
        # knobs k1_decode_rank_block / k1_mask_x_rows: K1 in 16-rank programs at decode sizes (with and without PDL),
        # its padding rows' x loads masked
        saved = set_knobs(k1_decode_rank_block=16)
        try:
            lora_shrink_triton(x, A, meta, out=torch.empty(3, M, r), use_pdl=True)
            set_knobs(k1_mask_x_rows=True)
            lora_shrink_triton(x, A, meta, quant="div", out=torch.empty(3, M, r))
            set_knobs(k1_decode_rank_block=0)
            lora_shrink_triton(x, A, meta, out=torch.empty(3, M, r), use_pdl=True)
        finally:
            restore_knobs(saved)
    # the engine projection's decode pairs (K1 -> K2 by PDL) in both modes: qkv (3 slices), split-K shrinks (the
    # timeline test compiles the last four launches: these)
    for M in (1, 64):
        x, meta = _e(M, K), build_lora_meta(torch.zeros(M, dtype=torch.long), 2)
        A, B = [_e(2, r, K)] * 3, [_e(2, w, r) for w in widths]
        for quant in ("div", None):
            so = lora_shrink_triton(x, A, meta, quant=quant, out=torch.empty(3, M, r), use_pdl=True)
            lora_gemm_triton(x if quant is None else _e(M, K, dtype=FP8), q, sw,
                             x_scale=None if quant is None else torch.empty(M, 1), h=so.h, B=B, meta=meta,
                             use_pdl=True)
        # W8A8 with x quantized before K1 (knob pdl_w8a8_quant=separate): K2 waits only before its epilogue
        lora_gemm_triton(_e(M, K, dtype=FP8), q, sw, x_scale=torch.empty(M, 1), h=so.h, B=B, meta=meta,
                         use_pdl=True, x_from_primary=False)


def _k1_in_k2_launches(r: int = 64) -> None:
    """Knob k1_in_k2: K1's programs in K2's grid at decode sizes, every projection, W8A16 (plain launch) and W8A8
    (the quantizer's dependent: early wait, L2 prefetch)."""
    for name, (K, widths) in SHAPES.items():
        q, sw = _e(sum(widths), K, dtype=FP8), torch.empty(sum(widths))
        for M in (1, 16):
            x, meta = _e(M, K), build_lora_meta(torch.zeros(M, dtype=torch.long), 2)
            A, B = [_e(2, r, K)] * len(widths), [_e(2, w, r) for w in widths]
            progs = shrink_programs(x, A, meta, out=torch.empty(len(widths), M, r))
            lora_gemm_triton(x, q, sw, h=progs.out.h, B=B, meta=meta, shrink=progs)
            progs = shrink_programs(x, A, None, out=torch.empty(len(widths), M, r), mode="w8a8")
            lora_gemm_triton(_e(M, K, dtype=FP8), q, sw, x_scale=torch.empty(M, 1), h=progs.out.h,
                             B=[b[:1] for b in B], shrink=progs, use_pdl=True)


def _prefetch_epilogue_launches(r: int = 64) -> None:
    """Knob k2_prefetch_epilogue: K2 at decode sizes with its epilogue's scales, slots and first B tile loaded ahead
    of the epilogue (each place: before the main loop, after it, split), every projection at 1 and 16 tokens with
    the H200's decode configs (the tuned table's; W8A16 also the batch-invariant one, its engine default), one
    adapter through metadata (the per-slot epilogue), W8A8 (the quantizer's codes) and W8A16, K1's programs in the
    grid and K2 as K1's programmatic dependent."""
    for where in K2_PREFETCH_EPILOGUE[1:]:
        saved = set_knobs(k2_prefetch_epilogue=where)
        try:
            _prefetch_epilogue_place(r)
        finally:
            restore_knobs(saved)


def _prefetch_epilogue_place(r: int) -> None:
    """_prefetch_epilogue_launches at the knob's current place."""
    for name, (K, widths) in SHAPES.items():
        N = sum(widths)
        q, sw = _e(N, K, dtype=FP8), torch.empty(N)
        for M in (1, 16):
            x, meta = _e(M, K), build_lora_meta(torch.zeros(M, dtype=torch.long), 2)
            A, B = [_e(2, r, K)] * len(widths), [_e(2, w, r) for w in widths]
            for mode in ("w8a16", "w8a8"):
                xx, xs = (x, None) if mode == "w8a16" else (_e(M, K, dtype=FP8), torch.empty(M, 1))
                configs = [gemm_config(mode, M, N, K, "cuda")]
                if mode == "w8a16":
                    configs.append(invariant_gemm_config(mode, M, N, K, "cuda"))
                for cfg in configs:
                    progs = shrink_programs(x, A, meta, out=torch.empty(len(widths), M, r), mode=mode)
                    lora_gemm_triton(xx, q, sw, x_scale=xs, h=progs.out.h, B=B, meta=meta, shrink=progs,
                                     use_pdl=mode == "w8a8", config=cfg)
                    lora_gemm_triton(xx, q, sw, x_scale=xs, h=progs.out.h, B=B, meta=meta, use_pdl=True,
                                     x_from_primary=False, config=cfg)


def _tuned_table_launches(S: int = 4, r: int = 64) -> None:
    """Every entry of a tuned table, if one exists for the GPU named by the knob tuned_gpu (RLFP8_TUNED_GPU)."""
    for key, entry in _tuned_table("cuda").items():
        mode, bucket, K, ncls = key.split("|")
        K, M = int(K), min(int(bucket), 4096)
        N = 4096 if ncls == "narrow" else 24576
        xx = _e(M, K, dtype=FP8 if mode == "w8a8" else BF16)
        if mode == "w8a8" and M <= 16:                # the engine's decode calls: K2 quantizes bf16 x itself
            lora_gemm_triton(_e(M, K), _e(N, K, dtype=FP8), torch.empty(N), quantize_x="div",
                             config=GemmConfig(**entry))
        if mode == "w8a16T":                          # the training backward's dx GEMM (transposed codes)
            T = 8192
            lora_gemm_triton(_e(T, K), _e(K, N, dtype=FP8).t(), None, h=torch.empty(1, T, r),
                             B=_e(r, N).t()[None], config=GemmConfig(**entry))
            continue
        lora_gemm_triton(xx, _e(N, K, dtype=FP8), torch.empty(N), x_scale=torch.empty(M, 1) if mode == "w8a8"
                         else None, h=torch.empty(1, M, r), B=_e(S, N, r),
                         meta=build_lora_meta(torch.arange(M) % S, S), config=GemmConfig(**entry))


def _invariant_launches(S: int = 4, r: int = 64) -> None:
    """K2 with the batch-invariant configs an H200 picks (invariant_gemm_config on device "cuda") that no tuner
    measured (its candidates compiled): engine-style at those buckets, and the trainer's 8192-token forward
    where the Gluon loop cannot take the shape's schedule."""
    for K, widths in SHAPES.values():
        N = sum(widths)
        q, sw = _e(N, K, dtype=FP8), torch.empty(N)
        B = [_e(S, n, r) for n in widths]
        sched = reduction_schedule("w8a16", N, K)
        for M in M_REPS:
            if _measured_candidate("w8a16", M, N, K, sched, "cuda") is None:
                meta = build_lora_meta(torch.arange(M) % (S + 1) - 1, S)
                cfg = invariant_gemm_config("w8a16", M, N, K, "cuda")
                lora_gemm_triton(_e(M, K), q, sw, h=torch.empty(len(widths), M, r), B=B, meta=meta, config=cfg)
        if sched != GLUON_SCHEDULE:
            lora_gemm_triton(_e(8192, K), q, sw, h=torch.empty(1, 8192, r), B=_e(1, N, r),
                             config=invariant_gemm_config("w8a16", 8192, N, K, "cuda"))


LARGE_RANK_ROLES = ("fwd", "fwd_g", "dgrad", "shrink", "dy_prep", "eng1", "engN")
H200 = torch.device("cuda")          # only names the device whose configs to pick; nothing runs on it


def h200_w8a16_config(M: int, N: int, K: int, rank: int, transposed: bool = False):
    """(config, path): the W8A16 config lora_gemm_triton picks on an H200 (tuned table through the knob tuned_gpu,
    the batch-invariant schedule), fitted to its shared memory at this rank, and the main loop the dispatch would
    run there (gluon_rs where gemm_rs can take the call; it is not compiled from here)."""
    from rlfp8.kernels import gemm_triton
    from rlfp8.kernels.gemm_configs import SM90_MAX_SMEM, fit_smem, same_sums
    from rlfp8.kernels.gemm_rs import MAX_RANK
    q = _e(K, N, dtype=FP8).t() if transposed else _e(N, K, dtype=FP8)
    cfg, invariant = gemm_triton._pick_config(None, "w8a16", M, N, K, q, H200)
    gluon = M > 512 and rank <= MAX_RANK and (not invariant or same_sums(cfg, GLUON_SCHEDULE, K))
    return fit_smem(cfg, "w8a16", rank, SM90_MAX_SMEM), "gluon_rs" if gluon else "triton"


def large_rank_launch(role: str, N: int, K: int, r: int, M: int = 4096) -> str:
    """One launch of the training linear at (N out, K in), rank r, M tokens, with the H200's configs (issue 16):
    fwd / fwd_g (K2 forward, DoRA's g), dgrad (K2 on qᵀ, A_cᵀ as the epilogue's B), shrink (K1), dy_prep, and the
    engine's K2 with metadata at 256 tokens, one adapter (eng1: per-slot loop) or four (engN: PIPE_SLOTS).
    Returns the main loop an H200 would run for K2 (gluon_rs or triton)."""
    q, sw = _e(N, K, dtype=FP8), torch.empty(N)
    if role in ("fwd", "fwd_g"):
        cfg, path = h200_w8a16_config(M, N, K, r)
        lora_gemm_triton(_e(M, K), q, sw, h=torch.empty(1, M, r), B=_e(1, N, r),
                         g=torch.empty(1, N) if role == "fwd_g" else None, config=cfg)
        return path
    if role == "dgrad":                  # the GEMM runs over N: x = gy [M, N], weight qᵀ [K, N]
        cfg, path = h200_w8a16_config(M, K, N, r, transposed=True)
        lora_gemm_triton(_e(M, N), q.t(), None, h=torch.empty(1, M, r), B=_e(r, K).t()[None], config=cfg)
        return path
    if role == "shrink":
        lora_shrink_triton(_e(M, K), _e(1, r, K), None)
    elif role == "dy_prep":
        dy_prep_triton(_e(M, N), torch.empty(N), _e(N, r))
    else:
        Me, S = 256, 1 if role == "eng1" else 4
        cfg, _ = h200_w8a16_config(Me, N, K, r)
        lora_gemm_triton(_e(Me, K), q, sw, h=torch.empty(1, Me, r), B=_e(S, N, r),
                         meta=build_lora_meta(torch.arange(Me) % S, S), config=cfg)
    return "triton"


def _large_rank_launches() -> None:
    """The training linear at ranks 384 and 512 on bench/dora.py's 8192 x 8192 (the compile test: no spills)."""
    for r in (384, 512):
        for role in LARGE_RANK_ROLES:
            large_rank_launch(role, 8192, 8192, r)


GLUON_FWD_VARIANTS = ((64, False, False), (16, True, False), (64, False, True), (96, False, False),
                      (384, True, True), (512, False, False))       # (rank, bias, DoRA g) of the forward
GLUON_DX_RANKS = (64, 128, 384)


def _gluon_launches() -> list:
    """The Gluon main loop K2 dispatches to at many tokens (gemm_rs: bf16 x, no metadata), its launch arguments:
    the trainer's forward (LoRA ranks 16/64 in one piece, 96/384/512 in rank chunks; with bias; with DoRA's g),
    the dx GEMM (ranks 64, 128, 384), the base GEMM. The second shape only for the rank <= 64 variants."""
    rec = []
    from rlfp8.kernels import gemm_rs
    T = 8192
    for K, N in ((4096, 6144), (12288, 4096)):
        q, sw = _e(N, K, dtype=FP8), torch.empty(N)
        first = not rec
        for r, bias, g in GLUON_FWD_VARIANTS:
            if first or (r <= 64 and not g):
                rec.append(gemm_rs.launch_args(_e(T, K), q, sw, torch.empty(1, T, r), _e(1, N, r),
                                               _e(N) if bias else None, _e(T, N), torch.empty(1, N) if g else None))
        for r in GLUON_DX_RANKS if first else GLUON_DX_RANKS[:1]:
            rec.append(gemm_rs.launch_args(_e(T, N), q.t(), None, torch.empty(1, T, r), _e(r, K).t()[None],
                                           None, _e(T, K)))
        rec.append(gemm_rs.launch_args(_e(T, K), q, sw, out=_e(T, N)))
    return rec


def _distinct(rec: list) -> list:
    """One launch per (kernel, constexprs and options)."""
    seen, out = set(), []
    for kern, grid, args, kw in rec:
        key = (kern.fn.__name__, tuple(sorted((k, str(v)) for k, v in kw.items())))
        if key not in seen:
            seen.add(key)
            out.append((kern, grid, args, kw))
    return out


def _cuda_tool(name: str) -> str | None:
    import triton
    p = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return p if os.path.exists(p) else None


def _sass_facts(cubin: bytes, idx: int) -> dict:
    """Registers, spill stack and the instruction mix of the MMA main loop(s), from the cubin (cuobjdump is
    bundled with Triton). Main loop = a backward branch whose body contains an HGMMA/QGMMA/HMMA."""
    import subprocess
    import tempfile
    tool = _cuda_tool("cuobjdump")
    if tool is None:
        return {}
    with tempfile.NamedTemporaryFile(suffix=f"_{idx}.cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    out = {}
    m = re.search(r"REG:(\d+) STACK:(\d+)", res)
    if m:
        out.update(regs=int(m.group(1)), stack=int(m.group(2)))
    ins = []
    for ln in sass.splitlines():
        mm = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", ln)
        if mm:
            ins.append((int(mm.group(1), 16), mm.group(2)))
    where = {a: i for i, (a, _) in enumerate(ins)}
    loop_ops: dict[str, int] = {}
    waits: set[int] = set()
    for i, (a, t) in enumerate(ins):
        mb = re.search(r"BRA\s.*?0x([0-9a-f]+)", t)
        if mb and int(mb.group(1), 16) < a and int(mb.group(1), 16) in where:
            text = [b for _, b in ins[where[int(mb.group(1), 16)]:i + 1]]
            body = [re.sub(r"^@!?U?P\w+\s+", "", b).split()[0].split(".")[0] for b in text]
            if any(op in ("HGMMA", "QGMMA", "HMMA") for op in body):
                for op in body:
                    loop_ops[op] = loop_ops.get(op, 0) + 1
                waits |= {int(v, 16) for b in text for v in re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", b)}
    out["mma_loop_f2f"] = loop_ops.get("F2F", 0)
    out["mma_loop_wgmma_waits"] = sorted(waits)
    out["mma_loop_ops"] = sum(loop_ops.values())
    return out


def _ptxas_facts(ptx: str, idx: int) -> dict:
    """ptxas's "wgmma serialized" performance warnings (C7510-C7519: register reuse, accumulators defined
    outside wgmma, register shortage) and the wgmma wait depths in the SASS (WARPGROUP.DEPBAR.LE gsb0, N):
    a pipelined main loop keeps one wgmma group in flight (N = 1); a serialized one waits for 0 everywhere."""
    import subprocess
    import tempfile
    tool = _cuda_tool("ptxas")
    if tool is None:
        return {}
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, f"k{idx}.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([tool, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
        sass = subprocess.run([_cuda_tool("cuobjdump"), "-sass", os.path.join(d, "k.cubin")], capture_output=True,
                              text=True).stdout
    text = log.stdout + log.stderr
    smem_a = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln and re.search(r"\}, %rd\d+, %rd\d+", ln)]
    return dict(wgmma_serialized=sorted(set(re.findall(r"C751\d", text))),
                wgmma_wait_depths=sorted(set(int(v, 16) for v in re.findall(r"DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass))),
                wgmma_smem_a=len(smem_a))


def _check(item):
    idx, spec = item
    t0 = time.time()
    try:
        k = tu.compile_spec(spec)
    except Exception as e:  # report, the test fails on it
        return dict(idx=idx, name=spec["name"], ok=False, error=f"{type(e).__name__}: {str(e)[:3000]}")
    ptx = k.asm["ptx"]
    wg = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
    facts = _sass_facts(k.asm["cubin"], idx)
    if spec["name"] == "_lora_gemm_rs_kernel":
        facts.update(_ptxas_facts(ptx, idx))
    return dict(**facts,
        idx=idx, name=spec["name"], ok=True, seconds=round(time.time() - t0, 2),
        shared=k.metadata.shared, num_warps=k.metadata.num_warps, num_stages=spec["options"].get("num_stages"),
        wgmma=bool(wg),
        wgmma_reg_a=any(re.search(r"\}, \{%r", ln) for ln in wg if ".bf16.bf16" in ln or ".f16.f16" in ln),
        mma_sync="mma.sync" in ptx, div_rn="div.rn.f32" in ptx, div_full="div.full.f32" in ptx,
        div_approx=bool(re.search(r"div\.approx|rcp\.approx|ex2\.approx", ptx)),
        widen_bits="fma.rn.bf16x2" in ptx and "cvt.rn.f16x2.e4m3x2" in ptx,
        widen_prmt="mul.rn.bf16x2" in ptx and "prmt.b32" in ptx and "cvt.rn.f16x2.e4m3x2" not in ptx,
        cvt_e4m3="cvt.rn.satfinite.e4m3x2.f32" in ptx, gdc_wait="griddepcontrol.wait" in ptx,
        gdc_launch="griddepcontrol.launch_dependents" in ptx, tma="cp.async.bulk.tensor" in ptx,
        l2_prefetch="cp.async.bulk.prefetch.L2" in ptx, globaltimer="%globaltimer" in ptx,
        launch_pdl=bool(spec["options"].get("launch_pdl")),
        cubin_bytes=len(k.asm["cubin"]))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args(argv)
    t0 = time.time()
    launches = collect()
    specs = []
    for idx, (kern, grid, args, kw) in enumerate(launches):
        spec = tu.jit_spec(kern, args, kw)
        named = {kern.arg_names[i[0]]: v for i, v in spec["constexprs"].items()}
        specs.append((idx, spec, named, grid))
    print(json.dumps(dict(event="collected", kernels=len(specs), seconds=round(time.time() - t0, 2))), flush=True)
    with ProcessPoolExecutor(max_workers=a.jobs) as pool:
        for res, (idx, spec, named, grid) in zip(pool.map(_check, [(i, s) for i, s, _, _ in specs]), specs):
            res["constexprs"] = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
                                 for k, v in named.items()}
            res["grid"] = list(grid)
            print(json.dumps(res), flush=True)
    print(json.dumps(dict(event="done", seconds=round(time.time() - t0, 2))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
