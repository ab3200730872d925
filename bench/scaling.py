"""Data-parallel scaling (issue 18): steps/s and generated tokens/s for ray.num_pairs = 1 .. the GPUs
available, at a fixed per-GPU batch (data.prompts_per_step = --prompts-per-pair x N).

    python bench/scaling.py --out bench/results/scaling_h200x2.json --set model=qwen3_8b --steps 6
    python bench/scaling.py --out /tmp/scaling_cpu.json --set model=tiny --set trainer.device=cpu --pairs 1,2

Each N is one `rlfp8-train` process (its own Ray instance; bench/e2e.py's summary of its metrics.jsonl,
first step excluded when there are more than two). Per N: steps_per_s = 1 / mean time/step,
generated_tokens_per_s = generated tokens per step / mean time/step (the whole step: rollout, train and
sync), samples/s, rollout phase tokens/s, and the speedups over N=1. With fewer GPUs than a requested N that N is not
run and the JSON says why (`skipped`); --pairs forces a list (on CPU: pairs share the cores, a plumbing
check, not a scaling number).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import summarize, versions  # noqa: E402  (bench/ is not a package)


def gpu_count() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except ImportError:
        return 0


def run_pairs(n: int, args, overrides: list[str]) -> dict:
    prompts = args.prompts_per_pair * n
    run_dir = Path(args.runs_root) / f"pairs{n}"
    shutil.rmtree(run_dir, ignore_errors=True)                 # a bench run folder is disposable
    cmd = [sys.executable, "-m", "rlfp8.train", f"recipe={args.recipe}", f"run_dir={run_dir}",
           "logger.wandb.mode=disabled", f"steps={args.steps}", "eval_every=0", "save_every=0",
           f"data.eval_size={args.eval_size}", f"ray.num_pairs={n}", f"data.prompts_per_step={prompts}",
           f"algo.group_size={args.group_size}", f"algo.max_response_len={args.max_response_len}", *overrides]
    print(f"== num_pairs={n}: {' '.join(cmd)}", flush=True)
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env={**os.environ})
    entry = {"num_pairs": n, "prompts_per_step": prompts, "returncode": p.returncode,
             "wall_s": round(time.time() - t0, 1)}
    Path(args.runs_root).mkdir(parents=True, exist_ok=True)
    (Path(args.runs_root) / f"pairs{n}.log").write_text(p.stdout + "\n----- stderr -----\n" + p.stderr)
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        entry.update(summarize(run_dir))
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        train = [r for r in rows if "reward/mean" in r]
        timed = train[1:] if len(train) > 2 else train
        step_s = sum(r["time/step"] for r in timed) / max(len(timed), 1)
        gen = sum(r["response/length_mean"] * prompts * args.group_size for r in timed) / max(len(timed), 1)
        entry.update({"steps_per_s": 1 / step_s if step_s else None, "generated_tokens_per_step": gen,
                      "samples_per_s": prompts * args.group_size / step_s if step_s else None,
                      "generated_tokens_per_s": gen / step_s if step_s else None,
                      "adapter_checksums_equal": all(r.get("dp/adapter_checksum_equal", 1.0) == 1.0 for r in train)})
    if p.returncode != 0:
        entry["error_tail"] = (p.stderr or p.stdout)[-2500:]
    return entry


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--recipe", default="quickstart")
    ap.add_argument("--set", action="append", default=[], help="an rlfp8-train override (repeatable)")
    ap.add_argument("--pairs", default=None, help="comma-separated N list (default: 1 .. GPUs available)")
    ap.add_argument("--prompts-per-pair", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-response-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--eval-size", type=int, default=8)
    ap.add_argument("--runs-root", default="runs/bench-scaling")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per N")
    args = ap.parse_args()
    gpus = gpu_count()
    wanted = [int(x) for x in args.pairs.split(",")] if args.pairs else list(range(1, max(gpus, 1) + 1))
    if not args.pairs and gpus < 2:
        wanted = [1]
    result = {"command": " ".join([sys.executable] + sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "versions": versions(), "gpus": gpus, "per_pair": {"prompts": args.prompts_per_pair,
                                                                 "group_size": args.group_size},
              "runs": [], "skipped": []}
    if gpus < 2 and not args.pairs:
        result["skipped"].append(f"num_pairs=2: needs 2 GPUs (one per pair), this machine has {gpus}")
    for n in wanted:
        on_cpu = any(o == "trainer.device=cpu" for o in args.set)
        if not on_cpu and n > max(gpus, 1):
            result["skipped"].append(f"num_pairs={n}: needs {n} GPUs, this machine has {gpus}")
            continue
        result["runs"].append(run_pairs(n, args, args.set))
        print(json.dumps(result["runs"][-1], indent=1)[:2000], flush=True)
    base = next((r for r in result["runs"] if r["num_pairs"] == 1 and r.get("generated_tokens_per_s")), None)
    for r in result["runs"]:
        if base and r.get("generated_tokens_per_s"):
            r["speedup_tokens_per_s"] = r["generated_tokens_per_s"] / base["generated_tokens_per_s"]
            r["speedup_samples_per_s"] = r["samples_per_s"] / base["samples_per_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}; skipped: {result['skipped']}")
    return 0 if all(r["returncode"] == 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
