"""End-to-end RL runs on one machine, summarised into one JSON (bench/results/e2e_<gpu>.json).

    python bench/e2e.py --out bench/results/e2e_h200.json \
        --run tiny:model=tiny,steps=3 \
        --run quickstart_bf16:steps=20,engine.precision=bf16 \
        --run quickstart_w8a8:steps=20,engine.precision=w8a8

Each --run is NAME:comma-separated overrides for `rlfp8-train` (recipe=quickstart unless given).
Every run is a separate process (its own Ray instance); a failing run is recorded with its error and
the others still run; --parallel N runs N at once (learning checks; their step times share the device), starting the
next as soon as any finishes. A run that stops out of device memory (rlfp8-train's exit status 4, the memory plan
printed) while others share the device is queued again (--retry-oom times, default 1) and the number of runs at once
drops by one, so the retry starts when the device has room; its first attempt is kept as NAME.oomK (folder and log)
and recorded under `attempts`. Per run: mean step times (rollout / train / sync / step, first step excluded
when there are more than two), peak device memory per actor, eval reward before/after, the last
train reward, the mean of mismatch/kl_k3 and mismatch/abs_logp_diff_mean, and the wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlfp8.provenance import versions  # noqa: E402  (re-exported: bench/scaling.py imports it from here)


def summarize(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/reward" in r]
    timed = train[1:] if len(train) > 2 else train

    def mean(key, rs=timed):
        vals = [r[key] for r in rs if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    def peak(name):         # memory/<phase>/<name> (rlfp8.memory_plan), any phase
        vals = [v for r in train for k, v in r.items() if k.startswith("memory/") and k.endswith("/" + name)]
        return max(vals) if vals else None

    return {
        "steps": len(train),
        "step_time_s": {k: mean(f"time/{k}") for k in ("rollout", "train", "sync", "step")},
        "peak_memory_gib": {"engine": peak("engine_peak_gib"), "trainer": peak("trainer_peak_gib")},
        "eval_reward_first": evals[0]["eval/reward"] if evals else None,
        "eval_reward_final": evals[-1]["eval/reward"] if evals else None,
        "train_reward_first": train[0]["reward/mean"] if train else None,
        "train_reward_final": train[-1]["reward/mean"] if train else None,
        "mismatch_kl_k3_mean": mean("mismatch/kl_k3", train),
        "mismatch_abs_logp_diff_mean": mean("mismatch/abs_logp_diff_mean", train),
        "train_tokens_per_s": mean("train/tokens_per_s"),
        "rollout_tokens_per_s": mean("rollout/tokens_per_s"),
    }


TRAIN_COMMAND = [sys.executable, "-m", "rlfp8.train"]
EXIT_OUT_OF_MEMORY = 4          # rlfp8.train.main: OutOfMemoryPlanError


def _start(spec: str, runs_root: str):
    """Launch one `rlfp8-train` process for NAME:overrides; its output goes to <runs_root>/<NAME>.log."""
    name, _, ov = spec.partition(":")
    overrides = [o for o in ov.split(",") if o]
    if not any(o.startswith("recipe=") for o in overrides):
        overrides.insert(0, "recipe=quickstart")
    run_dir = Path(runs_root) / name
    cmd = [*TRAIN_COMMAND, f"run_dir={run_dir}", "logger.wandb.mode=offline", *overrides]
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    log_path = Path(runs_root) / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, text=True, env={**os.environ})
    return {"spec": spec, "name": name, "overrides": overrides, "process": p, "t0": time.time(), "log": log_path}


def _set_aside(runs_root: str, name: str, attempt: int) -> str:
    """Move a failed attempt's folder and log to NAME.oomK so its retry starts clean; returns the new name."""
    kept = f"{name}.oom{attempt}"
    for src, dst in ((Path(runs_root) / name, Path(runs_root) / kept),
                     (Path(runs_root) / f"{name}.log", Path(runs_root) / f"{kept}.log")):
        if src.exists():
            src.rename(dst)
    return kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--run", action="append", required=True, help="NAME:override,override,...")
    ap.add_argument("--runs-root", default="runs/bench-e2e")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per run")
    ap.add_argument("--parallel", type=int, default=1,
                    help="runs at once (each its own process and Ray instance; step times then share the device)")
    ap.add_argument("--retry-oom", type=int, default=1,
                    help="times a run that stopped out of device memory beside others is queued again")
    ap.add_argument("--poll-s", type=float, default=2.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    result = {"command": " ".join([sys.executable] + (sys.argv if argv is None else ["bench/e2e.py", *argv])),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "versions": versions(), "runs": {}}
    pending, running, limit = list(args.run), [], max(1, args.parallel)
    while pending or running:
        while pending and len(running) < limit:
            running.append(_start(pending.pop(0), args.runs_root))
        time.sleep(args.poll_s if all(r["process"].poll() is None for r in running) else 0)
        for run in [r for r in running if r["process"].poll() is not None
                    or time.time() - r["t0"] > args.timeout]:
            running.remove(run)
            p = run["process"]
            if p.poll() is None:                                   # past --timeout
                p.kill()
            p.wait()
            name = run["name"]
            entry = {"overrides": run["overrides"], "returncode": p.returncode,
                     "wall_s": round(time.time() - run["t0"], 1), "concurrent_runs": args.parallel}
            run_dir = Path(args.runs_root) / name
            if (run_dir / "metrics.jsonl").exists():
                entry.update(summarize(run_dir))
            if p.returncode != 0:
                entry["error_tail"] = run["log"].read_text()[-2500:]
            attempts = result["runs"].setdefault(name, {}).setdefault("attempts", [])
            shared = len(running) > 0 or limit > 1
            if p.returncode == EXIT_OUT_OF_MEMORY and shared and len(attempts) < args.retry_oom:
                entry["kept_as"] = _set_aside(args.runs_root, name, len(attempts) + 1)
                attempts.append(entry)
                limit = max(1, limit - 1)
                pending.append(run["spec"])
                print(f"== {name}: out of device memory beside {len(running)} runs; queued again, "
                      f"{limit} at once from now (first attempt kept as {entry['kept_as']})", flush=True)
            else:
                result["runs"][name] = {**entry, **({"attempts": attempts} if attempts else {})}
                print(json.dumps(entry, indent=1)[:3000], flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0 if all(r.get("returncode") == 0 for r in result["runs"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
