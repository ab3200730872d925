"""K2's W8A16 base GEMM at decode / short-prefill sizes: the Triton kernel against lora_gemm_rs's split-K Gluon
kernel (warp-specialized: a TMA warp feeds a ring, one MMA warpgroup widens the e4m3 rows into wgmma's A
fragment; the tile's split programs add their fp32 partials in split order, as K2 does), on the H200.

What it checks and measures, for the four Qwen3-8B projections (qkv 4096->6144, o 4096->4096, gate_up
4096->24576, down 12288->4096):
  * bits: the Gluon kernel's output equals the Triton kernel's with the same config (tuned table), at M = 64
    and at tails (33, 50), with and without bias: the property the dispatch relies on (a config with
    gluon=True runs its base-GEMM calls on Gluon, its LoRA / metadata calls on Triton: same bits, so the
    engine and the trainer still agree);
  * determinism: 30 repeated calls on unchanged inputs give the same bits;
  * time (CUDA graphs, L2 flushed before each replay, median of --reps, arms replayed in turn): Triton K2,
    Gluon variants (token tile, k-step, ring depth; other split factors, timed only), and our W8A8 GEMM
    (the acceptance baseline: W8A16 <= 1.15x our W8A8 at M <= 64).

    python bench/explore_gluon_split.py --out bench/results/explore_gluon_split_h200.json   # ~1 min on an H200
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import triton  # noqa: E402

import kernels as kb  # noqa: E402  (bench/kernels.py: Timer, PROJ)
from rlfp8.kernels import dispatch, lora_gemm as lg  # noqa: E402
from rlfp8.kernels.fp8_triton import quantize_activation_triton, quantize_weight_triton  # noqa: E402
from rlfp8.kernels import lora_gemm_rs as rs  # noqa: E402
from rlfp8.kernels.lora_gemm_rs import lora_gemm_rs_split, split_supported  # noqa: E402

DEV = "cuda"
# (token tile or None = the config's, k-step, ring depth, registers per thread at launch: the kernel runs 8 warps,
# 4 MMA + 1 TMA padded to two warpgroups, so 80 registers fit 3 programs per SM, 128 only 2)
VARIANTS = [(None, 64, 6, 128), (None, 64, 6, 80), (None, 64, 4, 80), (None, 128, 3, 80), (None, 128, 4, 80),
            (None, 64, 8, 80), (32, 64, 6, 80)]


def run_split(x, q, sw, cfg, bias=None, bm=None, bk=64, stages=6, regs=80):
    rs.SPLIT_LAUNCH_REGS = regs
    return lora_gemm_rs_split(x, q, sw, cfg, bias=bias, bk=bk, stages=stages, bm=bm)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--ms", default="64")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    t0 = time.time()
    g = torch.Generator(device=DEV).manual_seed(0)
    timer = kb.Timer(a.reps)
    out = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               command="python " + " ".join(sys.argv), date=datetime.datetime.now().isoformat(timespec="seconds"),
               reps=a.reps, bits=[], determinism=[], rows=[])
    for name, (K, widths) in kb.PROJ.items():
        N = sum(widths)
        w = torch.randn(N, K, device=DEV, dtype=torch.bfloat16, generator=g) * 0.02
        q, sw = quantize_weight_triton(w)
        del w
        bias = torch.randn(N, device=DEV, dtype=torch.bfloat16, generator=g)
        for M in (64, 33, 50):
            x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, generator=g)
            cfg = lg.gemm_config("w8a16", M, N, K, DEV)
            tri = dataclasses.replace(cfg, gluon=False)
            why = split_supported(x, q, cfg, has_lora=False, gather=False, has_g=False)
            for b in (None, bias):
                ref = lg.lora_gemm_triton(x, q, sw, bias=b, config=tri)
                rec = dict(op=name, M=M, bias=b is not None, config=list(tri.key()), unsupported=why)
                if why is None:
                    for bm, bk_, st, regs in VARIANTS:
                        if bm and bm > cfg.block_m:
                            continue
                        y = run_split(x, q, sw, cfg, b, bm, bk_, st, regs)
                        rec[f"bm{bm or cfg.block_m}_bk{bk_}_s{st}_r{regs}"] = bool(torch.equal(y, ref))
                out["bits"].append(rec)
                print(json.dumps(rec), flush=True)
        for M in [int(m) for m in a.ms.split(",")]:
            x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, generator=g)
            xq, xs = quantize_activation_triton(x)
            cfg = lg.gemm_config("w8a16", M, N, K, DEV)
            tri = dataclasses.replace(cfg, gluon=False)
            c8 = lg.gemm_config("w8a8", M, N, K, DEV)
            if split_supported(x, q, cfg, has_lora=False, gather=False, has_g=False) is None:
                ys = [run_split(x, q, sw, cfg) for _ in range(30)]
                n_bad = sum(not torch.equal(y, ys[0]) for y in ys)
                out["determinism"].append(dict(op=name, M=M, calls=30, mismatches=n_bad))
            arms = {"triton_k2": lambda: lg.lora_gemm_triton(x, q, sw, config=tri),
                    "ours_w8a8": lambda: lg.lora_gemm_triton(xq, q, sw, x_scale=xs, config=c8)}
            for bm, bk_, st, regs in VARIANTS:
                if bm and bm > cfg.block_m:
                    continue
                arms[f"gluon_bm{bm or cfg.block_m}_bk{bk_}_s{st}_r{regs}"] = \
                    (lambda bm=bm, bk_=bk_, st=st, regs=regs: run_split(x, q, sw, cfg, None, bm, bk_, st, regs))
            for sp in (1, 2, 4, 8):                      # other splits (different bits: timing only)
                c2 = dataclasses.replace(cfg, split_k=sp)
                if sp != cfg.split_k and split_supported(x, q, c2, has_lora=False, gather=False, has_g=False) is None:
                    for regs in (128, 80):
                        arms[f"gluon_split{sp}_r{regs}"] = (lambda c2=c2, regs=regs: run_split(x, q, sw, c2, regs=regs))
                    arms[f"triton_split{sp}"] = (lambda c2=c2: lg.lora_gemm_triton(
                        x, q, sw, config=dataclasses.replace(c2, gluon=False)))
            names = list(arms)
            us = timer.paired_us([arms[k] for k in names])
            row = dict(op=name, M=M, config=list(tri.key()), w8a8_config=list(c8.key()),
                       us={k: round(v, 2) for k, v in zip(names, us)})
            row["ratio_vs_w8a8"] = {k: round(v / row["us"]["ours_w8a8"], 3) for k, v in row["us"].items()}
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    out["dispatch"] = dispatch.report()
    out["seconds"] = round(time.time() - t0, 1)
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
