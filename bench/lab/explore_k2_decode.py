#!/usr/bin/env python
"""Exploration: where K2's W8A16 time goes at 64 tokens, the one acceptance line of issue 3 that still fails
(W8A16 base GEMM <= 1.15x our W8A8: qkv 1.24, o 1.21 on the H200).

Two instruments, each on copies of the package kernel (rlfp8/kernels/gemm_triton.py) that differ from it by one
textual edit (asserted to apply, so a kernel change breaks this script loudly instead of measuring something
else), run with the tuned W8A16 config of each Qwen3-8B projection at 64 tokens:

1. Ablations, timed side by side with the package W8A16 and W8A8 calls (CUDA graphs replayed in turn, L2
   flushed before each replay, median of --reps):
     orig     the package kernel (same bits as lora_gemm_triton)
     xonce    the x tile loaded once before the main loop: what streaming x costs (wrong results)
     wonce    the weight tile loaded once before the loop; Triton hoists its widening with it: what the whole
              weight path costs (TMA from DRAM, 2-byte LDS, widening) (wrong results)
     nowiden  the PRMT widening cut to its PRMT: what the widening ALU costs (wrong values)
     wsame    program n reads the weight tiles of tile row n % 8: the same TMA loads, LDS and widening, but
              the bytes come from L2 instead of DRAM (wrong results)
     kint     split-K programs take interleaved k-steps (s, s + S, ...) instead of contiguous ranges, so the
              S programs of a tile stream each weight row together (correct, other rounding)
     pf2      an L2 prefetch (prefetch.global.L2) of each weight row 2 k-steps ahead (correct, same bits)
     nofence  the split-K counter atomic relaxed instead of acq_rel: what the fence costs (unsafe ordering)
     noexchange  no split-K exchange at all: the tile's last split runs the epilogue on its own partial
              (no partial stores, atomics or reloads): what the exchange costs (wrong results)
     nostore / noreload / noatomic  one part of the exchange removed: the partial stores; the reducer's
              reloads (it keeps its own partial); the counter atomic (split S-1 reduces without waiting)
              (wrong results)
2. Timeline: %clock64 per program at its start, at each main-loop iteration, after the loop, before and after
   the split-K counter atomic, at its end, and %globaltimer at start and end (one launch after an L2 flush,
   several repeats), for the W8A16 and W8A8 configs: loop time, per-iteration time, the split-K arrival and
   reduction, and per tile the time from its last main loop's end to the reducing program's end.

    python bench/lab/explore_k2_decode.py --compile-only     # CPU: every copy compiles for sm_90a; main-loop SASS
    python bench/lab/explore_k2_decode.py --out bench/results/explore_k2_decode_h200.json      # H200, ~1 min
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

SRC = ROOT / "rlfp8" / "kernels" / "gemm_triton.py"
PROJ = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
M_TOKENS = 64
ARMS = ("orig", "xonce", "wonce", "nowiden", "wsame", "kint", "pf2", "nofence", "noexchange", "nostore",
        "noreload", "noatomic")
MAX_ITERS = 64                      # timeline slots per program for main-loop iterations

LOOP = "    for k in range(k_lo, k_hi, BLOCK_K):\n"
X_LOAD = "            xt = x_ptr.load([pid_m * BLOCK_M, k])                 # [BM, BK], zero beyond M and K\n"
W_LOAD = "            w = w_ptr.load([pid_n * BLOCK_N, k])                  # out-of-range rows/cols read as 0\n"
PRMT_X2 = 'E4M3X2_TO_BF16_PTX = tl.constexpr("""'
SPLIT_HEAD = "    # ---- split-K: the partials are added in split order, by the tile's last program (all its tokens) or,\n"
ATOMIC = '        tl.debug_barrier()\n        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")\n'
NOT_LAST = "        elif done != SPLIT_K - 1:\n            return\n"
RESET = '        if not DIST_RED:\n            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")\n'
STORE_Y = "    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])\n"
SIG_TAIL = "    part_ptr, cnt_ptr,\n    k1_x_ptr,"
LAUNCH_TAIL = "part, cnt, *k1_args,"
KEEP_DEF = "@triton.jit\ndef _keep(x):"
DIST_DEFAULT = "    dist_red = (knobs().k2_dist_red and "

HELPERS = '''@triton.jit
def _sreg64(p, name: tl.constexpr):
    return tl.inline_asm_elementwise("mov.u64 $0, " + name + ";", "=l,r", [p], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _sreg32(p, name: tl.constexpr):
    return tl.inline_asm_elementwise("mov.u32 $0, " + name + ";", "=r,r", [p], dtype=tl.int32, is_pure=False,
                                     pack=1)


@triton.jit
def _rec(t, pid, smid, g0, c0, c1, ca, c2, c3, last, r2):
    b = t + pid * 12
    tl.store(b + 0, smid.to(tl.int64))
    tl.store(b + 1, g0)
    tl.store(b + 2, c0)
    tl.store(b + 3, c1)
    tl.store(b + 4, ca)
    tl.store(b + 5, c2)
    tl.store(b + 6, c3)
    tl.store(b + 7, _sreg64(pid, "%globaltimer"))
    tl.store(b + 8, last + 0 * pid.to(tl.int64))
    tl.store(b + 9, r2)


@triton.jit
def _clock_after(pid, x):
    """%clock64 read once every element of x is in registers (a CTA-wide sum it depends on: ~200 cycles)."""
    return _sreg64(pid + tl.where(tl.sum(tl.sum(x, 1), 0) == 1.2345e30, 1, 0), "%clock64")


@triton.jit
def _pf(p):
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32,
                                     is_pure=False, pack=1)


'''


def _edit(src: str, old: str, new: str) -> str:
    if src.count(old) != 1:
        raise SystemExit(f"explore_k2_decode: the kernel changed, this edit no longer applies:\n{old}")
    return src.replace(old, new)


def variant_source(arm: str) -> str:
    """gemm_triton.py (with widen.py inlined) as an importable stand-alone module, with the arm's edit ("timed": the timeline)."""
    from bench.lab.k2_ab import standalone_source
    s = standalone_source(SRC.read_text())
    s = _edit(s, KEEP_DEF, HELPERS + KEEP_DEF)
    # the arms edit the last-program split-K reduction these measurements were taken with (the package now
    # distributes the reduction at 64 tokens on the GPU: bench/results/k2_ab_split_k_distributed_h200.json)
    s = _edit(s, DIST_DEFAULT, "    dist_red = (False and ")
    if arm == "xonce":
        s = _edit(s, LOOP, "    if X_TMA:\n        xt0 = x_ptr.load([pid_m * BLOCK_M, k_lo])\n" + LOOP)
        s = _edit(s, X_LOAD, "            xt = xt0\n")
    elif arm == "wonce":
        s = _edit(s, LOOP, "    if W_TMA == 1:\n        w0 = w_ptr.load([pid_n * BLOCK_N, k_lo])\n" + LOOP)
        s = _edit(s, W_LOAD, "            w = w0\n")
    elif arm == "nowiden":
        i = s.index(PRMT_X2)
        j = s.index('""")', i)
        s = s[:i] + PRMT_X2 + "prmt.b32 $0, $1, 0, 0x9180;" + s[j:]
    elif arm == "wsame":
        s = _edit(s, W_LOAD, "            w = w_ptr.load([(pid_n % 8) * BLOCK_N, k])\n")
    elif arm == "kint":
        s = _edit(s, "    k_lo = tl.multiple_of(pid_k * k_per, BLOCK_K)              # alignment hint: full-width "
                     "vector loads\n", "    k_lo = tl.multiple_of(pid_k * BLOCK_K, BLOCK_K)\n")
        s = _edit(s, "    k_hi = tl.minimum(K, k_lo + k_per)\n", "    k_hi = K\n")
        s = _edit(s, LOOP, "    for k in range(k_lo, k_hi, BLOCK_K * SPLIT_K):\n")
        s = _edit(s, "            w_ptrs += BLOCK_K * stride_wk\n", "            w_ptrs += BLOCK_K * SPLIT_K * stride_wk\n")
        s = _edit(s, "            x_ptrs += BLOCK_K * stride_xk\n", "            x_ptrs += BLOCK_K * SPLIT_K * stride_xk\n")
    elif arm == "pf2":
        s = _edit(s, SIG_TAIL, "    part_ptr, cnt_ptr, wraw_ptr,\n    k1_x_ptr,")
        s = _edit(s, LAUNCH_TAIL, "part, cnt, q, *k1_args,")
        s = _edit(s, LOOP, "    pf_rows = wraw_ptr + n_ld.to(tl.int64) * stride_wn\n"
                           "    for p in tl.static_range(2):\n"
                           "        _pf(pf_rows + tl.minimum(k_lo + p * BLOCK_K, k_hi - BLOCK_K))\n" + LOOP +
                  "        _pf(pf_rows + tl.minimum(k + 2 * BLOCK_K, k_hi - BLOCK_K))\n")
    elif arm == "nofence":
        s = _edit(s, ATOMIC, ATOMIC.replace('sem="acq_rel"', 'sem="relaxed"'))
    elif arm == "noexchange":
        i = s.index(SPLIT_HEAD)
        j = s.index(RESET, i) + len(RESET)
        s = s[:i] + SPLIT_HEAD + "    if SPLIT_K > 1:\n        if pid_k != SPLIT_K - 1:\n            return\n" + s[j:]
    elif arm == "nostore":
        s = _edit(s, "        tl.store(p_ptrs + pid_k * part_stride, acc)\n", "")
        # the reducer adds the reloads to its own partial, or the main loop would be dead code
        s = _edit(s, '        acc = tl.load(p_ptrs, cache_modifier=".cg")\n', '        acc += tl.load(p_ptrs, cache_modifier=".cg")\n')
    elif arm == "noreload":
        i = s.index('        acc = tl.load(p_ptrs, cache_modifier=".cg")\n')
        j = s.index(RESET, i)
        s = s[:i] + s[j:]
    elif arm == "noatomic":
        s = _edit(s, ATOMIC, "        done = pid_k\n")        # only split S-1 goes on, without waiting
    elif arm == "timed":
        s = _edit(s, SIG_TAIL, "    part_ptr, cnt_ptr, tbuf_ptr, it_off,\n    k1_x_ptr,")
        s = _edit(s, LAUNCH_TAIL, "part, cnt, TBUF, TBUF_ITERS_AT, *k1_args,")
        s = _edit(s, "    pid = tl.program_id(0)\n", "    pid = tl.program_id(0)\n    smid = _sreg32(pid, \"%smid\")\n"
                  "    g0 = _sreg64(pid, \"%globaltimer\")\n    c0 = _sreg64(pid, \"%clock64\")\n")
        s = _edit(s, LOOP, "    it = 0\n" + LOOP + "        tl.store(tbuf_ptr + it_off + pid * MAX_ITERS + it, "
                  "_sreg64(pid, \"%clock64\"), mask=it < MAX_ITERS)\n        it += 1\n")
        s = _edit(s, SPLIT_HEAD, "    c1 = _sreg64(pid, \"%clock64\")\n    ca = c1\n    c2 = c1\n    r2 = c1\n"
                  + SPLIT_HEAD)
        # the reducer: clock once all partials are in (reading it after the first one would serialize the
        # loads, which the compiler otherwise issues together)
        s = _edit(s, RESET, "        r2 = _clock_after(pid, acc)\n" + RESET)
        s = _edit(s, ATOMIC, "        tl.debug_barrier()\n        ca = _sreg64(pid, \"%clock64\")\n"
                  "        done = tl.atomic_add(cnt_ptr + tile, 1, sem=\"acq_rel\", scope=\"gpu\")\n"
                  "        c2 = _sreg64(pid, \"%clock64\")\n")
        s = _edit(s, NOT_LAST, "        elif done != SPLIT_K - 1:\n"
                  "            _rec(tbuf_ptr, pid, smid, g0, c0, c1, ca, c2, c2, 0, c2)\n            return\n")
        s = _edit(s, STORE_Y, STORE_Y + "    _rec(tbuf_ptr, pid, smid, g0, c0, c1, ca, c2, _sreg64(pid, \"%clock64\"), 1, r2)\n")
        s += f"\nMAX_ITERS = tl.constexpr({MAX_ITERS})\nTBUF = None\nTBUF_ITERS_AT = 0\n"
    elif arm != "orig":
        raise ValueError(arm)
    return s


def load_variant(arm: str):
    """Import the arm's copy of the kernel module."""
    from bench.lab.k2_ab import import_source
    return import_source(variant_source(arm), f"k2_{arm}")


# ------------------------------------------------------------------------------------------------ CPU: compile
def compile_only() -> list[dict]:
    from bench.lab.explore_gluon_w8a16 import histogram, main_loops, sass_listing
    from rlfp8.kernels.fp8 import FP8_DTYPE
    from rlfp8.kernels._triton_utils import collect_launches, compile_like_jit
    from rlfp8.kernels import gemm_configs as lg
    from rlfp8.kernels.gemm_triton import lora_gemm_triton
    rows = []
    N, K = PROJ["qkv"]
    for arm in ARMS + ("timed",):
        mod = load_variant(arm)
        cfg = mod.GemmConfig(**dataclasses.asdict(lg.GemmConfig(64, 64, 128, 4, 8, 4, 3, w_tma=True, widen="prmt",
                                                                 swap_ab=True, x_tma=True)))
        x = torch.empty(M_TOKENS, K, dtype=torch.bfloat16)
        q = torch.empty(N, K, dtype=FP8_DTYPE)
        if arm == "timed":
            mod.TBUF = torch.empty(16, dtype=torch.int64)
        with collect_launches() as rec:
            mod.lora_gemm_triton(x, q, torch.empty(N), config=cfg)
        kernel, _, kargs, kwargs = rec[0]
        ck = compile_like_jit(kernel, kargs, kwargs)
        loops = main_loops(sass_listing(ck.asm["cubin"]))
        mma = loops.get("mma", [])
        rows.append(dict(arm=arm, smem=ck.metadata.shared, main_loop_instructions=len(mma),
                         main_loop=histogram(mma)))
        print(f"{arm:8s} smem {ck.metadata.shared:6d}  main loop {len(mma):4d} instr  {histogram(mma)}", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------ GPU
def _problem(N, K, g):
    from rlfp8.kernels.fp8_triton import quantize_activation_triton, quantize_weight_triton
    q, sw = quantize_weight_triton(torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * .02)
    x = torch.randn(M_TOKENS, K, device="cuda", dtype=torch.bfloat16, generator=g)
    xq, xs = quantize_activation_triton(x)
    return q, sw, x, xq, xs


def ablations(reps: int) -> dict:
    from bench.kernels import Timer
    from rlfp8.kernels import gemm_configs as lg
    from rlfp8.kernels.gemm_triton import lora_gemm_triton
    timer = Timer(reps)
    mods = {arm: load_variant(arm) for arm in ARMS}
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, configs = [], {}
    for proj, (N, K) in PROJ.items():
        q, sw, x, xq, xs = _problem(N, K, g)
        cfg = lg.gemm_config("w8a16", M_TOKENS, N, K, "cuda")
        configs[proj] = dataclasses.asdict(cfg)
        fns = {"package_w8a8": lambda: lora_gemm_triton(xq, q, sw, x_scale=xs),
               "package_w8a16": lambda: lora_gemm_triton(x, q, sw)}
        for arm, mod in mods.items():
            c = mod.GemmConfig(**dataclasses.asdict(cfg))
            fns[arm] = lambda mod=mod, c=c: mod.lora_gemm_triton(x, q, sw, config=c)
        ref = fns["package_w8a16"]().float()
        outs = {n: f() for n, f in fns.items()}
        times = dict(zip(fns, timer.paired_us(list(fns.values()))))
        for n in fns:
            y = outs[n].float()
            rows.append(dict(proj=proj, M=M_TOKENS, arm=n, us=round(times[n], 2),
                             vs_w8a8=round(times[n] / times["package_w8a8"], 3),
                             vs_package_w8a16=round(times[n] / times["package_w8a16"], 3),
                             same_bits_as_package=None if n == "package_w8a8" else bool(torch.equal(y, ref)),
                             rel_err_vs_package=None if n == "package_w8a8" else
                             round(((y - ref).norm() / ref.norm()).item(), 6)))
            print(rows[-1], flush=True)
    return dict(rows=rows, w8a16_configs=configs)


def _pct(a, qs=(0, 50, 90, 100)):
    import numpy as np
    return [round(float(v), 2) for v in np.percentile(np.asarray(a, dtype=float), qs)]


def timeline(repeats: int = 5) -> dict:
    import numpy as np
    from rlfp8.kernels import gemm_configs as lg
    from rlfp8.kernels.gemm_triton import lora_gemm_triton
    mod = load_variant("timed")
    g = torch.Generator(device="cuda").manual_seed(1)
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    out = {}
    for proj in ("qkv", "o"):
        N, K = PROJ[proj]
        q, sw, x, xq, xs = _problem(N, K, g)
        for mode in ("w8a16", "w8a8"):
            cfg = mod.GemmConfig(**dataclasses.asdict(lg.gemm_config(mode, M_TOKENS, N, K, "cuda")))
            grid = -(-M_TOKENS // cfg.block_m) * -(-N // cfg.block_n) * cfg.split_k
            mod.TBUF = torch.zeros(grid * (12 + MAX_ITERS), dtype=torch.int64, device="cuda")
            mod.TBUF_ITERS_AT = grid * 12
            args = (x, q, sw) if mode == "w8a16" else (xq, q, sw)
            kw = {} if mode == "w8a16" else dict(x_scale=xs)
            ref = lora_gemm_triton(*args, **kw)
            runs = []
            for _ in range(repeats + 1):
                mod.lora_gemm_triton(*args, config=cfg, **kw)
                torch.cuda.synchronize()
                flush.zero_()
                torch.cuda.synchronize()
                y = mod.lora_gemm_triton(*args, config=cfg, **kw)
                torch.cuda.synchronize()
                assert torch.equal(y, ref), "the timed copy must give the package kernel's bits"
                t = mod.TBUF.cpu().numpy()
                runs.append((t[:grid * 12].reshape(grid, 12).copy(), t[grid * 12:].reshape(grid, MAX_ITERS).copy()))
            summ = []
            for rec, its in runs[1:]:
                smid, g0, c0, c1, ca, c2, c3, gend, last, r2 = rec[:, :10].T
                base = g0.min()
                f_hz = float(np.median((c3 - c0) / ((gend - g0) * 1e-9)))     # SM clock, from the two counters
                n_it = int((its[0] != 0).sum())
                d_it = np.diff(np.concatenate([c0[:, None], its[:, :n_it], c1[:, None]], 1), axis=1)
                loop_end_us = (g0 - base) / 1e3 + (c1 - c0) / f_hz * 1e6
                end_us = (gend - base) / 1e3
                tiles = grid // cfg.split_k
                tail = [end_us.reshape(tiles, -1)[i][last.reshape(tiles, -1)[i] == 1].max()
                        - loop_end_us.reshape(tiles, -1)[i].max() for i in range(tiles)]
                summ.append(dict(kernel_end_us=round(float(end_us.max()), 2), last_loop_end_us=round(float(loop_end_us.max()), 2),
                                 loop_cycles=_pct(c1 - c0), iterations=n_it,
                                 iteration_cycles_median=np.median(d_it, 0).round(0).tolist(),
                                 iteration_cycles_p90=np.percentile(d_it, 90, axis=0).round(0).tolist(),
                                 store_cycles=_pct(ca - c1), atomic_cycles=_pct(c2 - ca),
                                 reduce_epilogue_cycles_reducer=_pct((c3 - c2)[last == 1]),
                                 reload_cycles_reducer=_pct((r2 - c2)[last == 1]),
                                 epilogue_cycles_reducer=_pct((c3 - r2)[last == 1]),
                                 tile_tail_us=_pct(tail), programs_per_sm=np.bincount(np.bincount(smid.astype(int))).tolist()))
            out[f"{proj}_{mode}"] = dict(config=dataclasses.asdict(cfg), grid=grid, runs=summ)
            s = summ[-1]
            print(f"{proj} {mode}: end {s['kernel_end_us']} us, last loop end {s['last_loop_end_us']} us, tile tail "
                  f"{s['tile_tail_us']} us, loop {s['loop_cycles']} cyc, per iteration {s['iteration_cycles_median']}, "
                  f"reducer: reloads {s['reload_cycles_reducer']}, epilogue {s['epilogue_cycles_reducer']} cyc",
                  flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "explore_k2_decode_h200.json"))
    a = ap.parse_args()
    t0 = time.time()
    meta = dict(command=" ".join([Path(sys.executable).name] + sys.argv), torch=torch.__version__,
                triton=triton.__version__, date=datetime.datetime.now().isoformat(timespec="seconds"))
    if a.compile_only:
        compile_only()
        return
    if not torch.cuda.is_available():
        raise SystemExit("explore_k2_decode: needs a GPU (or --compile-only)")
    meta.update(gpu=torch.cuda.get_device_name(), reps=a.reps, tokens=M_TOKENS, arms=ARMS)
    res = dict(meta, ablations=ablations(a.reps), timeline=timeline(), seconds=None)
    res["seconds"] = round(time.time() - t0, 1)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print("wrote", a.out)


if __name__ == "__main__":
    main()
