"""bench/e2e.py's scheduler with a stand-in for rlfp8-train: the next run starts as soon as any finishes, and a
run that stops out of device memory beside others is set aside, queued again once, with one run fewer at once."""
import json
import sys
import textwrap

import pytest

from tests.bench_scripts import load_bench_script



@pytest.fixture()
def e2e():
    return load_bench_script("e2e")


FAKE_TRAIN = textwrap.dedent('''
    import json, sys, time
    from pathlib import Path
    run_dir = Path(next(a for a in sys.argv[1:] if a.startswith("run_dir="))[len("run_dir="):])
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / "starts.jsonl"
    with log.open("a") as f:
        f.write(json.dumps({"name": run_dir.name, "t": time.time()}) + "\\n")
    marker = run_dir.parent / (run_dir.name + ".oomed")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\\n")
    if "oom" in run_dir.name and not marker.exists():
        marker.write_text("")
        print("rlfp8-train: out of memory in phase 'train'")
        sys.exit(4)
    time.sleep(float(next((a.split("=")[1] for a in sys.argv if a.startswith("sleep=")), "0")))
    sys.exit(0)
''')


def _run(e2e, tmp_path, monkeypatch, *args):
    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE_TRAIN)
    monkeypatch.setattr(e2e, "TRAIN_COMMAND", [sys.executable, str(fake)])
    monkeypatch.setattr(e2e, "versions", lambda: {})
    out, root = tmp_path / "out.json", tmp_path / "runs"
    rc = e2e.main(["--out", str(out), "--runs-root", str(root), "--poll-s", "0.05", *args])
    return rc, json.loads(out.read_text()), root


def test_an_out_of_memory_run_is_retried_once_with_one_run_fewer_at_once(e2e, tmp_path, monkeypatch):
    rc, result, root = _run(e2e, tmp_path, monkeypatch, "--parallel", "3",
                            "--run", "a:sleep=0.5", "--run", "b_oom:sleep=0", "--run", "c:sleep=0.5")
    assert rc == 0
    b = result["runs"]["b_oom"]
    assert b["returncode"] == 0 and len(b["attempts"]) == 1
    first = b["attempts"][0]
    assert first["returncode"] == 4 and first["kept_as"] == "b_oom.oom1" and "out of memory" in first["error_tail"]
    assert (root / "b_oom.oom1" / "metrics.jsonl").exists() and (root / "b_oom.oom1.log").exists()
    assert (root / "b_oom" / "metrics.jsonl").exists()
    assert {r["returncode"] for r in result["runs"].values()} == {0}


def test_the_next_run_starts_when_any_finishes_not_the_first(e2e, tmp_path, monkeypatch):
    rc, result, root = _run(e2e, tmp_path, monkeypatch, "--parallel", "2",
                            "--run", "slow:sleep=2.0", "--run", "fast:sleep=0", "--run", "next:sleep=0")
    assert rc == 0
    starts = {json.loads(line)["name"]: json.loads(line)["t"] for line in (root / "starts.jsonl").read_text().splitlines()}
    assert starts["next"] - starts["slow"] < 1.5          # it did not wait for the slow first run


def test_out_of_memory_alone_is_not_retried(e2e, tmp_path, monkeypatch):
    rc, result, root = _run(e2e, tmp_path, monkeypatch, "--parallel", "1", "--run", "solo_oom:sleep=0")
    assert rc == 1
    assert result["runs"]["solo_oom"]["returncode"] == 4 and "attempts" not in result["runs"]["solo_oom"]
    assert not (root / "solo_oom.oom1").exists()
