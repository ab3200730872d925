"""Where the training linear's time goes: per-kernel CUDA time of one forward+backward (torch.profiler),
for our LoRA and DoRA linears and PEFT's LoRA/DoRA, at the shapes and ranks given.

    python bench/lab/linear_profile.py --shape 8192x8192 --ranks 64,384 --tokens 4096 --out prof.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from rlfp8.kernels import dispatch, knobs  # noqa: E402


def _profile(fn, warmup=3, iters=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t <= 0 or e.key.startswith("ProfilerStep"):
            continue
        rows.append({"kernel": e.key[:120], "us_per_iter": t / iters, "calls_per_iter": e.count / iters})
    rows.sort(key=lambda r: -r["us_per_iter"])
    return {"ms_per_iter": start.elapsed_time(end) / iters, "kernels": rows[:25]}


def _peft_lora(N, K, r, T):
    import peft
    torch.manual_seed(0)
    lin = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
    model = peft.get_peft_model(torch.nn.Sequential(lin), peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["0"],
                                                                         lora_dropout=0.0))
    model.train()
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)

    def peft_lora():
        model(x).backward(dy)
    return peft_lora


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8192x8192")
    ap.add_argument("--ranks", default="64,384")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--batch-invariant", default="off")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import dora as bench_dora
    N, K = bench_dora.SHAPES[a.shape]
    knobs.set_knobs(batch_invariant=a.batch_invariant)
    result = {"shape": a.shape, "tokens": a.tokens, "batch_invariant": a.batch_invariant, "ranks": {}}
    for r in [int(v) for v in a.ranks.split(",")]:
        fns = dict(bench_dora._arms(N, K, r, a.tokens)[0])
        fns["peft_lora"] = _peft_lora(N, K, r, a.tokens)
        per = {}
        for name, fn in fns.items():
            dispatch.reset_report()
            per[name] = _profile(fn)
            per[name]["dispatch"] = dispatch.report()
            print(f"r={r} {name}: {per[name]['ms_per_iter']:.3f} ms", flush=True)
            for row in per[name]["kernels"][:8]:
                print(f"    {row['us_per_iter']:9.1f} us x{row['calls_per_iter']:.0f}  {row['kernel']}", flush=True)
        result["ranks"][r] = per
        torch.cuda.empty_cache()
    Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
