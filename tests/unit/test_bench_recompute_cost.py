"""bench/lab/recompute_cost.py on the CPU with a scaled-down Qwen3 (2 layers, hidden 1024): every arm trains the same
update, and auto's layer count follows the memory it is given."""
import json
from pathlib import Path

import pytest

from tests.bench_scripts import BENCH, load_bench_script

SMALL = Path(__file__).resolve().parents[1] / "data" / "qwen3_gpu_small.json"


@pytest.mark.parametrize("free_gib, auto_checkpointed", [(None, 0), (0.0, 2)])
def test_arms_train_the_same_update(tmp_path, free_gib, auto_checkpointed):
    assert (BENCH / "lab" / "recompute_cost.py").exists()
    mod = load_bench_script("lab/recompute_cost")
    out = tmp_path / "rc.json"
    argv = ["--arch", str(SMALL), "--layers", "2", "--rows", "2", "--length", "24", "--micro-batch", "256",
            "--dtype", "float32", "--rank", "4", "--warmup", "0", "--steps", "1", "--modes", "true,auto,false",
            "--cache", str(tmp_path / "cache"), "--out", str(out)]
    assert mod.main(argv + (["--free-gib", str(free_gib)] if free_gib is not None else [])) == 0
    r = json.loads(out.read_text())
    assert [a["mode"] for a in r["arms"]] == ["true", "auto", "false"]
    assert [a["checkpointed_layers"] for a in r["arms"]] == [2, auto_checkpointed, 0]
    assert all(a["max_rel_grad_diff_vs_first"] == 0.0 for a in r["arms"])
    assert r["arms"][1]["saved_kib_per_token_layer"] > 2 * 1024 * 4 / 1024      # > two fp32 hidden vectors
    assert r["layers"] == 2 and r["command"]
