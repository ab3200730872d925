"""The learning-equivalence study (issue 17, item 3): do FP8 RL configurations end where bf16 RL does?

    python bench/learning_study.py specs --seeds 0,1,2            # the bench/e2e.py --run arguments, one a line
    python bench/learning_study.py analyze --out bench/results/learning_h200.json RUN_DIR_OR_METRICS ...

`specs` prints one run per (arm, seed), named ARM__sSEED, from ARMS, COMMON and TASK below (the one place the
arms are defined; bench/gpu_session.sh stage `study` runs them through bench/e2e.py --parallel).
Seeds vary the top-level `seed=` (the engine's sampling streams and the adapter's initialisation);
`data.seed=0` stays fixed, so every run holds out and evaluates the same prompts.

`analyze` reads metrics.jsonl files (run folders, `ARM__sSEED.metrics.jsonl` files, or folders of them),
and per arm takes, for every seed, the final held-out reward (`eval/reward` at the last step, greedy) and
the last-3-step train reward (`reward/mean`). Each arm is compared with the `bf16` arm, in points (reward x
100), over seeds: the seed is the unit of replication (the claim is about seed-to-seed spread of RL outcomes;
the held-out prompts are the same for every run, and metrics.jsonl keeps only each eval's mean). The verdict
reads the PAIRED interval: the mean over the seeds both arms ran of (arm - bf16) with a 95% t interval on
n - 1 degrees of freedom. Why paired: a seed fixes the adapter's initialisation and every prompt's sampling
stream, and step 1 serves the base model in every arm (at its precision), so two arms of one seed start from
nearly the same batch and share part of RL's own noise; the difference per seed removes that part (the correlation
over seeds is reported). Chosen before the study of 2026-12-02 (the 2026-12-01 runs of bf16 and w8a8_tis
read stale prefix KV and do not count). The 95% Welch t interval of the difference of seed means (arms as
independent samples, Welch-Satterthwaite df) is reported beside it. With 3 seeds a bootstrap over seeds has
only 10 distinct resamples per arm and understates the spread; t intervals are wider and honest about it.
Verdict against +-MARGIN_POINTS: `inside` (the interval lies within),
`outside` (it lies entirely beyond), `inconclusive` (it straddles a bound: more seeds needed),
`insufficient` (fewer than 2 seeds in an arm). Beside each paired interval, `seeds_needed`: how many seeds the
interval would need to lie inside +-MARGIN_POINTS if the per-seed differences kept their mean and spread (a plan
for the next calls, never a verdict).

Writes the JSON (arms, per-seed values, comparisons) and a PNG beside it: train and held-out reward curves
per arm, mean over seeds with a min-max band.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

BASELINE = "bf16"
ARMS: dict[str, list[str]] = {
    # bf16 RL: bf16 engine, bf16 trainer base (host-offloaded between phases)
    "bf16": ["engine.precision=bf16", "trainer.weights=bf16", "placement=offloaded"],
    # the matched engine (rlfp8 W8A16: the FP8 trainer's arithmetic), one FP8 copy shared, no correction
    "w8a16_matched": ["engine.precision=w8a16", "placement=one_copy", "algo.correction=none"],
    # rlfp8's W8A8 engine (FP8 activations) with truncated importance sampling on the mismatch
    "w8a8_tis": ["engine.precision=w8a8", "algo.correction=tis"],
}
OPTIONAL_ARMS: dict[str, list[str]] = {
    "w8a8_none": ["engine.precision=w8a8", "algo.correction=none"],    # the uncorrected W8A8 reference
}
# Every run: small KV caches so several runs share one GPU (vLLM's memory profiling asserts otherwise with
# concurrent engines), eager engines (the 2026-12-02 study ran eager: the decode-graphs GPU test had not passed
# yet, and seeds added later pool with it only under the same engine mode: CUDA graphs pad a batch to a captured
# size, which can pick another kernel schedule), held-out eval every 5 steps for the curves, the same held-out
# prompts (data.seed) everywhere.
# No KV release: with several runs on one GPU a neighbour takes the memory a released cache frees, and the
# resume fails (one of the nine runs of 2026-12-01); the release does not change what a run computes.
COMMON = ["engine.kv_cache_memory_gb=4", "engine.enforce_eager=true", "engine.release_kv=false", "eval_every=5",
          "data.seed=0"]
# The task: two-digit addition (the quickstart's one-digit task ends at 100% held-out for every arm, which
# makes any arm "within the spread"). SmolLM2-135M answers 18% of 100 held-out prompts greedily before
# training; on this CPU (float32) it reached 60% at step 5 and 66% at step 15 (bench/README.md).
# 400 held-out prompts: the H200 study of 2026-12-01 (100 prompts, 3 seeds) had a seed-to-seed spread of 6.6
# points at step 20: ~4.5 of it (in quadrature) the eval's binomial noise at 100 prompts, ~4.8 RL's own.
# 32 prompts a step (twice the quickstart's): a larger batch lowers RL's own noise (2026-12-02 study).
TASK = ["data.digits=2", "data.eval_size=400", "data.prompts_per_step=32", "steps=20"]
MARGIN_POINTS = 5.0
MIN_GAIN_POINTS, SATURATED = 20.0, 0.95       # the task: bf16 gains >= 20 points and ends below 95% (task_check)
LAST_TRAIN_STEPS = 3
RUN_NAME = re.compile(r"^(?P<arm>[A-Za-z0-9_]+?)__s(?P<seed>\d+)$")
SET_ASIDE = re.compile(r"\.oom\d+$")            # NAME.oomK: bench/e2e.py kept a failed attempt before its retry


# ------------------------------------------------------------------ run specs
def run_specs(seeds: list[int], arms: list[str], extra: list[str]) -> list[str]:
    """bench/e2e.py --run values NAME:ov,ov for every (arm, seed)."""
    table = {**ARMS, **OPTIONAL_ARMS}
    unknown = [a for a in arms if a not in table]
    if unknown:
        raise SystemExit(f"learning_study: unknown arm(s) {unknown}; known: {list(table)}")
    return [f"{arm}__s{seed}:" + ",".join([*table[arm], *COMMON, *TASK, *extra, f"seed={seed}"])
            for arm in arms for seed in seeds]


# ------------------------------------------------------------------ reading runs
@dataclass
class RunCurve:
    arm: str
    seed: int
    source: str
    train: list[tuple[int, float]] = field(default_factory=list)    # (step, reward/mean)
    evals: list[tuple[int, float]] = field(default_factory=list)    # (step, eval/reward)
    eval_n: set = field(default_factory=set)
    data_cfg: dict | None = None

    def final_eval(self) -> float:
        return self.evals[-1][1]

    def last_train(self) -> float:
        tail = self.train[-LAST_TRAIN_STEPS:]
        return sum(r for _, r in tail) / len(tail)


def metrics_files(paths: list[str]) -> list[tuple[str, Path]]:
    """(run name, metrics file) for run folders, ARM__sSEED.metrics.jsonl files and folders of either."""
    found = []
    for p in map(Path, paths):
        if p.is_file():
            found.append((p.name.removesuffix(".metrics.jsonl").removesuffix(".jsonl"), p))
        elif (p / "metrics.jsonl").is_file():
            found.append((p.name, p / "metrics.jsonl"))
        elif p.is_dir():
            found += [(f.name.removesuffix(".metrics.jsonl"), f) for f in sorted(p.glob("*.metrics.jsonl"))]
            for d in sorted(p.iterdir()):
                if not (d / "metrics.jsonl").is_file():
                    continue
                if SET_ASIDE.search(d.name):                                # bench/e2e.py's failed attempts
                    print(f"learning_study: {d}: an attempt set aside (out of memory, retried): not counted")
                else:
                    found.append((d.name, d / "metrics.jsonl"))
        else:
            raise SystemExit(f"learning_study: {p}: no such file or folder")
    return found


def read_run(name: str, path: Path) -> RunCurve:
    m = RUN_NAME.match(name)
    if not m:
        raise SystemExit(f"learning_study: {path}: run name {name!r} is not ARM__sSEED (bench/learning_study.py specs)")
    run = RunCurve(m["arm"], int(m["seed"]), str(path))
    lines = path.read_text().splitlines()
    for row in (_json_row(path, n, line) for n, line in enumerate(lines, 1) if line.strip()):
        if "reward/mean" in row:
            run.train.append((int(row["step"]), float(row["reward/mean"])))
        if "eval/reward" in row:
            run.evals.append((int(row["step"]), float(row["eval/reward"])))
            run.eval_n.add(row.get("eval/n"))
    config = path.parent / "config.yaml"
    if config.is_file():
        import yaml
        run.data_cfg = (yaml.safe_load(config.read_text()) or {}).get("data")
    return run


def _json_row(path: Path, lineno: int, line: str) -> dict:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise SystemExit(f"learning_study: {path}:{lineno}: not JSON ({e})") from e


def complete(run: RunCurve) -> str | None:
    """Why the run cannot count (None: it can): it needs train rows and a held-out eval at its last step."""
    if not run.train:
        return "no train steps"
    if not run.evals or run.evals[-1][0] < run.train[-1][0]:
        return f"no held-out eval at the last step ({run.train[-1][0]}): the run did not finish"
    return None


# ------------------------------------------------------------------ statistics
def student_t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with df degrees of freedom (bisection on the CDF)."""
    lo, hi = 0.0, 1e4
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def _t_cdf(t: float, df: float) -> float:
    x = df / (df + t * t)
    tail = 0.5 * _betainc(df / 2, 0.5, x)
    return 1 - tail if t >= 0 else tail


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b), Lentz's continued fraction (Numerical Recipes betacf)."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    if x > (a + 1) / (a + b + 2):
        return 1 - _betainc(b, a, 1 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny, c, d = 1e-300, 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + num * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1) < 1e-15:
            break
    return front * f


def _mean_var(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def welch_difference(arm: list[float], base: list[float], level: float = 0.95) -> dict:
    """mean(arm) - mean(base) with its Welch t interval; values in points."""
    if len(arm) < 2 or len(base) < 2:
        d = (sum(arm) / len(arm) - sum(base) / len(base)) if arm and base else None
        return {"diff": d, "ci": None, "df": None, "note": "fewer than 2 seeds in an arm: no interval"}
    (ma, va), (mb, vb) = _mean_var(arm), _mean_var(base)
    sa, sb = va / len(arm), vb / len(base)
    se = math.sqrt(sa + sb)
    if se == 0:
        return {"diff": ma - mb, "ci": [ma - mb, ma - mb], "df": None,
                "note": "no seed spread in either arm (every seed ended at the same value)"}
    df = (sa + sb) ** 2 / (sa ** 2 / (len(arm) - 1) + sb ** 2 / (len(base) - 1))
    half = student_t_quantile(0.5 + level / 2, df) * se
    return {"diff": ma - mb, "ci": [ma - mb - half, ma - mb + half], "df": df, "se": se}


def paired_difference(arm: dict[int, float], base: dict[int, float], level: float = 0.95) -> dict:
    """mean over common seeds of arm[s] - base[s] with its t interval (n - 1 df), and the arms' correlation
    over those seeds; values in points."""
    seeds = sorted(set(arm) & set(base))
    d = [arm[s] - base[s] for s in seeds]
    out = {"seeds": seeds, "diff": sum(d) / len(d) if d else None, "ci": None}
    if len(d) < 2:
        return {**out, "note": "fewer than 2 seeds in both arms: no interval"}
    m, v = _mean_var(d)
    se = math.sqrt(v / len(d))
    half = student_t_quantile(0.5 + level / 2, len(d) - 1) * se if se else 0.0
    (ma, va), (mb, vb) = _mean_var([arm[s] for s in seeds]), _mean_var([base[s] for s in seeds])
    cov = sum((arm[s] - ma) * (base[s] - mb) for s in seeds) / (len(d) - 1)
    corr = cov / math.sqrt(va * vb) if va > 0 and vb > 0 else None
    return {**out, "ci": [m - half, m + half], "df": len(d) - 1, "se": se, "sd": math.sqrt(v), "correlation": corr}


def seeds_needed(diff: float, sd: float, margin: float = MARGIN_POINTS, level: float = 0.95,
                 most: int = 200) -> int | None:
    """Planning, not a verdict: the fewest seeds n for which the paired interval would lie inside +-margin if the
    per-seed differences kept this mean and standard deviation (|diff| + t(n-1) sd / sqrt(n) <= margin).
    None when |diff| >= margin (no number of seeds brings the interval inside) or more than `most` are needed."""
    if abs(diff) >= margin:
        return None
    for n in range(2, most + 1):
        if abs(diff) + student_t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n) <= margin:
            return n
    return None


def verdict(ci: list[float] | None, margin: float = MARGIN_POINTS) -> str:
    if ci is None:
        return "insufficient"
    lo, hi = ci
    if -margin <= lo and hi <= margin:
        return "inside"
    if lo > margin or hi < -margin:
        return "outside"
    return "inconclusive"


# ------------------------------------------------------------------ the study
METRICS = {"final_eval": RunCurve.final_eval, "last3_train": RunCurve.last_train}


def group_runs(runs: list[RunCurve]) -> tuple[dict[str, list[RunCurve]], dict[str, str]]:
    """arm -> its complete runs (seed order), and run -> why it was left out."""
    arms: dict[str, list[RunCurve]] = {}
    left_out, seen = {}, {}
    for run in runs:
        key = f"{run.arm}__s{run.seed}"
        if key in seen:
            raise SystemExit(f"learning_study: {key} given twice ({seen[key]} and {run.source})")
        seen[key] = run.source
        why = complete(run)
        if why:
            left_out[key] = why
            continue
        arms.setdefault(run.arm, []).append(run)
    for rs in arms.values():
        rs.sort(key=lambda r: r.seed)
    return arms, left_out


def held_out_check(runs: list[RunCurve]) -> dict:
    """Every run evaluated the same number of prompts, and (where config.yaml is beside) the same data config."""
    sizes = sorted({n for r in runs for n in r.eval_n}, key=str)
    configs = [json.dumps(r.data_cfg, sort_keys=True) for r in runs if r.data_cfg is not None]
    same_cfg = len(set(configs)) <= 1
    return {"eval_n": sizes, "data_config_compared": len(configs), "same": len(sizes) == 1 and same_cfg}


def compare(arms: dict[str, list[RunCurve]], margin: float) -> dict:
    """Each arm vs the baseline, per metric, in points."""
    if BASELINE not in arms:
        raise SystemExit(f"learning_study: no complete {BASELINE!r} run: nothing to compare with (arms: {list(arms)})")
    out = {}
    for arm, rs in arms.items():
        if arm == BASELINE:
            continue
        out[arm] = {}
        for metric, value in METRICS.items():
            mine, base = {r.seed: 100 * value(r) for r in rs}, {r.seed: 100 * value(r) for r in arms[BASELINE]}
            paired = paired_difference(mine, base)
            welch = welch_difference(list(mine.values()), list(base.values()))
            welch["verdict"] = verdict(welch["ci"], margin)
            need = seeds_needed(paired["diff"], paired["sd"], margin) if "sd" in paired else None
            out[arm][metric] = {**paired, "verdict": verdict(paired["ci"], margin), "seeds_needed": need,
                                "welch": welch}
    return out


def task_check(arms: dict[str, list[RunCurve]]) -> dict:
    """Is the task a fair test (issue 17)? bf16 RL must gain >= MIN_GAIN_POINTS of held-out reward without
    saturating (its seed mean ending below SATURATED): on a task every arm finishes at 100%, every arm is
    "within the spread" whatever it learned."""
    rs = arms.get(BASELINE, [])
    if not rs:
        return {"verdict": "insufficient", "note": f"no complete {BASELINE!r} run"}
    first = sum(100 * r.evals[0][1] for r in rs) / len(rs)
    final = sum(100 * r.final_eval() for r in rs) / len(rs)
    gain_ok, saturated = final - first >= MIN_GAIN_POINTS, final >= 100 * SATURATED
    return {"bf16_first_eval_points": first, "bf16_final_eval_points": final, "gain_points": final - first,
            "min_gain_points": MIN_GAIN_POINTS, "saturated_at_points": 100 * SATURATED,
            "gain_ok": gain_ok, "saturated": saturated,
            "verdict": "fair" if gain_ok and not saturated else "saturated" if saturated else "too little gain"}


def study(runs: list[RunCurve], margin: float = MARGIN_POINTS) -> dict:
    arms, left_out = group_runs(runs)
    summary = {}
    for arm, rs in arms.items():
        per_seed = {m: {r.seed: value(r) for r in rs} for m, value in METRICS.items()}
        summary[arm] = {"overrides": {**ARMS, **OPTIONAL_ARMS}.get(arm), "seeds": [r.seed for r in rs],
                        "runs": [r.source for r in rs], "per_seed": per_seed,
                        "mean": {m: sum(v.values()) / len(v) for m, v in per_seed.items()}}
    return {"method": "arm - bf16 per seed, in points (reward x 100), over the seeds both ran: mean and 95% t "
                      "interval (n - 1 df); verdict inside/outside/inconclusive against +-margin. Beside it "
                      "(comparisons.*.*.welch): the difference of seed means with a 95% Welch t interval",
            "baseline": BASELINE, "margin_points": margin, "common_overrides": COMMON + TASK,
            "held_out": held_out_check([r for rs in arms.values() for r in rs]),
            "task": task_check(arms), "arms": summary, "comparisons": compare(arms, margin), "left_out": left_out}


# ------------------------------------------------------------------ the plot
def _band(curves: list[list[tuple[int, float]]]):
    """Steps every curve has, and the mean, min and max over curves at each."""
    steps = sorted(set.intersection(*(set(s for s, _ in c) for c in curves)))
    vals = [[dict(c)[s] for c in curves] for s in steps]
    return steps, [sum(v) / len(v) for v in vals], [min(v) for v in vals], [max(v) for v in vals]


def plot(runs: list[RunCurve], result: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm in result["arms"]:
        rs = [r for r in runs if r.arm == arm and complete(r) is None]
        for ax, curves in ((axes[0], [r.train for r in rs]), (axes[1], [r.evals for r in rs])):
            steps, mean, lo, hi = _band(curves)
            line, = ax.plot(steps, mean, marker="o" if ax is axes[1] else None, ms=3, label=f"{arm} (n={len(rs)})")
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2)
    axes[0].set(title="train reward/mean: mean, min-max over seeds", xlabel="step", ylabel="reward")
    axes[1].set(title="held-out reward (greedy): mean, min-max over seeds", xlabel="step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def text_table(result: dict) -> str:
    def ci(r):
        return "-" if r["ci"] is None else f"[{r['ci'][0]:+.1f}, {r['ci'][1]:+.1f}]"

    lines = [f"{'arm':<16}{'metric':<13}{'diff pts':>9}  {'95% CI (paired)':<18}{'verdict':<13}{'corr':>6}  "
             f"{'95% CI (Welch)':<18}{'verdict':<13}{'seeds for +-margin':>19}"]
    for arm, per in result["comparisons"].items():
        for metric, r in per.items():
            diff = "-" if r["diff"] is None else f"{r['diff']:+.1f}"
            corr = "-" if r.get("correlation") is None else f"{r['correlation']:+.2f}"
            need = "-" if r.get("seeds_needed") is None else str(r["seeds_needed"])
            lines.append(f"{arm:<16}{metric:<13}{diff:>9}  {ci(r):<18}{r['verdict']:<13}{corr:>6}  "
                         f"{ci(r['welch']):<18}{r['welch']['verdict']:<13}{need:>19}{r.get('note', '')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("specs", help="print the bench/e2e.py --run values, one a line")
    sp.add_argument("--seeds", default="0,1,2")
    sp.add_argument("--arms", default=",".join(ARMS))
    sp.add_argument("--extra", default="", help="overrides added to every run (comma-separated), e.g. a harder task")
    an = sub.add_parser("analyze", help="the statistics, JSON and PNG from finished runs")
    an.add_argument("paths", nargs="+")
    an.add_argument("--out", required=True, help="JSON path; the PNG goes beside it")
    an.add_argument("--margin", type=float, default=MARGIN_POINTS)
    args = ap.parse_args(argv)
    if args.cmd == "specs":
        seeds = [int(s) for s in args.seeds.replace(" ", ",").split(",") if s]
        print("\n".join(run_specs(seeds, [a for a in args.arms.split(",") if a], [e for e in args.extra.split(",") if e])))
        return 0
    runs = [read_run(name, path) for name, path in metrics_files(args.paths)]
    result = study(runs, args.margin)
    result["command"] = " ".join([sys.executable, *sys.argv])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result["plot"] = str(plot(runs, result, out.with_suffix(".png")))
    out.write_text(json.dumps(result, indent=2))
    print(text_table(result))
    t = result["task"]
    if "gain_points" in t:
        print(f"task: bf16 held-out {t['bf16_first_eval_points']:.1f} -> {t['bf16_final_eval_points']:.1f} points "
              f"(gain {t['gain_points']:+.1f}, needs >= {t['min_gain_points']:.0f} and a final < "
              f"{t['saturated_at_points']:.0f}): {t['verdict']}")
    for key, why in result["left_out"].items():
        print(f"left out {key}: {why}")
    print(f"wrote {out} and {result['plot']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
