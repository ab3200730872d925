#!/usr/bin/env python
"""Exploration: where K2's adapter cost goes at decode sizes (issue 15: the layer with one rank-64 adapter
<= 1.06x our no-adapter layer; the H100 measured ~1.10, ~2.5-3 us per projection, session 21).

K2 alone, one launch per CUDA graph (no quantizer: W8A8 takes x's codes, as the engine's compiled graph gives
them), one rank-64 adapter on every token with vLLM-style metadata, the tuned config of each Qwen3-8B
projection, both engine modes, the arms replayed in turn (L2 flushed before each replay, median of --reps):

    base         no adapter
    lora         the adapter's epilogue, h computed beforehand (what the epilogue costs, K1 aside)
    lora_bf16    ... with lora_precision="bf16" (one 16-bit MMA instead of two: what the second MMA costs)
    lora_<place> ... knob k2_prefetch_epilogue = before_loop (the epilogue's operands K1 does not write loaded
                 before the main loop, held across it), after_loop (right after it, before the split-K exchange and
                 the wait for h), split (scales and slots before, the B tile after)
    grid         K1's programs first in K2's grid, the epilogue waiting on their counter (the default decode path)
    grid_<place> ... with k2_prefetch_epilogue = place
    grid_countswap_split  a copy of the kernel counting itself past K1's wait the other way than the mode's default
                 (W8A8: one lane's atomic read at the end; W8A16: a scalar atomic at once), at place split
    grid_nowait  a copy of the kernel without the wait on K1's counter (racy: h may be stale; timing only): what
                 the wait costs
    grid_nowait_<place>  ... at place before_loop / split: the tail left when neither the wait nor the B tile's
                 load follows the main loop (what a wait without its own round trip could reach)
    grid_k1pf_split  a copy of the kernel whose K1 programs, once done, ask the projection's B (the slot of token
                 row 0, a share per program) into L2 with cp.async.bulk.prefetch.L2, at place split: whether the
                 epilogue's B loads after the main loop gain from hitting L2 (the GEMM programs' own per-column
                 prefetch delayed their main loop, session 24; Triton's pipelined cp.async loads drop eviction
                 hints, so the weights streamed meanwhile may still push B out of L2)
    split_xk1    (layer rows only) a lower bound on expand-in-K1 (bench/README.md session 25): K1's programs, once
                 done, compute h·Bᵀ for a share of the columns into an fp32 buffer while the main loop runs; the
                 GEMM programs neither wait on K1's counter nor load B, their epilogue adds their tile of it. Racy
                 (no wait for the whole h, no validity tag): timing only; its outputs are compared with the lora
                 arm within bf16 rounding (xk1_vs_lora), not bit for bit
    split_fp8ad  (layer rows only) the adapter's weights as FP8 e4m3 codes (half the bytes of bf16): K1's programs in
                 the grid widen A's codes to x's type before their MMA (a copy of K1), K2's epilogue widens B's
                 (the package's epilogue already does: B.to(bf16)); the launches get FP8 tensors in place of the bf16
                 adapters (fp8ad_launch). No scales: every arm's adapters are rounded to values e4m3 holds, so this
                 arm's outputs are compared with the split arm's bit for bit (a real design would fold per-rank
                 scales into h in K1). What halving the adapter's bytes buys at decode
    grid_wave16  K1 in the grid at place split with knob k1_in_k2_one_wave = w8a16 (the default before session 23:
                 W8A8 keeps its stages where K1's programs push the grid into a second wave)
    grid_rb32    ... with knob k1_decode_rank_block = 32 (twice K1's programs, each half the ranks)

First the layer as issue 15 reads it: the four projections through fp8_lora_linear with the default decode path
(quantizer, K1 in K2's grid, PDL), for each place of k2_prefetch_epilogue ("layer" rows: base, off, before_loop,
after_loop, split) and at place split with the countswap copy, the k1pf copy and with k1_in_k2_one_wave = w8a16.
Then per (mode, projection) every arm's µs, and the derived costs: epilogue = lora - base, K1 in the grid = grid -
lora, the other placement of the count past the wait = grid_countswap_split - grid_split; per mode the four
projections summed ("layer", K2 only). Outputs are checked against the package's lora arm (same bits where the arm
keeps the arithmetic).

    python bench/lab/explore_decode_epilogue.py --check-edits          # CPU: the copy's edit applies
    TRITON_INTERPRET=1 python bench/lab/explore_decode_epilogue.py --check-xk1   # CPU: the xk1 copy's sums (~1 min)
    TRITON_INTERPRET=1 python bench/lab/explore_decode_epilogue.py --check-fp8ad # CPU: the fp8ad copy's bits (~10 s)
    python bench/lab/explore_decode_epilogue.py --out bench/results/explore_decode_epilogue_h200.json   # ~2 min
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from pdl_timeline import MODES, MS, problems as layer_problems  # noqa: E402  (the layer bench/pdl_timeline.py times)

from rlfp8.kernels.knobs import K2_PREFETCH_EPILOGUE  # noqa: E402

SRC = ROOT / "rlfp8" / "kernels" / "gemm_triton.py"
VARIANTS = ("nowait", "countswap", "k1pf", "xk1", "fp8ad")
KNOB_ARMS = {"wave16": dict(k1_in_k2_one_wave="w8a16"), "rb32": dict(k1_decode_rank_block=32)}
PLACES = K2_PREFETCH_EPILOGUE[1:]       # every place but off
SAME_BITS = ({f"{k}_{p}": "lora" for k in ("lora", "grid") for p in PLACES} | {"grid": "lora"}
             | {"grid_wave16": "lora", "grid_rb32": "lora", "grid_countswap_split": "lora"}
             | {"grid_k1pf_split": "lora"})

K1_SPIN = ('        k1_done = tl.atomic_add(k1_sync_ptr, 0, sem="acquire", scope="gpu")\n'
           '        while k1_done < k1_programs:\n'
           '            k1_done = tl.atomic_add(k1_sync_ptr, 0, sem="acquire", scope="gpu")\n')
# variant countswap: the count past K1's wait placed the other way than the mode's default (gemm_triton's
# K1_THREADS: a scalar atomic at once for W8A8, one lane's atomic read at the program's end for W8A16)
COUNT_CHOICE = '32 * cfg.num_warps if mode == "w8a16" else 0, dummy)'
COUNT_SWAPPED = '0 if mode == "w8a16" else 32 * cfg.num_warps, dummy)'
# variant k1pf: K1's programs in the grid, once counted done, ask the projection's B (every slice, the slot of token
# row 0) into L2, a 4 KiB-aligned share each, while the GEMM programs stream their weights: the epilogue's B loads
# would then hit L2 instead of following the main loop to HBM (session 24: a per-column prefetch by the GEMM
# programs themselves cost more than it bought, it delayed their main loop)
K1_DONE = '            stamp(pid >= 0, K1_END, True)\n            return\n'
K1_DONE_PF = ('            stamp(pid >= 0, K1_END, True)\n'
              '            _k1_prefetch_b(pid, k1_programs, b0_ptr, b1_ptr, b2_ptr, slot_ptr, N, end0, end1,\n'
              '                           stride_bs0, stride_bs1, stride_bs2, stride_bn, N_SLICES, ALL_SLOT0)\n'
              '            return\n')
K1_PREFETCH_B = '''

@triton.jit
def _k1_prefetch_b(pid, programs, b0_ptr, b1_ptr, b2_ptr, slot_ptr, N, end0, end1, stride_bs0, stride_bs1, stride_bs2,
                   stride_bn, N_SLICES: tl.constexpr, ALL_SLOT0: tl.constexpr):
    slot = tl.full([], 0, tl.int32)
    if not ALL_SLOT0:
        slot = tl.load(slot_ptr).to(tl.int32)
    if slot >= 0:
        EL: tl.constexpr = b0_ptr.dtype.element_ty.primitive_bitwidth // 8
        for l in tl.static_range(N_SLICES):
            if l == 0:
                b = b0_ptr + slot.to(tl.int64) * stride_bs0
                rows = end0
            elif l == 1:
                b = b1_ptr + slot.to(tl.int64) * stride_bs1
                rows = end1 - end0
            else:
                b = b2_ptr + slot.to(tl.int64) * stride_bs2
                rows = N - end1
            nbytes = rows.to(tl.int64) * stride_bn * EL
            chunk = tl.cdiv(tl.cdiv(nbytes, programs), 4096) * 4096
            lo = pid * chunk
            hi = tl.minimum(nbytes, lo + chunk)
            for off in range(lo, hi, 65536):
                size = tl.minimum(hi - off, 65536).to(tl.int32)
                addr = (b + off // EL).to(tl.int64, bitcast=True)
                tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\\n mov.u32 $0, 0;", "=r,l,r",
                                          [addr, size], dtype=tl.int32, is_pure=False, pack=1)
'''
# variant xk1, a lower bound on session 25's expand-in-K1 design (racy: timing only): K1's programs, once done,
# compute the expand y = h·Bᵀ for a share of the projection's columns (B streamed while the GEMM's main loop runs)
# into an fp32 [M, N] buffer (passed as g_ptr, which these calls leave unused); the GEMM programs neither wait on
# K1's counter nor load B: their epilogue adds their y tile. Left out of the bound: K1's programs waiting for the
# whole h before their expand, and the validity tag the epilogue would check. One adapter (token row 0's slot),
# M <= 16. The y a replay reads is the previous replay's where a GEMM program gets there first (same inputs, same
# values): the outputs are compared with the lora arm within bf16 rounding, not bit for bit
K1_DONE_XK1 = ('            stamp(pid >= 0, K1_END, True)\n'
               '            _k1_expand(pid, k1_programs, h_ptr, b0_ptr, b1_ptr, b2_ptr, slot_ptr, g_ptr, M, N, R, end0,\n'
               '                       end1, stride_hl, stride_hm, stride_hr, stride_bs0, stride_bs1, stride_bs2, stride_bn,\n'
               '                       stride_br, N_SLICES, ALL_SLOT0, BLOCK_R)\n'
               '            return\n')
PREFETCH_B_DEF = "    PREFETCH_B: tl.constexpr = (PREFETCH_EPI != 0 and HAS_LORA"
PREFETCH_B_XK1 = "    PREFETCH_B: tl.constexpr = (not K1_PROGRAMS and PREFETCH_EPI != 0 and HAS_LORA"
EPILOGUE_LORA = "    if HAS_LORA:\n        if ALL_SLOT0:\n            slots = tl.where(m_ok, 0, -1)\n"
EPILOGUE_XK1 = ("    if K1_PROGRAMS:\n"
                "        acc += tl.load(g_ptr + rows64[None, :] * N + offs_n[:, None], mask=n_ok[:, None] & m_ok[None, :],\n"
                "                       other=0.0, cache_modifier=\".cg\")\n"
                "    elif HAS_LORA:\n        if ALL_SLOT0:\n            slots = tl.where(m_ok, 0, -1)\n")
K1_EXPAND = '''

@triton.jit
def _k1_expand(pid, programs, h_ptr, b0_ptr, b1_ptr, b2_ptr, slot_ptr, y_ptr, M, N, R, end0, end1, stride_hl,
               stride_hm, stride_hr, stride_bs0, stride_bs1, stride_bs2, stride_bn, stride_br,
               N_SLICES: tl.constexpr, ALL_SLOT0: tl.constexpr, BLOCK_R: tl.constexpr):
    XN: tl.constexpr = 128          # columns per step (slices start at multiples of it in the Qwen3 projections)
    XM: tl.constexpr = 16           # token rows (M <= 16)
    slot = tl.full([], 0, tl.int64)
    if not ALL_SLOT0:
        slot = tl.load(slot_ptr).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    offs_m = tl.arange(0, XM)
    m_ok = offs_m < M
    chunk = tl.cdiv(tl.cdiv(N, programs), XN) * XN
    lo = pid * chunk
    hi = tl.minimum(N, lo + chunk)
    for sl in tl.static_range(N_SLICES):                 # one loop per slice: one B load, one double buffer each
        if sl == 0:
            b_ptr = b0_ptr + slot * stride_bs0
            s_lo = 0
            s_hi = end0
        elif sl == 1:
            b_ptr = b1_ptr + slot * stride_bs1
            s_lo = end0
            s_hi = end1
        else:
            b_ptr = b2_ptr + slot * stride_bs2
            s_lo = end1
            s_hi = N
        for n0 in tl.range(tl.maximum(lo, s_lo), tl.minimum(hi, s_hi), XN, num_stages=2):
            offs_n = n0 + tl.arange(0, XN)
            n_ok = offs_n < tl.minimum(hi, s_hi)
            bt = tl.load(b_ptr + (offs_n - s_lo).to(tl.int64)[:, None] * stride_bn + offs_r[None, :] * stride_br,
                         mask=n_ok[:, None] & r_ok[None, :], other=0.0)                 # [XN, BLOCK_R]
            hT = tl.load(h_ptr + sl * stride_hl + offs_m[None, :] * stride_hm + offs_r[:, None] * stride_hr,
                         mask=m_ok[None, :] & r_ok[:, None], other=0.0)                  # [BLOCK_R, XM] fp32
            y = tl.dot(bt, hT.to(bt.dtype))                                              # [XN, XM] fp32
            tl.store(y_ptr + offs_m[None, :] * N + offs_n[:, None], y, mask=n_ok[:, None] & m_ok[None, :])
'''
# variant fp8ad: K1's programs (shrink_triton._shrink_program, imported by K2's module) from a copy of shrink_triton
# whose MMA widens A's tile to x's type (exact: every e4m3 value is a bf16 value); K2's epilogue takes FP8 B as is
SHRINK_SRC = ROOT / "rlfp8" / "kernels" / "shrink_triton.py"
K1_DOT = "            acc = tl.dot(xt, tl.trans(at), acc)"
K1_DOT_FP8 = "            acc = tl.dot(xt, tl.trans(at.to(xt.dtype)), acc)"
K1_IMPORT = "from rlfp8.kernels.shrink_triton import ShrinkPrograms, _shrink_program\n"
K1_IMPORT_FP8AD = "from rlfp8.kernels.shrink_triton import ShrinkPrograms\nfrom k1_fp8ad import _shrink_program\n"
APPENDED = {"k1pf": K1_PREFETCH_B, "xk1": K1_EXPAND}     # helpers a copy's edits call, added at the module's end
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def variant_source(arm: str) -> str:
    from bench.lab.k2_ab import standalone_source
    s = standalone_source(SRC.read_text())
    edits = {"nowait": [(K1_SPIN, "")], "countswap": [(COUNT_CHOICE, COUNT_SWAPPED)],
             "k1pf": [(K1_DONE, K1_DONE_PF)],
             "xk1": [(K1_SPIN, ""), (K1_DONE, K1_DONE_XK1), (PREFETCH_B_DEF, PREFETCH_B_XK1),
                     (EPILOGUE_LORA, EPILOGUE_XK1)],
             "fp8ad": [(K1_IMPORT, K1_IMPORT_FP8AD)]}[arm]
    return _edited(s, edits) + APPENDED.get(arm, "")


def _edited(s: str, edits) -> str:
    for old, new in edits:
        if s.count(old) != 1:
            raise SystemExit(f"explore_decode_epilogue: the kernel changed, this edit no longer applies:\n{old}")
        s = s.replace(old, new)
    return s


def k1_fp8ad_source() -> str:
    from bench.lab.k2_ab import standalone_source
    return _edited(standalone_source(SHRINK_SRC.read_text()), [(K1_DOT, K1_DOT_FP8)])


def load_variant(arm: str):
    from bench.lab.k2_ab import import_source
    if arm == "fp8ad":
        import_source(k1_fp8ad_source(), "k1_fp8ad")     # before K2's copy, which imports it
    return import_source(variant_source(arm), f"k2_epi_{arm}")


def projection_problem(x, q, sw, A, B, meta) -> dict:
    """One projection's K2 inputs: x, its codes and scale, the weights, the adapter and h per mode."""
    from rlfp8.kernels import fp8
    from rlfp8.kernels.shrink import lora_shrink
    xq, x_scale = fp8.quantize_activation(x, "div")
    h = {mode: lora_shrink(x, A, meta, mode=mode).h.clone() for mode in MODES}
    return dict(x=x, xq=xq, xs=x_scale, q=q, sw=sw, A=A, B=B, h=h, meta=meta)


def k2_x(p, mode):
    """(x, x_scale) as K2 takes them: W8A8 the codes and their scale, W8A16 x itself."""
    return (p["xq"], p["xs"]) if mode == "w8a8" else (p["x"], None)


def problems(M: int):
    """bench/pdl_timeline.py's layer at M tokens, with each projection's x codes and h computed beforehand; the
    adapters rounded to values FP8 e4m3 holds (for the fp8ad copy's bit comparison; the timings do not see values)."""
    out = {}
    for name, (xs, q, sw, A, B, metas) in layer_problems().items():
        round_to_e4m3_(*A, *B)
        out[name] = projection_problem(xs[M], q, sw, A, B, metas[M])
    return out


def round_to_e4m3_(*tensors) -> None:
    """Each tensor rounded in place to the nearest value FP8 e4m3 holds (kept in its own dtype)."""
    for t in tensors:
        t.copy_(t.to(torch.float8_e4m3fn).to(t.dtype))


def arm_fn(p, mode, arm, mods):
    """fn() launching K2 (and K1's programs in its grid for the grid arms) once."""
    from rlfp8.kernels import gemm_triton
    from rlfp8.kernels.knobs import restore_knobs, set_knobs
    from rlfp8.kernels.shrink_triton import shrink_programs
    name, _, var = arm.partition("_")
    variant, _, rest = var.partition("_")
    mod = mods[variant] if variant in VARIANTS else gemm_triton
    place = var if var in PLACES else rest if variant in VARIANTS and rest in PLACES else "off"
    knob_arm = KNOB_ARMS.get(var, {})
    if knob_arm:
        place = "split"
    x_in, xs = k2_x(p, mode)
    h_grid = torch.empty_like(p["h"][mode])

    def fn():
        saved = set_knobs(k2_prefetch_epilogue=place, **knob_arm)
        try:
            if name == "base":
                return mod.lora_gemm_triton(x_in, p["q"], p["sw"], x_scale=xs)
            if name == "lora":
                return mod.lora_gemm_triton(x_in, p["q"], p["sw"], x_scale=xs, h=p["h"][mode], B=p["B"],
                                            meta=p["meta"], lora_precision="bf16" if var == "bf16" else "bf16x2")
            sp = shrink_programs(p["x"], p["A"], p["meta"], out=h_grid, mode=mode)
            return mod.lora_gemm_triton(x_in, p["q"], p["sw"], x_scale=xs, h=h_grid, B=p["B"], meta=p["meta"],
                                        shrink=sp)
        finally:
            restore_knobs(saved)
    return fn


ARMS = (("base", "lora", "lora_bf16") + tuple(f"lora_{p}" for p in PLACES) + ("grid",)
        + tuple(f"grid_{p}" for p in PLACES) + ("grid_countswap_split", "grid_nowait", "grid_nowait_before_loop",
                                                "grid_nowait_split")
        + tuple(f"grid_{k}" for k in KNOB_ARMS)
        + ("grid_k1pf_split",))


def _precompile(calls, jobs: int, what: str) -> None:
    """Compile every kernel the calls launch, in parallel workers (their launches captured, not run)."""
    from rlfp8.kernels import _triton_utils as tu
    with tu.collect_launches() as rec:
        for call in calls:
            call()
    info = tu.precompile(rec, jobs=jobs)
    log(f"{what}: precompiled {info['kernels']} kernels in {info['seconds']} s, errors: {info['errors'][:2]}")


def run(reps: int, M: int, jobs: int, mods: dict) -> dict:
    """K2 alone per (mode, projection), every arm of ARMS; the four projections summed per mode."""
    from kernel_bench import Timer
    probs = problems(M)
    _precompile([arm_fn(p, mode, arm, mods) for mode in MODES for p in probs.values() for arm in ARMS], jobs,
                f"K2 alone, M={M}")
    timer = Timer(reps)
    rows = []
    for mode in MODES:
        for proj, p in probs.items():
            fns = [arm_fn(p, mode, a, mods) for a in ARMS]
            outs = {a: f().clone() for a, f in zip(ARMS, fns)}
            us = dict(zip(ARMS, timer.paired_us(fns)))
            same = {a: bool(torch.equal(outs[a], outs[ref])) for a, ref in SAME_BITS.items()}
            row = dict(mode=mode, proj=proj, M=M, us={a: round(v, 2) for a, v in us.items()}, same_bits=same,
                       epilogue_us=round(us["lora"] - us["base"], 2), k1_in_grid_us=round(us["grid"] - us["lora"], 2),
                       grid_over_base=round(us["grid"] / us["base"], 4),
                       count_swap_us=round(us["grid_countswap_split"] - us["grid_split"], 2))
            rows.append(row)
            log(f"{mode} {proj:8s} " + " ".join(f"{a} {v:.2f}" for a, v in us.items())
                + f" | not same bits: {[a for a, s in same.items() if not s]}")
    layer = []
    for mode in MODES:
        tot = {a: round(sum(r["us"][a] for r in rows if r["mode"] == mode), 2) for a in ARMS}
        layer.append(dict(mode=mode, M=M, us=tot, over_base={a: round(v / tot["base"], 4) for a, v in tot.items()}))
        log(f"{mode} layer (K2 only): " + " ".join(f"{a} {v / tot['base']:.3f}" for a, v in tot.items()))
    return dict(rows=rows, layer=layer)


LAYER_ARMS = ("base", "off") + PLACES + ("split_countswap", "split_wave16", "split_k1pf", "split_xk1", "split_fp8ad")
XK1_Y: dict = {}        # the xk1 copy's fp32 [16, N] expand buffer per (N, device), made outside any graph capture


def xk1_launch(mods):
    """gemm_triton.launch for the xk1 copy: its K1-in-grid launches get the expand buffer as g_ptr (HAS_G is
    off in these calls, so the package's host code passes a placeholder there)."""
    from rlfp8.kernels import _triton_utils as tu
    kernel = mods["xk1"]._lora_gemm_kernel
    out_at, g_at = kernel.arg_names.index("y_ptr"), kernel.arg_names.index("g_ptr")

    def launch(k, grid, *args, **kwargs):
        if k is kernel and kwargs.get("K1_PROGRAMS"):
            out = args[out_at]                          # the output [M, N]
            M, N = out.shape
            if M > 16:
                raise SystemExit(f"explore_decode_epilogue: the xk1 copy takes M <= 16 tokens, got {M}")
            y = XK1_Y.get((N, out.device))
            if y is None:
                y = XK1_Y[(N, out.device)] = torch.zeros(16, N, dtype=torch.float32, device=out.device)
            args = args[:g_at] + (y,) + args[g_at + 1:]
        return tu.launch(k, grid, *args, **kwargs)
    return launch


FP8_ADAPTERS: dict = {}     # data_ptr of a bf16 adapter tensor -> its FP8 e4m3 copy (fp8ad_launch's substitutes)
FP8AD_ARGS = ("b0_ptr", "b1_ptr", "b2_ptr", "k1_a0_ptr", "k1_a1_ptr", "k1_a2_ptr")


def fp8_adapters(probs) -> None:
    """Register FP8 copies of these projections' adapter weights (their values are e4m3 values: problems()), and
    only theirs: an earlier problem's tensors are gone and their addresses may be reused."""
    FP8_ADAPTERS.clear()
    for p in probs.values():
        for t in (*p["A"], *p["B"]):
            FP8_ADAPTERS[t.data_ptr()] = t.to(torch.float8_e4m3fn)


def fp8ad_launch(mods):
    """gemm_triton.launch for the fp8ad copy: every K2 launch must carry K1's programs (the decode path), and gets
    the FP8 copies of its adapter's A and B in place of the bf16 tensors the package's host code checked (same
    shapes, same element strides)."""
    from rlfp8.kernels import _triton_utils as tu
    kernel = mods["fp8ad"]._lora_gemm_kernel
    where = [kernel.arg_names.index(n) for n in FP8AD_ARGS]

    def as_fp8(t):
        f = FP8_ADAPTERS.get(t.data_ptr())
        if f is None:
            raise SystemExit(f"explore_decode_epilogue: no FP8 copy of the adapter tensor {tuple(t.shape)}")
        return f.as_strided(t.shape, t.stride())

    def launch(k, grid, *args, **kwargs):
        if k is kernel:
            if not kwargs.get("K1_PROGRAMS"):
                raise SystemExit("explore_decode_epilogue: the fp8ad arm's K2 launch has no K1 programs in its grid "
                                 "(knob k1_in_k2): K1's own kernel would read bf16 A")
            args = list(args)
            for i in where:
                args[i] = as_fp8(args[i])
        return tu.launch(k, grid, *args, **kwargs)
    return launch


COPY_LAUNCHES = {"xk1": xk1_launch, "fp8ad": fp8ad_launch}     # copies whose launches need more than the kernel


@contextlib.contextmanager
def launching(mod, launch):
    """mod.launch (the `launch` a K2 module's host code calls) replaced by `launch` inside the block."""
    saved, mod.launch = mod.launch, launch
    try:
        yield
    finally:
        mod.launch = saved


def layer_fn(probs, mode, arm, mods):
    """fn() running the four projections of one layer through rlfp8.kernels.fp8_lora_linear with the default
    knobs (the engine's decode path: quantizer, K1 in K2's grid, PDL) and k2_prefetch_epilogue = arm ("base": no
    adapter); split_<copy> (countswap, k1pf, xk1, fp8ad): at place split, K2 that copy's kernel (the launches go
    through the package's host code, and COPY_LAUNCHES' wrapper where the copy has one); split_wave16: at place
    split with k1_in_k2_one_wave = w8a16."""
    from rlfp8.kernels import gemm_triton
    from rlfp8.kernels.knobs import restore_knobs, set_knobs
    from rlfp8.kernels.projection import fp8_lora_linear
    place, _, var = arm.partition("_") if arm.startswith("split_") else (arm, "", "")
    knob_arm = KNOB_ARMS.get(var, {})

    def fn():
        saved = set_knobs(k2_prefetch_epilogue=place if place in PLACES else "off", **knob_arm)
        kernel, launch = gemm_triton._lora_gemm_kernel, gemm_triton.launch
        if var in VARIANTS:
            gemm_triton._lora_gemm_kernel = mods[var]._lora_gemm_kernel
        if var in COPY_LAUNCHES:
            gemm_triton.launch = COPY_LAUNCHES[var](mods)
        try:
            return [fp8_lora_linear(p["x"], p["q"], p["sw"], mode=mode) if arm == "base" else
                    fp8_lora_linear(p["x"], p["q"], p["sw"], p["A"], p["B"], p["meta"], mode=mode)
                    for p in probs.values()]
        finally:
            gemm_triton._lora_gemm_kernel, gemm_triton.launch = kernel, launch
            restore_knobs(saved)
    return fn


def fp8ad_vs_split(probs, mode, mods) -> dict[str, dict]:
    """Per projection: the fp8ad arm's output against the split arm's (the package's decode path with the bf16
    adapters holding the same e4m3 values): same bits, max |fp8ad - split| / max |split|, and the adapter's share
    max |split - base| / max |split| (what reading wrong adapter values would disturb)."""
    ref = layer_fn(probs, mode, "split", mods)()
    got = layer_fn(probs, mode, "split_fp8ad", mods)()
    base = layer_fn(probs, mode, "base", mods)()
    return {name: dict(same_bits=bool(torch.equal(r, g)), rel_diff=rel_to(g, r), adapter_share=rel_to(b, r))
            for name, r, g, b in zip(probs, ref, got, base)}


def xk1_vs_lora(probs, mode, mods) -> dict[str, float]:
    """Per projection of problems(M): max |xk1 - lora| / max |lora|, K2 alone. lora: the package's K2 with h
    computed beforehand; xk1: the copy with K1's programs in its grid writing a persistent h, its third call (an
    expand that runs before its launch's h is complete reads the last launch's h, and an epilogue that runs before
    its columns' expand reads the last launch's y: from the third call on both are the same values). A different
    summation order, rounded to bf16 once: <= ~1e-2; a wrong expand leaves out the adapter's share of the output."""
    from rlfp8.kernels.shrink_triton import shrink_programs
    mod = mods["xk1"]
    out = {}
    with launching(mod, xk1_launch(mods)):
        for name, p in probs.items():
            x_in, xs = k2_x(p, mode)
            h_grid = torch.zeros_like(p["h"][mode])
            for _ in range(3):
                sp = shrink_programs(p["x"], p["A"], p["meta"], out=h_grid, mode=mode)
                y = mod.lora_gemm_triton(x_in, p["q"], p["sw"], x_scale=xs, h=h_grid, B=p["B"], meta=p["meta"],
                                         shrink=sp)
            out[name] = rel_to(y, lora_ref(p, mode))
    return out


def lora_ref(p, mode):
    """The package's K2 with h computed beforehand (the lora arm)."""
    from rlfp8.kernels import gemm_triton
    x_in, xs = k2_x(p, mode)
    return gemm_triton.lora_gemm_triton(x_in, p["q"], p["sw"], x_scale=xs, h=p["h"][mode], B=p["B"], meta=p["meta"])


def rel_to(y, ref) -> float:
    """max |y - ref| / max |ref|."""
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


def small_problems(M: int, g, fp8_values: bool = False) -> dict:
    """Two small projections on the CPU (three slices of 128 / 256 / 128 columns, and one), rank 64, one adapter
    on every token; fp8_values: the adapters rounded to values FP8 e4m3 holds."""
    from rlfp8.kernels import fp8
    from rlfp8.kernels.metadata import build_lora_meta
    probs = {}
    for name, (K, widths) in {"qkv": (256, [128, 256, 128]), "down": (512, [256])}.items():
        q, sw = fp8.quantize_weight_ref(torch.randn(sum(widths), K, generator=g) * 0.02)
        A = [(torch.randn(1, 64, K, generator=g) * 0.02).to(torch.bfloat16) for _ in widths]
        B = [(torch.randn(1, n, 64, generator=g) * 0.05).to(torch.bfloat16) for n in widths]
        if fp8_values:
            round_to_e4m3_(*A, *B)
        x = torch.randn(M, K, generator=g).to(torch.bfloat16)
        probs[name] = projection_problem(x, q, sw, A, B, build_lora_meta(torch.zeros(M, dtype=torch.long), 1))
    return probs


def check_fp8ad_cpu() -> None:
    """The fp8ad copy under the CPU interpreter (small projections, M = 1 and 4, both modes): K1's programs in
    K2's grid and K2's epilogue reading FP8 adapter weights give the bits of the package's decode path on bf16
    adapters holding the same values; and the FP8 tensors were what the kernel read (a copy reading the bf16 ones
    would also match, so the check also runs it on FP8 copies of A and B scaled by 2: the adapter's share must
    quadruple)."""
    from tests import triton_interp_patch
    from rlfp8.kernels import dispatch, gemm_triton
    from rlfp8.kernels.shrink_triton import shrink_programs
    triton_interp_patch.apply()
    g = torch.Generator().manual_seed(1)
    mods = {"fp8ad": load_variant("fp8ad")}
    mod = mods["fp8ad"]
    for M in (1, 4):
        probs = small_problems(M, g, fp8_values=True)
        for mode in MODES:
            for name, p in probs.items():
                x_in, xs = k2_x(p, mode)

                def run(m):
                    sp = shrink_programs(p["x"], p["A"], p["meta"], out=torch.zeros_like(p["h"][mode]), mode=mode)
                    return m.lora_gemm_triton(x_in, p["q"], p["sw"], x_scale=xs, h=sp.out.h, B=p["B"],
                                              meta=p["meta"], shrink=sp)
                with dispatch.use_backend("triton"):
                    ref = run(gemm_triton)
                    base = gemm_triton.lora_gemm_triton(x_in, p["q"], p["sw"], x_scale=xs)
                    fp8_adapters({name: p})
                    with launching(mod, fp8ad_launch(mods)):
                        got = run(mod)
                        for t in (*p["A"], *p["B"]):             # A and B doubled: h·Bᵀ four times
                            FP8_ADAPTERS[t.data_ptr()] = (t.float() * 2).to(torch.float8_e4m3fn)
                        got4 = run(mod)
                share, share4 = (ref.float() - base.float()), (got4.float() - base.float())
                four = rel_to(share4, share * 4)
                log(f"fp8ad M={M} {mode} {name}: same bits {torch.equal(got, ref)}, 2x adapters: "
                    f"|share - 4 x share| / |4 x share| {four:.4f}")
                if not torch.equal(got, ref) or not four < 0.02:
                    raise SystemExit(f"explore_decode_epilogue: the fp8ad copy is off at M={M} {mode} {name}")
    log("fp8ad: same bits as the package's decode path; the kernel read the FP8 tensors")


def check_xk1_cpu() -> None:
    """The xk1 copy under the CPU interpreter on small projections (three slices of 128 / 256 / 128 columns, and
    one), M = 1 and 4, both modes: its output against the lora arm within bf16 rounding, where the adapter's share
    of the output (what a missing or misplaced expand would leave out) is far larger."""
    from tests import triton_interp_patch
    from rlfp8.kernels import dispatch, gemm_triton
    triton_interp_patch.apply()
    g = torch.Generator().manual_seed(0)
    mods = {"xk1": load_variant("xk1")}
    for M in (1, 4):
        probs = small_problems(M, g)
        for mode in MODES:
            with dispatch.use_backend("triton"):
                diff = xk1_vs_lora(probs, mode, mods)
                share = {}          # |lora - base| / |lora|: what a missing expand would leave out
                for name, p in probs.items():
                    x_in, xs = k2_x(p, mode)
                    base = gemm_triton.lora_gemm_triton(x_in, p["q"], p["sw"], x_scale=xs)
                    share[name] = rel_to(base, lora_ref(p, mode))
            log(f"xk1 M={M} {mode}: |xk1 - lora| / |lora| {diff}, the adapter's share {share}")
            bad = {n: d for n, d in diff.items() if not (d < 0.02 and share[n] > 0.1)}
            if bad:
                raise SystemExit(f"explore_decode_epilogue: the xk1 copy's output is off at M={M} {mode}: {bad}")
    log("xk1: outputs within bf16 rounding of the lora arm")


def layer_run(reps: int, M: int, jobs: int, mods: dict) -> list[dict]:
    """The layer as issue 15 reads it (bench/pdl_timeline.py's layer rows), per arm of K2's copies."""
    from kernel_bench import Timer
    probs = problems(M)
    fp8_adapters(probs)
    _precompile([layer_fn(probs, mode, arm, mods) for mode in MODES for arm in LAYER_ARMS], jobs,
                f"layer, M={M}")
    timer = Timer(reps)
    rows = []
    for mode in MODES:
        fns = [layer_fn(probs, mode, a, mods) for a in LAYER_ARMS]
        us = dict(zip(LAYER_ARMS, timer.paired_us(fns)))
        rows.append(dict(mode=mode, M=M, us={a: round(v, 2) for a, v in us.items()},
                         over_base={a: round(v / us["base"], 4) for a, v in us.items()},
                         xk1_vs_lora=xk1_vs_lora(probs, mode, mods),
                         fp8ad_vs_split=fp8ad_vs_split(probs, mode, mods)))
        log(f"{mode} layer M={M}: " + " ".join(f"{a} {v:.2f} ({v / us['base']:.3f})" for a, v in us.items()))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16], choices=MS)
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 4))
    ap.add_argument("--layer-only", action="store_true", help="only the layer rows (the engine's decode path)")
    ap.add_argument("--check-edits", action="store_true", help="build every copy's source (CPU) and stop")
    interpreter_checks = {"xk1": check_xk1_cpu, "fp8ad": check_fp8ad_cpu}
    for v in interpreter_checks:
        ap.add_argument(f"--check-{v}", action="store_true",
                        help=f"the {v} copy under the CPU interpreter, then stop (TRITON_INTERPRET=1)")
    a = ap.parse_args()
    for v, check in interpreter_checks.items():
        if getattr(a, f"check_{v}"):
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise SystemExit(f"explore_decode_epilogue: --check-{v} runs under the interpreter: TRITON_INTERPRET=1")
            return check()
    if a.check_edits:
        for v in VARIANTS:
            src = variant_source(v)
            compile(src, f"k2_epi_{v}.py", "exec")
            print(f"{v}: edit applies ({len(src)} chars)")
        return
    if not torch.cuda.is_available():
        raise SystemExit("explore_decode_epilogue: needs a GPU (or --check-edits)")
    mods = {v: load_variant(v) for v in VARIANTS}
    res = dict(meta=_meta(a), layer=[r for M in a.tokens for r in layer_run(a.reps, M, a.jobs, mods)])
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    if not a.layer_only:
        res["runs"] = [run(a.reps, M, a.jobs, mods) for M in a.tokens]
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
        log(f"wrote {a.out}")


def _meta(a):
    import triton
    import subprocess
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"), gpu=torch.cuda.get_device_name(),
                git=git.stdout.strip() or None,
                torch=torch.__version__, triton=triton.__version__, tuned_gpu=os.environ.get("RLFP8_TUNED_GPU"),
                command=" ".join(sys.argv), reps=a.reps, tokens=a.tokens)


if __name__ == "__main__":
    main()
