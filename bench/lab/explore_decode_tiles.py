#!/usr/bin/env python
"""Which K2 tiles stream the weights fastest at decode sizes (M <= 16 tokens)? A sweep outside the tuner's
candidate space, on the Qwen3-8B projections (issue 15: the W8A8 layer at M <= 16 against CUTLASS; issue 13:
time per token without LoRA at batch 1).

Why: at M = 1 our W8A8 K2 streams gate_up at ~2.5 TB/s and o at ~1.3 TB/s (kernels_h200.json), CUTLASS about
the same, the H200 ~4.8. The tuner's decode candidates all read 64+ weight rows per program in 128-256-byte
row chunks (wgmma needs 64 rows on its M side) and reach 4096-wide weights only through split-K. Two levers
it never tried: (1) tokens on the MMA's M side (swap_ab=False; below 64 tokens Triton runs mma.sync), which
frees BLOCK_N down to 16 rows, so narrow weights get >= 128 programs without split-K; (2) long row chunks
(BLOCK_K 512-1024 bytes), which DRAM pages serve better than 128-byte pieces of many rows.
W8A16 keeps swap_ab and its batch-invariant split (the matched property), so only its BLOCK_K, stages and
warps are swept there, and every candidate must give the invariant config's bits (wgmma issues the k16 steps
in k order into one accumulator whatever BLOCK_K groups them into; the shares' boundaries are the same where
K is a multiple of SPLIT_K x BLOCK_K): this checks that claim on the GPU.

First, the knob k2_mask_x_rows A/B on the package's default configs (`mask_x_rows_ab`). Then per (mode,
projection, M): the package's own choice ("default": tuned / invariant), every candidate (output
checked: W8A8 within 1e-2 of the default's max, W8A16 bit for bit), then the three fastest re-timed against the
default as paired CUDA graphs (L2 flushed before each replay), and for W8A8 torch._scaled_mm (cuBLASLt,
row-wise scales) in the same pairs. Kernels are compiled up front in parallel.

    python bench/lab/explore_decode_tiles.py --out bench/results/explore_decode_tiles_h200.json   # H200, ~4 min
    python bench/lab/explore_decode_tiles.py --list        # the candidates per mode and N class (no GPU)
    python bench/lab/explore_decode_tiles.py --mask-ab-only --out /tmp/mask.json           # H200, ~20 s
"""
from __future__ import annotations

import argparse
import dataclasses
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

import kernel_bench as kb  # noqa: E402  (Timer)

from rlfp8.kernels import _triton_utils as tu  # noqa: E402
from rlfp8.kernels import gemm_configs as lg  # noqa: E402
from rlfp8.kernels.gemm_configs import GemmConfig  # noqa: E402

PROJ = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}   # (K, N)
MS = (1, 4, 16)
SMEM_CAP = 200 * 1024
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def _smem(c: GemmConfig, mode: str) -> int:
    return lg.smem_bytes(c, mode, 0)


def w8a8_candidates(N: int, K: int) -> list[GemmConfig]:
    """Tokens on M (mma.sync below 64 tokens) with 16-64 weight rows and long row chunks; and swap_ab tiles of
    64 rows with 512-byte chunks. Split-K 1 and 2 (4 where a 64-row tile leaves < 1 wave)."""
    out = []
    for bn, bk in ((16, 512), (16, 1024), (32, 256), (32, 512), (32, 1024), (64, 256), (64, 512)):
        for nw in (4,) if bn > 16 else (2, 4):
            for ns in (3, 4, 6):
                for split in (1, 2):
                    for tma in (False, True):
                        c = GemmConfig(bn, 16, bk, split, 8, nw, ns, w_tma=tma, swap_ab=False)
                        if _smem(c, "w8a8") <= SMEM_CAP and K // (split * bk) >= 2:
                            out.append(c)
    for bn, bk in ((64, 512), (64, 1024), (128, 256), (128, 512)):
        for ns in (3, 4, 6):
            for split in (1, 2, 4):
                for tma in (False, True):
                    c = GemmConfig(bn, 16, bk, split, 8, 4, ns, w_tma=tma, swap_ab=True)
                    if _smem(c, "w8a8") <= SMEM_CAP and K // (split * bk) >= 2:
                        out.append(c)
    return out


def w8a16_candidates(N: int, K: int) -> list[GemmConfig]:
    """swap_ab tiles with the invariant split of this weight shape and BLOCK_K from the schedule's up to 1024
    (only where the shares' boundaries stay the schedule's: gemm_configs.same_sums)."""
    sched = lg.reduction_schedule("w8a16", N, K)
    out = []
    for bn in (64, 128):
        for bk in (sched.block_k, 256, 512, 1024):
            c0 = GemmConfig(64, 16, bk, sched.split_k)
            if bk < sched.block_k or not lg.same_sums(c0, sched, K) or K // (sched.split_k * bk) < 2:
                continue
            for ns in (3, 4, 6):
                for widen in ("bits", "prmt"):
                    for tma in (False, True):
                        c = GemmConfig(bn, 16, bk, sched.split_k, 8, 4, ns, w_tma=tma, widen=widen, swap_ab=True)
                        if _smem(c, "w8a16") <= SMEM_CAP:
                            out.append(c)
    return out


CANDIDATES = {"w8a8": w8a8_candidates, "w8a16": w8a16_candidates}


class Bench:
    def __init__(self, reps: int):
        from rlfp8.kernels.fp8_triton import quantize_activation_triton, quantize_weight_triton
        g = torch.Generator(device="cuda").manual_seed(0)
        self.reps = reps
        self.timer = kb.Timer(reps)
        self.w, self.x, self.xq = {}, {}, {}
        for name, (K, N) in PROJ.items():
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
            self.w[name] = quantize_weight_triton(w)
            del w
        for M in MS:
            for K in {k for k, _ in PROJ.values()}:
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
                self.x[(M, K)] = x
                self.xq[(M, K)] = quantize_activation_triton(x)
        self.quantize_activation = quantize_activation_triton

    def fn(self, mode, name, M, config=None):
        from rlfp8.kernels.gemm_triton import lora_gemm_triton
        K, _ = PROJ[name]
        q, sw = self.w[name]
        if mode == "w8a8":
            xq, xs = self.xq[(M, K)]
            return lambda: lora_gemm_triton(xq, q, sw, x_scale=xs, config=config)
        x = self.x[(M, K)]
        return lambda: lora_gemm_triton(x, q, sw, config=config)

    def scaled_mm(self, name, M):
        K, _ = PROJ[name]
        q, sw = self.w[name]
        xq, xs = self.xq[(M, K)]
        sw2 = sw[None, :].contiguous()
        return lambda: torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=sw2, out_dtype=torch.bfloat16)

    def quant(self, name, M):
        x = self.x[(M, PROJ[name][0])]
        return lambda: self.quantize_activation(x)

    def paired_us(self, fns, reps=None) -> list[float]:
        return [round(t, 2) for t in self.timer.paired_us(fns, reps or self.reps)]


def precompile(bench: Bench, modes) -> dict:
    with tu.collect_launches() as rec:
        for mode in modes:
            for name, (K, N) in PROJ.items():
                for c in CANDIDATES[mode](N, K):
                    bench.fn(mode, name, 1, c)()
    return tu.precompile(rec, jobs=os.cpu_count() or 8)


def explore(bench: Bench, mode: str, deadline: float) -> list[dict]:
    rows = []
    for name, (K, N) in PROJ.items():
        cands = CANDIDATES[mode](N, K)
        for M in MS:
            if time.time() > deadline:
                log(f"budget: stop before {mode} {name} M={M}")
                return rows
            ref = bench.fn(mode, name, M)()
            torch.cuda.synchronize()
            default_us = bench.paired_us([bench.fn(mode, name, M)], reps=bench.reps // 2)[0]
            timed, bad = [], []
            for c in cands:
                try:
                    out = bench.fn(mode, name, M, c)()
                    if mode == "w8a16":
                        ok = torch.equal(out, ref)
                    else:
                        ok = bool((out.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max())
                    if not ok:
                        bad.append(c.key())
                        continue
                    us = bench.paired_us([bench.fn(mode, name, M, c)], reps=bench.reps // 2)[0]
                    timed.append((us, c))
                except Exception as e:          # noqa: BLE001 - a config that does not compile or launch
                    bad.append(list(c.key()) + [f"{type(e).__name__}: {str(e)[:120]}"])
            timed.sort(key=lambda t: t[0])
            top = [c for _, c in timed[:3]]
            arms = [bench.fn(mode, name, M)] + [bench.fn(mode, name, M, c) for c in top]
            if mode == "w8a8":
                arms.append(bench.scaled_mm(name, M))
            try:
                paired = bench.paired_us(arms)
            except Exception as e:              # noqa: BLE001 - _scaled_mm may refuse a shape
                log(f"paired timing without _scaled_mm ({type(e).__name__}: {e})")
                paired = bench.paired_us(arms[:1 + len(top)]) + [None]
            row = {"mode": mode, "proj": name, "M": M, "N": N, "K": K,
                   "default_config": list(_default_config(mode, M, N, K).key()), "default_us": paired[0],
                   "default_alone_us": default_us,
                   "top": [{"config": list(c.key()), "us": us} for us, c in
                           zip(paired[1:1 + len(top)], top)],
                   "sweep_best": [{"config": list(c.key()), "us": us} for us, c in timed[:8]],
                   "candidates": len(cands), "rejected": bad[:20], "rejected_count": len(bad)}
            if mode == "w8a8":
                row["scaled_mm_us"] = paired[-1]
                row["quant_us"] = bench.paired_us([bench.quant(name, M)], reps=bench.reps // 2)[0]
            best = min([row["default_us"]] + [t["us"] for t in row["top"]])
            row["best_over_default"] = round(best / row["default_us"], 3)
            gbs = N * K / (best * 1e-6) / 1e9
            row["best_weight_gb_s"] = round(gbs, 1)
            log(f"{mode} {name:7s} M={M:2d}: default {row['default_us']:6.2f} us, best {best:6.2f} "
                f"({row['best_over_default']:.3f}x, {gbs:5.0f} GB/s) {row['top'][0]['config'] if row['top'] else ''}"
                + (f", _scaled_mm {row['scaled_mm_us']}" if mode == "w8a8" else "")
                + f"; {len(bad)} rejected")
            rows.append(row)
    return rows


def _with_mask_knob(on: bool, fn):
    """fn run with the knob k2_mask_x_rows set (a CUDA graph captures the launch the knob chose)."""
    from rlfp8.kernels.knobs import restore_knobs, set_knobs

    def run():
        saved = set_knobs(k2_mask_x_rows=on)
        try:
            return fn()
        finally:
            restore_knobs(saved)
    return run


def mask_rows_ab(bench: Bench) -> list[dict]:
    """The package's default configs with the knob k2_mask_x_rows off (padding token rows of a decode tile re-read
    row 0, as before) and on (they load nothing): the same bits, paired timing."""
    rows = []
    for mode in ("w8a8", "w8a16"):
        for name, (K, N) in PROJ.items():
            for M in MS:
                fns = {on: _with_mask_knob(on, bench.fn(mode, name, M)) for on in (False, True)}
                outs = {on: f() for on, f in fns.items()}
                us = dict(zip((False, True), bench.paired_us([fns[False], fns[True]])))
                row = {"mode": mode, "proj": name, "M": M, "unmasked_us": us[False], "masked_us": us[True],
                       "ratio": round(us[True] / us[False], 3), "same_bits": bool(torch.equal(outs[False], outs[True]))}
                log(f"mask_x_rows {mode} {name:7s} M={M:2d}: {us[False]:6.2f} -> {us[True]:6.2f} us "
                    f"({row['ratio']:.3f}x), same bits {row['same_bits']}")
                rows.append(row)
    return rows


def _default_config(mode, M, N, K):
    if lg.batch_invariant(mode):
        return lg.invariant_gemm_config(mode, M, N, K, "cuda")
    return lg.gemm_config(mode, M, N, K, "cuda")


def layer_summary(rows) -> list[dict]:
    out = []
    for mode in ("w8a8", "w8a16"):
        for M in MS:
            sel = [r for r in rows if r["mode"] == mode and r["M"] == M]
            if len(sel) != len(PROJ):
                continue
            d = sum(r["default_us"] for r in sel)
            b = sum(min([r["default_us"]] + [t["us"] for t in r["top"]]) for r in sel)
            item = {"mode": mode, "M": M, "default_us": round(d, 2), "best_us": round(b, 2),
                    "ratio": round(b / d, 3)}
            if mode == "w8a8" and all(r.get("scaled_mm_us") for r in sel):
                item["scaled_mm_us"] = round(sum(r["scaled_mm_us"] for r in sel), 2)
                item["quant_us"] = round(sum(r["quant_us"] for r in sel), 2)
            out.append(item)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "explore_decode_tiles_h200.json"))
    ap.add_argument("--modes", default="w8a8,w8a16")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--list", action="store_true", help="print the candidates per mode and projection, run nothing")
    ap.add_argument("--mask-ab-only", action="store_true", help="only the knob k2_mask_x_rows A/B on the defaults")
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    if a.list:
        for mode in modes:
            for name, (K, N) in PROJ.items():
                cands = CANDIDATES[mode](N, K)
                print(mode, name, len(cands), [c.key() for c in cands[:3]], "...")
        return 0
    import triton
    bench = Bench(a.reps)
    mask_ab = mask_rows_ab(bench)
    info, rows = {"kernels": 0, "seconds": 0, "errors": []}, []
    if not a.mask_ab_only:
        info = precompile(bench, modes)
        log(f"precompiled {info['kernels']} kernels in {info['seconds']} s ({len(info['errors'])} failed)")
        deadline = T0 + a.budget_s
        for mode in modes:
            rows += explore(bench, mode, deadline)
    result = {"command": " ".join([Path(sys.executable).name] + sys.argv), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__,
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "reps": a.reps,
              "precompile": {k: v for k, v in info.items() if k != "errors"}, "precompile_errors": info["errors"][:10],
              "layer": layer_summary(rows), "rows": rows, "mask_x_rows_ab": mask_ab}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    for item in result["layer"]:
        log(f"layer {item}")
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
