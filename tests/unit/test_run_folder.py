"""RunFolder without actors: lock, fresh-run refusal, resume config, checkpoint pruning, scratch cleanup.

Each test is one bullet of issue 19 (see tests/integration/test_run_folder.py for the CLI end to end)."""
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from rlfp8.config import compose, to_dict
from rlfp8.run_folder import (EXIT_CLEANUP, RunFolder, RunFolderError, clean_dead_scratch, driver_rng_state,
                              restore_driver_rng)

ROOT = Path(__file__).resolve().parents[2]


def _saved_run(run_dir: Path, *overrides: str) -> dict:
    """A folder that holds a run: config.yaml as a run writes it, one metrics row."""
    cfg = to_dict(compose(["model=tiny", f"run_dir={run_dir}", *overrides]))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    return cfg


def _start(argv):
    folder, cfg = RunFolder.start(argv)
    EXIT_CLEANUP.callbacks.remove(folder.lock.release)     # this test process keeps running: release by hand
    return folder, cfg


def _python(code: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# -- bullet 1: resume uses the saved config, applies only the given overrides, refuses shape changes
def test_resume_uses_saved_config_not_the_defaults(tmp_path):
    run_dir = tmp_path / "R"
    _saved_run(run_dir, "adapter.rank=4", "algo.group_size=3", "steps=5")
    folder, cfg = _start(["resume=true", f"run_dir={run_dir}", "steps=9"])
    try:
        assert cfg["model"]["path"] == "tiny" and cfg["adapter"]["rank"] == 4 and cfg["algo"]["group_size"] == 3
        assert cfg["steps"] == 9 and cfg["resume"] is True       # the one override given
    finally:
        folder.close()


@pytest.mark.parametrize("override,key,value", [
    ("adapter.rank=8", "adapter.rank", 8), ("model=smollm2_135m", "model.path", "gguf:smollm2-135m-instruct"),
    ("algo.advantage=rloo", "algo.advantage", "rloo"), ("seed=3", "seed", 3)])
def test_resume_refuses_model_adapter_algo_changes(tmp_path, override, key, value):
    run_dir = tmp_path / "R"
    _saved_run(run_dir, "adapter.rank=4")
    before = (run_dir / "config.yaml").read_text()
    with pytest.raises(RunFolderError, match=rf"change .*{key}.*force=true"):
        RunFolder.start(["resume=true", f"run_dir={run_dir}", override])
    assert (run_dir / "config.yaml").read_text() == before            # untouched
    folder, cfg = _start(["resume=true", f"run_dir={run_dir}", override, "force=true"])
    folder.close()
    got = cfg
    for part in key.split("."):
        got = got[part]
    assert got == value


def test_resume_group_override_and_unknown_key(tmp_path):
    run_dir = tmp_path / "R"
    _saved_run(run_dir)
    folder, cfg = _start(["resume=true", f"run_dir={run_dir}", "placement=offloaded", "model=tiny"])
    folder.close()
    assert cfg["placement"]["name"] == "offloaded" and cfg["model"]["path"] == "tiny"
    with pytest.raises(Exception, match="trainer.nope"):
        RunFolder.start(["resume=true", f"run_dir={run_dir}", "trainer.nope=1"])


# -- bullet 2: a fresh run refuses a folder that holds a run; new_run=true takes the next free one
def test_fresh_run_refuses_a_folder_that_holds_a_run(tmp_path):
    run_dir = tmp_path / "R"
    _saved_run(run_dir)
    before = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(RunFolderError, match="already holds a run.*resume=true.*new_run=true"):
        RunFolder.start(["model=tiny", f"run_dir={run_dir}"])
    assert (run_dir / "metrics.jsonl").read_text() == before
    folder, cfg = _start(["model=tiny", f"run_dir={run_dir}", "new_run=true"])
    folder.close()
    assert folder.path == tmp_path / "R-2" and cfg["run_dir"] == str(tmp_path / "R-2")


def _checkpoint(folder: RunFolder, step: int, keep: int) -> Path:
    return folder.save_checkpoint(step, lambda d: Path(d, "trainer.pt").write_text("x"), {"data": {}}, keep)


def test_pruning_never_deletes_the_current_checkpoint(tmp_path):
    folder = RunFolder(tmp_path / "R", resume=False)
    folder.path.mkdir()
    stale = folder.path / "checkpoints" / "step_000009"          # someone else's later checkpoint
    stale.mkdir(parents=True)
    (stale / "COMPLETE").write_text("")
    half = folder.path / "checkpoints" / "step_000001"           # a save cut by a kill
    half.mkdir()
    _checkpoint(folder, 2, keep=1)
    names = sorted(p.name for p in (folder.path / "checkpoints").iterdir())
    assert "step_000002" in names and "step_000001" not in names
    _checkpoint(folder, 4, keep=1)
    assert (folder.path / "checkpoints/step_000004/COMPLETE").exists()
    assert not (folder.path / "checkpoints/step_000002").exists()


def test_resume_point_cuts_metrics_to_the_checkpoint_rows(tmp_path):
    folder = RunFolder(tmp_path / "R", resume=True)
    folder.path.mkdir()
    metrics = folder.path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 1, 2)))
    _checkpoint(folder, 2, keep=2)
    metrics.write_text(metrics.read_text() + json.dumps({"step": 2, "eval/reward": 0}) + "\n" + '{"step": 3, "x"')
    ckpt, state = folder.resume_point()
    assert ckpt.name == "step_000002" and state["step"] == 2 and state["metrics_rows"] == 3
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [0, 1, 2]


# -- bullet 3: one live run per folder; a dead owner's lock is taken over
def test_lock_refuses_a_live_run_and_is_taken_over_from_a_dead_one(tmp_path):
    run_dir = tmp_path / "R"
    run_dir.mkdir()
    holder = _python(f"""
        from pathlib import Path
        from rlfp8.run_folder import RunLock
        RunLock(Path({str(run_dir)!r})).acquire()
        print("locked", flush=True)
        import time; time.sleep(600)
    """)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunFolderError, match=rf"in use by a live run \(pid {holder.pid} on host"):
            RunFolder.start(["model=tiny", f"run_dir={run_dir}"])
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    folder, _ = _start(["model=tiny", f"run_dir={run_dir}"])       # kill -9'd owner: taken over
    assert json.loads((run_dir / "run.lock").read_text())["pid"] == os.getpid()
    folder.close()


# -- bullet 5: scratch goes away on any exit; dead runs' leftovers are cleaned at start
@pytest.mark.parametrize("how", ["exit", "exception", "SIGTERM", "SIGINT"])
def test_scratch_removed_on_any_exit(tmp_path, how):
    p = _python(f"""
        import os, signal, sys, time
        from pathlib import Path
        from rlfp8.run_folder import RunFolder
        f = RunFolder(Path({str(tmp_path / 'R')!r}), resume=False)
        f.path.mkdir()
        d = f.scratch_dir()
        (d / "v000001").mkdir()
        print(d, flush=True)
        if {how!r} == "exception":
            raise RuntimeError("boom")
        if {how!r} in ("SIGTERM", "SIGINT"):
            time.sleep(60)
    """)
    scratch = Path(p.stdout.readline().strip())
    assert scratch.name.startswith(f"rlfp8-{p.pid}-")
    if how in ("SIGTERM", "SIGINT"):
        p.send_signal(getattr(signal, how))
    p.wait(timeout=60)
    assert not scratch.exists()
    assert p.returncode != 0 or how == "exit"


def test_dead_runs_scratch_is_cleaned_at_start(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    left = tmp_path / f"rlfp8-{dead_pid}-old-run"
    live = tmp_path / f"rlfp8-{os.getppid()}-live-run"
    other = tmp_path / "rlfp8-notapid-x"
    for d in (left, live, other):
        (d / "v000003").mkdir(parents=True)
    assert clean_dead_scratch(tmp_path) == [left]
    assert live.exists() and other.exists() and not left.exists()


# -- bullet 4 (the driver's part of exact resume): its RNG round-trips through driver.json
def test_driver_rng_round_trip():
    import random

    import torch
    state = json.loads(json.dumps(driver_rng_state()))
    a = (random.random(), torch.rand(3))
    restore_driver_rng(state)
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])


def test_step_seeds_depend_only_on_seed_and_step():
    from rlfp8.rollout.engine import prompt_seed
    from rlfp8.run_folder import step_seed
    seeds = {step_seed(0, s) for s in range(100)} | {step_seed(1, s) for s in range(100)}
    assert len(seeds) == 200 and step_seed(0, 5) == step_seed(0, 5) and 0 <= step_seed(7, 3) < 2**62
    per_prompt = [prompt_seed(step_seed(0, 5), i) for i in range(64)]
    assert len(set(per_prompt)) == 64 and all(0 <= s < 2**62 for s in per_prompt)
    # vLLM gives sample k of a prompt seed + k: no two prompts' sample streams meet for n <= 1024
    spans = sorted(per_prompt)
    assert min(b - a for a, b in zip(spans, spans[1:])) > 1024


def test_resume_is_validated_against_the_saved_config_not_the_recipe(tmp_path):
    run_dir = tmp_path / "R"
    _saved_run(run_dir, "engine.max_model_len=2048")
    # 1500 >= the quickstart's max_model_len 128, but < the run's own 2048
    folder, cfg = _start(["resume=true", f"run_dir={run_dir}", "algo.max_response_len=1500", "force=true"])
    folder.close()
    assert cfg["algo"]["max_response_len"] == 1500 and cfg["engine"]["max_model_len"] == 2048
    with pytest.raises(RunFolderError, match="no config.yaml"):
        RunFolder.start(["resume=true", f"run_dir={tmp_path / 'empty'}"])
