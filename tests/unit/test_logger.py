"""rlfp8.logger: run folder files, W&B modes (offline / disabled / missing / failing), plot, resume."""
import json
import logging
import sys
import types

import pytest
import torch
import yaml

from rlfp8.logger import RunLogger, make_plot, read_metrics, resolve_wandb_mode

CFG = {"model": {"name": "tiny", "path": None}, "algo": {"correction": "tis", "cap": 2.0, "eps": [0.2, 0.28]}}


@pytest.fixture(autouse=True)
def _quiet_wandb(monkeypatch, tmp_path):
    # no network, no files outside tmp_path
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))


def _steps(logger, steps):
    for s in steps:
        logger.log(s, {"reward/mean": 0.1 * s, "mismatch/kl_k3": 1e-4 * s, "time/rollout": 1.0,
                       "time/train": 2.0, "time/sync": 0.5, "time/step": 3.5})


def test_disabled_writes_config_jsonl_plot(tmp_path, capsys):
    run = tmp_path / "run"
    lg = RunLogger(run, CFG, wandb_mode="disabled", project="t")
    assert yaml.safe_load((run / "config.yaml").read_text()) == CFG
    lg.log(1, {"reward/mean": torch.tensor(0.5), "loss": float("nan"), "n": 3})
    _steps(lg, [2, 3])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["reward/mean"] == 0.5 and rows[0]["n"] == 3
    assert rows[0]["loss"] is None                      # strict JSON: non-finite -> null
    assert all(isinstance(r["time"], float) for r in rows)
    assert rows[2]["time/step"] == 3.5
    out = capsys.readouterr().out
    assert "step 1 | reward 0.500" in out and "kl_k3 3.00e-04" in out and "step_time 3.5s" in out
    png = lg.finish()
    assert png == run / "plot.png" and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (run / "wandb").exists() and not (run / "wandb_id.txt").exists()
    assert lg.finish() == png                           # idempotent


def test_resume_truncates_and_appends(tmp_path):
    run = tmp_path / "run"
    lg = RunLogger(run, CFG, wandb_mode="disabled")
    _steps(lg, [1, 2, 3, 4, 5])
    lg.finish()
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "rew')                     # crash mid-write
    lg = RunLogger(run, CFG, wandb_mode="disabled", resume=True)
    assert lg.truncate_after(3) == 3
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    _steps(lg, [4])
    lg.finish()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]
    # a fresh (non-resume) run in the same folder starts a new metrics file
    RunLogger(run, CFG, wandb_mode="disabled").finish()
    assert read_metrics(run / "metrics.jsonl") == []


def test_offline_wandb_under_run_dir_and_resume_same_id(tmp_path):
    run = tmp_path / "run"
    lg = RunLogger(run, CFG, wandb_mode="offline", project="t", name="n")
    assert lg.wandb_run is not None
    _steps(lg, [1, 2])
    lg.finish()
    run_id = (run / "wandb_id.txt").read_text().strip()
    assert len(run_id) == 8
    offline = sorted(p.name for p in (run / "wandb").glob("offline-run-*"))
    assert offline and all(p.endswith(run_id) for p in offline)
    lg = RunLogger(run, CFG, wandb_mode="offline", project="t", resume=True)
    assert lg.wandb_run is not None and lg.wandb_run.id == run_id
    lg.finish()
    assert (run / "wandb_id.txt").read_text().strip() == run_id


def test_wandb_missing_or_failing_never_crashes(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="rlfp8.logger")
    # missing: import wandb raises ImportError
    monkeypatch.setitem(sys.modules, "wandb", None)
    lg = RunLogger(tmp_path / "a", CFG, wandb_mode="offline")
    _steps(lg, [1])
    assert lg.finish().exists()
    assert "not importable" in caplog.text

    # init raises
    fake = types.ModuleType("wandb")
    def bad_init(**kw):
        raise RuntimeError("boom")
    fake.init = bad_init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    lg = RunLogger(tmp_path / "b", CFG, wandb_mode="online")
    _steps(lg, [1])
    assert lg.wandb_run is None and "wandb.init failed" in caplog.text
    lg.finish()

    # log raises: W&B is switched off, the JSONL keeps going
    class Run:
        id = "x"
        finished = False
        def log(self, *a, **k):
            raise RuntimeError("network down")
        def finish(self):
            Run.finished = True
    fake.init = lambda **kw: Run()
    lg = RunLogger(tmp_path / "c", CFG, wandb_mode="online")
    _steps(lg, [1, 2])
    assert lg.wandb_run is None and Run.finished and "wandb.log failed" in caplog.text
    assert [r["step"] for r in read_metrics(tmp_path / "c" / "metrics.jsonl")] == [1, 2]
    lg.finish()


def test_auto_mode_resolution(tmp_path, monkeypatch):
    assert resolve_wandb_mode("auto") == "offline"      # no key, empty netrc (fixture)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_wandb_mode("auto") == "online"
    monkeypatch.delenv("WANDB_API_KEY")
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    monkeypatch.setenv("NETRC", str(netrc))
    assert resolve_wandb_mode("auto") == "online"
    assert resolve_wandb_mode("disabled") == "disabled"
    with pytest.raises(ValueError, match="allowed values"):
        resolve_wandb_mode("on")
    with pytest.raises(ValueError, match="allowed values"):
        RunLogger(tmp_path / "r", CFG, wandb_mode="cloud")


def test_make_plot_partial_metrics(tmp_path):
    # only eval reward, a non-positive KL (linear scale) and total step time; no train reward
    p = tmp_path / "m.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [
        {"step": 1, "time": 0.0, "mismatch/kl_k3": 0.0, "time/step": 2.0},
        {"step": 2, "time": 1.0, "mismatch/kl_k3": 1e-3, "time/step": 2.5, "eval/reward": 0.4},
    ]) + "\n")
    out = make_plot(p, tmp_path / "sub" / "plot.png")
    assert out.stat().st_size > 1000
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert make_plot(empty, tmp_path / "e.png").stat().st_size > 1000
