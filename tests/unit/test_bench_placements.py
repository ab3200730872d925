"""bench/placements.py (run on a GPU): its arguments parse, each placement's overrides compose into a valid config
(the same prompts and sizes for all), and the table is built from a run folder's metrics."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import placements as bench  # noqa: E402


def test_args_and_every_placement_composes(tmp_path):
    from rlfp8.config import compose_dict
    args = bench.parse_args(["--out", str(tmp_path / "p.json"), "--steps", "2", "--response-len", "128"])
    assert args.placements == list(bench.PLACEMENTS)
    cfgs = {p: compose_dict(bench.overrides(args, p, tmp_path / p)) for p in args.placements}
    for p, cfg in cfgs.items():
        assert cfg["placement"]["name"] == p and cfg["model"]["path"] == "random:qwen3_8b"
        assert cfg["engine"]["precision"] == "w8a16" and cfg["engine"]["enforce_eager"] is True
        assert cfg["algo"]["max_response_len"] == 128 and cfg["steps"] == 2
    same = {k: {json.dumps(c[k], sort_keys=True) for c in cfgs.values()} for k in ("data", "algo", "adapter", "seed")}
    assert all(len(v) == 1 for v in same.values()), same          # the same prompts and batch everywhere
    assert cfgs["one_copy"]["placement"]["checksum_every"] == 0


def test_bad_placement_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", str(tmp_path / "p.json"), "--placements", "one_copy,three_copies"])


def test_summary_and_table_from_metrics(tmp_path):
    rows = [{"step": s, "reward/mean": 0.0, "time/rollout": 4.0, "time/train": 6.0, "time/sync": 0.5,
             "time/step": 10.5, "rollout/tokens_per_s": 1000.0 * s, "train/tokens_per_s": 3000.0,
             "memory/rollout/total_gib": 140.0, "memory/rollout/free_gib": 100.0 - s, "memory/rollout/kv_cache_gib": 24.0,
             "memory/train/total_gib": 140.0, "memory/train/free_gib": 110.0, "memory/train/kv_cache_gib": 0.0,
             "memory/train/trainer_base_gib": 0.0} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    summary = bench.summarize(tmp_path)
    assert summary["memory_gib"]["rollout"]["device_used_gib"] == 43.0       # the worst step
    assert summary["rollout_tokens_per_s"] == 2500.0                         # first step excluded
    text = bench.table({"one_copy": {**summary, "wall_s": 90.0, "returncode": 0}, "offloaded": {"returncode": 1}})
    assert "| one_copy | 4.0 | 6.0 | 0.5 | 10.5 | 43.0 / 30.0 | 24.0 / 0.0 | 0.00 |" in text
    assert "| offloaded | failed (rc 1) |" in text
