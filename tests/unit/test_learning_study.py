"""bench/learning_study.py: the Welch interval and its verdicts on synthetic metrics files (an arm far below
bf16 is `outside`, one at bf16's level `inside`, a noisy one `inconclusive`), the files it refuses or leaves
out, the plot, and bench/gpu_session.sh's `study` stage command line (dry run; every arm composes)."""
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_scripts import load_bench_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ls():
    return load_bench_script("learning_study")


def write_run(folder: Path, name: str, final_eval: float, train_end: float, steps: int = 20, evals=(0, 10, 20)):
    """A metrics.jsonl as rlfp8-train writes it: eval rows (eval/reward, eval/n) and train rows (reward/mean)."""
    rows = []
    for step in range(steps + 1):
        if step in evals:
            rows.append({"step": step, "eval/reward": 0.76 + (final_eval - 0.76) * step / steps, "eval/n": 25})
        if step >= 1:
            rows.append({"step": step, "reward/mean": 0.3 + (train_end - 0.3) * step / steps, "train/loss": 0.1})
    run = folder / name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return run


def synthetic_study(tmp_path: Path) -> Path:
    runs = tmp_path / "runs"
    for seed, (b, inside, far, noisy) in enumerate([(0.92, 0.93, 0.60, 0.70), (0.96, 0.95, 0.64, 1.00),
                                                    (0.94, 0.94, 0.62, 0.88)]):
        write_run(runs, f"bf16__s{seed}", b, b)
        write_run(runs, f"w8a16_matched__s{seed}", inside, inside)
        write_run(runs, f"w8a8_none__s{seed}", far, far)
        write_run(runs, f"w8a8_tis__s{seed}", noisy, noisy)
    write_run(runs, "w8a8_tis__s3", 0.9, 0.9, evals=(0, 10))          # stopped before its final eval
    return runs


def test_student_t_quantiles_match_the_table(ls):
    for df, q in [(1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (10, 2.2281), (30, 2.0423)]:
        assert math.isclose(ls.student_t_quantile(0.975, df), q, rel_tol=1e-4)


def test_welch_difference_by_hand(ls):
    a, b = [90.0, 92.0, 97.0], [80.0, 85.0, 84.0, 87.0]
    r = ls.welch_difference(a, b)
    va, vb = 13.0, 8.666666666666666                         # sample variances
    se = math.sqrt(va / 3 + vb / 4)
    df = (va / 3 + vb / 4) ** 2 / ((va / 3) ** 2 / 2 + (vb / 4) ** 2 / 3)
    assert math.isclose(r["diff"], 93.0 - 84.0) and math.isclose(r["df"], df) and math.isclose(r["se"], se)
    half = ls.student_t_quantile(0.975, df) * se
    assert r["ci"] == pytest.approx([9.0 - half, 9.0 + half])


def test_verdicts(ls):
    assert ls.verdict([-2.0, 3.0]) == "inside"
    assert ls.verdict([-12.0, -6.0]) == "outside" and ls.verdict([5.5, 9.0]) == "outside"
    assert ls.verdict([-7.0, 1.0]) == "inconclusive"
    assert ls.verdict(None) == "insufficient"


def test_study_on_synthetic_runs(ls, tmp_path):
    out = tmp_path / "learning.json"
    assert ls.main(["analyze", "--out", str(out), str(synthetic_study(tmp_path))]) == 0
    res = json.loads(out.read_text())
    cmp = res["comparisons"]
    assert cmp["w8a16_matched"]["final_eval"]["verdict"] == "inside"
    assert cmp["w8a8_none"]["final_eval"]["verdict"] == "outside"
    assert cmp["w8a8_none"]["final_eval"]["diff"] == pytest.approx(-32.0)
    assert cmp["w8a8_tis"]["final_eval"]["verdict"] == "inconclusive"
    assert cmp["w8a8_none"]["last3_train"]["verdict"] == "outside"
    assert set(res["arms"]) == {"bf16", "w8a16_matched", "w8a8_none", "w8a8_tis"}
    assert res["arms"]["w8a8_tis"]["seeds"] == [0, 1, 2]
    assert "w8a8_tis__s3" in res["left_out"] and "did not finish" in res["left_out"]["w8a8_tis__s3"]
    assert res["held_out"]["same"] and res["held_out"]["eval_n"] == [25]
    png = Path(res["plot"])
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"


def test_task_check_needs_a_bf16_gain_without_saturation(ls, tmp_path):
    """The synthetic bf16 arm goes 76 -> 94 points: 18 < 20 gained. A 30-point gain ending at 66 is fair; one
    ending at 100 is saturated (every arm would sit 'within the spread' there)."""
    res = ls.study([ls.read_run(n, p) for n, p in ls.metrics_files([str(synthetic_study(tmp_path))])])
    assert res["task"]["verdict"] == "too little gain" and res["task"]["gain_points"] == pytest.approx(18.0)

    def arm(first, final):
        return {"bf16": [ls.RunCurve("bf16", s, "x", evals=[(0, first), (20, final)]) for s in range(3)]}
    fair, saturated = ls.task_check(arm(0.36, 0.66)), ls.task_check(arm(0.72, 1.0))
    assert fair["verdict"] == "fair" and fair["gain_points"] == pytest.approx(30.0)
    assert saturated["verdict"] == "saturated" and saturated["saturated"]
    assert ls.task_check({})["verdict"] == "insufficient"


def test_last3_train_reward_is_the_mean_of_the_last_three_steps(ls, tmp_path):
    run = write_run(tmp_path, "bf16__s0", 0.9, 0.9)
    curve = ls.read_run("bf16__s0", run / "metrics.jsonl")
    rewards = [r for _, r in curve.train]
    assert curve.last_train() == pytest.approx(sum(rewards[-3:]) / 3) and curve.final_eval() == pytest.approx(0.9)


def test_refuses_bad_inputs(ls, tmp_path):
    write_run(tmp_path / "a", "bf16__s0", 0.9, 0.9)
    write_run(tmp_path / "b", "bf16__s0", 0.9, 0.9)
    with pytest.raises(SystemExit, match="given twice"):
        ls.study([ls.read_run(n, p) for n, p in ls.metrics_files([str(tmp_path / "a"), str(tmp_path / "b")])])
    bad = write_run(tmp_path, "bf16-seed0", 0.9, 0.9)
    with pytest.raises(SystemExit, match="not ARM__sSEED"):
        ls.read_run(bad.name, bad / "metrics.jsonl")
    broken = write_run(tmp_path, "bf16__s7", 0.9, 0.9) / "metrics.jsonl"
    broken.write_text(broken.read_text() + "{oops\n")
    with pytest.raises(SystemExit, match=r"metrics.jsonl:\d+: not JSON"):
        ls.read_run("bf16__s7", broken)
    only_arm = tmp_path / "c"
    write_run(only_arm, "w8a8_tis__s0", 0.9, 0.9)
    with pytest.raises(SystemExit, match="no complete 'bf16' run"):
        ls.study([ls.read_run(n, p) for n, p in ls.metrics_files([str(only_arm)])])


def test_held_out_check_flags_different_eval_sets(ls, tmp_path):
    a = ls.read_run("bf16__s0", write_run(tmp_path, "bf16__s0", 0.9, 0.9) / "metrics.jsonl")
    b = ls.read_run("bf16__s1", write_run(tmp_path, "bf16__s1", 0.9, 0.9) / "metrics.jsonl")
    b.eval_n = {64}
    assert not ls.held_out_check([a, b])["same"]
    b.eval_n, a.data_cfg, b.data_cfg = {25}, {"seed": 0}, {"seed": 1}
    assert not ls.held_out_check([a, b])["same"]


def test_study_stage_dry_run_lists_every_arm_and_seed_and_each_composes(ls, tmp_path):
    sh = ROOT / "bench" / "gpu_session.sh"
    assert subprocess.run(["bash", "-n", str(sh)]).returncode == 0
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "SEEDS": "0,1,2",
           "PY": f"env PYTHONPATH={ROOT} {sys.executable}"}
    done = subprocess.run(["bash", str(sh), "study"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    argv = shlex.split(done.stdout)
    assert "bench/e2e.py" in argv and argv[argv.index("--parallel") + 1] == "5"
    specs = [argv[i + 1] for i, a in enumerate(argv) if a == "--run"]
    names = sorted(s.partition(":")[0] for s in specs)
    assert names == sorted(f"{arm}__s{seed}" for arm in ls.ARMS for seed in range(3))
    from rlfp8.config import compose_dict
    for spec in specs:
        name, _, ov = spec.partition(":")
        if not name.endswith("__s1"):
            continue
        cfg = compose_dict(["recipe=quickstart", *ov.split(",")])
        assert cfg["seed"] == 1 and cfg["data"]["seed"] == 0 and cfg["engine"]["kv_cache_memory_gb"] == 4
        arm = ls.ARMS[name.removesuffix("__s1")]
        assert cfg["engine"]["precision"] == arm[0].split("=")[1]


def test_paired_difference_by_hand_and_against_welch(ls):
    base = {0: 70.0, 1: 90.0, 2: 80.0, 5: 10.0}                 # seed 5 has no partner: left out of the pairs
    arm = {0: 71.0, 1: 91.0, 2: 79.0}
    r = ls.paired_difference(arm, base)
    assert r["seeds"] == [0, 1, 2] and r["df"] == 2
    d = [1.0, 1.0, -1.0]
    m = sum(d) / 3
    se = math.sqrt(sum((x - m) ** 2 for x in d) / 2 / 3)
    assert r["diff"] == pytest.approx(m) and r["se"] == pytest.approx(se)
    assert r["ci"] == pytest.approx([m - 4.302653 * se, m + 4.302653 * se], rel=1e-5)
    assert r["correlation"] == pytest.approx(0.9934, abs=1e-3)
    # the seeds share RL's noise: the pairs see the arms agree, the independent-samples interval cannot
    assert ls.verdict(r["ci"]) == "inside"
    assert ls.verdict(ls.welch_difference(list(arm.values()), [70.0, 90.0, 80.0])["ci"]) == "inconclusive"
    assert ls.paired_difference({0: 1.0}, {0: 2.0})["ci"] is None


def test_seeds_needed_plans_from_the_observed_spread(ls):
    # sd 3.3, mean -0.8 (the 2026-12-02 matched arm): n = 4 gives 0.8 + 3.182 * 3.3 / 2 = 6.05 > 5
    n = ls.seeds_needed(-0.8, 3.3)
    assert n is not None and n > 4
    t = ls.student_t_quantile
    assert 0.8 + t(0.975, n - 1) * 3.3 / math.sqrt(n) <= 5.0 < 0.8 + t(0.975, n - 2) * 3.3 / math.sqrt(n - 1)
    assert ls.seeds_needed(5.5, 1.0) is None                       # the mean alone is beyond the margin
    assert ls.seeds_needed(0.0, 0.0) == 2
    assert ls.seeds_needed(4.99, 50.0) is None                      # more than `most` seeds
    r = ls.paired_difference({0: 71.0, 1: 91.0, 2: 79.0}, {0: 70.0, 1: 90.0, 2: 80.0})
    assert r["sd"] == pytest.approx(math.sqrt(4 / 3))


def test_attempts_set_aside_by_e2e_are_not_counted(ls, tmp_path, capsys):
    runs = synthetic_study(tmp_path)
    write_run(runs, "bf16__s1.oom1", 0.10, 0.10, evals=(0,))     # bench/e2e.py's first attempt, out of memory
    out = tmp_path / "learning.json"
    assert ls.main(["analyze", "--out", str(out), str(runs)]) == 0
    assert "bf16__s1.oom1" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["arms"]["bf16"]["per_seed"]["final_eval"]["1"] == pytest.approx(0.96)
    with pytest.raises(SystemExit, match="not ARM__sSEED"):       # named explicitly, it is still refused
        ls.main(["analyze", "--out", str(out), str(runs / "bf16__s1.oom1")])
