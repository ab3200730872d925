"""bench/placements.py (run on a GPU): issue 14's configurations compose into valid configs with the same prompts,
the memory plan sizes every KV cache by one rule and refuses what cannot fit (naming the configuration and the
keys), the budget schedules steps and skips, and the table / acceptance verdicts come from run metrics."""
import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.bench_scripts import load_bench_script  # noqa: E402

bench = load_bench_script("placements")

from rlfp8.models import architecture_config  # noqa: E402


def _args(*extra):
    return bench.parse_args(["--out", "/tmp/unused.json", *extra])


def _planned(shape, name, device_gib=bench.H200_DEVICE_GIB, host_gib=bench.H200_HOST_GIB, extra=()):
    args = _args("--shape", shape, "--response-len", "4096" if shape == "qwen3_32b" else "1024", *extra)
    cfg = bench.compose(bench.overrides(args, name, None, None))
    return cfg, bench.memory_plan(name, cfg, architecture_config(shape), device_gib, host_gib)


def test_every_configuration_composes_with_what_it_names(tmp_path):
    args = _args("--shape", "qwen3_8b", "--steps", "2")
    assert args.configs == list("abcde")
    cfgs = {n: bench.compose(bench.overrides(args, n, tmp_path / n, 50.0)) for n in args.configs}
    want = {"a": ("one_copy", "w8a16", "fp8", "none"), "b": ("one_copy", "w8a8", "fp8", "tis"),
            "c": ("two_copies", "w8a16", "fp8", "none"), "d": ("offloaded", "bf16", "bf16", "none"),
            "e": ("offloaded", "w8a8_vllm", "bf16", "tis")}
    for n, cfg in cfgs.items():
        got = (cfg["placement"]["name"], cfg["engine"]["precision"], cfg["trainer"]["weights"], cfg["algo"]["correction"])
        assert got == want[n], n
        assert cfg["model"]["path"] == "random:qwen3_8b" and cfg["engine"]["kv_cache_memory_gb"] == 50.0
        assert cfg["engine"]["max_model_len"] == 1024 + bench.PROMPT_TOKENS and cfg["steps"] == 2
        assert cfg["engine"]["enforce_eager"] is False and cfg["engine"]["compile"] is False     # decode graphs
        assert bench.engine_mode(cfg) == "decode_graphs" and cfg["engine"]["parity_probe"]["every"] == 0
    assert cfgs["a"]["engine"]["release_kv"] == "auto"               # = on for one_copy on a GPU
    # verl's colocated recipe and FlashRL's (a verl fork): the engine asleep, its weights on the host, while training
    assert {n for n, c in cfgs.items() if c["engine"]["release_weights"]} == {"d", "e"}
    same = {k: {json.dumps(c[k], sort_keys=True) for c in cfgs.values()} for k in ("data", "adapter", "seed")}
    assert all(len(v) == 1 for v in same.values()), same          # the same prompts and adapter everywhere
    assert {(c["algo"]["group_size"], c["data"]["prompts_per_step"]) for c in cfgs.values()} == {(8, 8)}


def test_bad_configuration_and_missing_out_are_refused():
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x.json", "--configs", "a,z"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--shape", "qwen3_8b"])


@pytest.mark.parametrize("shape", ["qwen3_8b", "llama3_8b", "qwen2_5_7b"])
def test_every_kv_cache_is_what_its_placement_leaves_of_the_same_usable_memory(shape):
    assert _args("--shape", shape).configs == list("abcde")           # every configuration at an 8B-class shape
    usable = bench.USABLE_FRACTION * bench.H200_DEVICE_GIB - bench.ENGINE_RUNTIME_GIB
    for name in "abcde":
        _, plan = _planned(shape, name)
        parts = [plan["rollout_parts_gib"]] + ([] if plan["kv_released_while_training"] else [plan["train_parts_gib"]])
        assert plan["kv_budget_gib"] + max(sum(p.values()) for p in parts) == pytest.approx(usable), name
        assert plan["refused"] is None and plan["kv_budget_gib"] > plan["kv_needed_gib"], name
    _, a = _planned(shape, "a")
    _, c = _planned(shape, "c")
    _, d = _planned(shape, "d")
    # one FP8 copy > verl's (one bf16 copy on the device while generating) > two resident FP8 copies
    assert a["kv_budget_gib"] > d["kv_budget_gib"] > c["kv_budget_gib"]
    # the host holds one 16-bit copy at a time: the trainer's base while generating, the engine's while training
    assert d["host_pinned_gib"] == pytest.approx(max(d["train_parts_gib"]["trainer_base"],
                                                     d["rollout_parts_gib"]["engine_weights"]
                                                     + d["rollout_parts_gib"]["engine_lora"]))
    assert a["host_pinned_gib"] == 0 and "engine_weights" not in d["train_parts_gib"]


def test_verl_recipe_at_32b_fits_one_copy_on_the_host_both_bases_on_the_device_between_the_phases():
    """(d) at the Qwen3-32B shape with the engine's weights on the host while training (engine.release_weights):
    rollout = the bf16 engine + its KV cache, train = the trainer's bf16 base + activations, between them both
    bases (126.5 GiB, no KV cache, no activations); the host holds 61.5 GiB at a time, not 122."""
    _, d32 = _planned("qwen3_32b", "d")
    assert d32["refused"] is None and d32["weights_released_while_training"] and d32["kv_released_while_training"]
    between = sum(d32["between_parts_gib"].values())
    assert between == pytest.approx(d32["rollout_parts_gib"]["engine_weights"] + d32["rollout_parts_gib"]["engine_lora"]
                                    + d32["train_parts_gib"]["trainer_base"] + d32["train_parts_gib"]["trainer_optimizer"])
    assert d32["usable_gib"] < between <= bench.BETWEEN_FRACTION * bench.H200_DEVICE_GIB
    assert d32["host_pinned_gib"] < 0.5 * bench.H200_HOST_GIB
    assert d32["host_moved_gib_per_step"] == pytest.approx(2 * (d32["train_parts_gib"]["trainer_base"]
                                                                + d32["rollout_parts_gib"]["engine_weights"]))
    _, a32 = _planned("qwen3_32b", "a")
    assert 1.4 < a32["kv_budget_gib"] / d32["kv_budget_gib"] < 1.6         # the plan's KV ratio, near the 1.5
    _, tight = _planned("qwen3_32b", "d", device_gib=130.0)                # both bases do not fit between the phases
    assert "cannot hold both bases between the phases (engine.release_weights)" in tight["refused"]


def test_the_fit_check_refuses_naming_the_configuration_and_the_keys():
    # without the engine asleep: two 16-bit copies of 32B on the device, 122 GiB before any KV cache
    _, d32 = _planned("qwen3_32b", "d", extra=("--extra", "engine.release_weights=false"))
    assert d32["refused"].startswith("configuration d (offloaded bf16 trainer + bf16 engine (verl)) cannot fit")
    assert "engine.precision=bf16" in d32["refused"] and "trainer.weights=bf16" in d32["refused"]
    # verl's alternative (engine asleep while training) needs both 16-bit copies pinned on the host: 122 of 128 GiB
    assert d32["engine_sleep_host_gib"] == pytest.approx(d32["rollout_parts_gib"]["engine_weights"]
                                                         + d32["train_parts_gib"]["trainer_base"])
    assert f"= {d32['engine_sleep_host_gib']:.1f} GiB pinned, more than 0.8 x the host's 128.0 GiB" in d32["refused"]
    _, d32_big_host = _planned("qwen3_32b", "d", host_gib=512.0, extra=("--extra", "engine.release_weights=false"))
    assert "GiB pinned, within 0.8 x the host's 512.0 GiB" in d32_big_host["refused"]
    _, a32 = _planned("qwen3_32b", "a")
    assert a32["refused"] is None and a32["kv_budget_gib"] >= a32["kv_needed_gib"]   # the whole 8 x 8 x 4k batch
    _, small = _planned("qwen3_32b", "a", device_gib=40.0)
    assert "configuration a" in small["refused"] and "engine.precision=w8a16" in small["refused"]
    _, update = _planned("qwen3_32b", "a", extra=("--extra", "trainer.micro_batch_tokens=600000"))
    assert "cannot fit its update" in update["refused"] and "trainer.micro_batch_tokens=600000" in update["refused"]
    _, host = _planned("qwen3_8b", "d", host_gib=16.0)
    assert "host copy" in host["refused"] and "trainer.weights=bf16" in host["refused"]


def _entries(*names, budget=0.0, steps=2):
    args = _args("--shape", "qwen3_8b", "--configs", ",".join(names), "--steps", str(steps), "--budget-s", str(budget))
    return args, bench.plan_all(args, bench.H200_DEVICE_GIB, bench.H200_HOST_GIB)


def test_the_budget_lowers_steps_then_skips_and_compilation_is_paid_once_per_kind():
    args, entries = _entries("a", "c", "d")
    assert entries["a"]["estimate_s"]["compile_s"] == 35.0        # engine w8a16 + trainer fp8: new
    assert entries["c"]["estimate_s"]["compile_s"] == 0.0         # the same kernels: Triton's cache
    assert entries["d"]["estimate_s"]["compile_s"] == 35.0        # bf16 engine + bf16 trainer: new
    assert bench.schedule(args, entries, "a", 0) == (2, "")        # no budget: --steps
    ests = {n: e["estimate_s"] for n, e in entries.items()}
    two_then_one_each = bench.run_s(ests["a"], 2) + bench.run_s(ests["c"], 1) + bench.run_s(ests["d"], 1)
    args.budget_s = 1e9
    assert bench.schedule(args, entries, "a", two_then_one_each) == (2, "")
    steps, why = bench.schedule(args, entries, "a", two_then_one_each - 1)
    assert steps == 1 and why.startswith("1 step")
    steps, why = bench.schedule(args, entries, "d", bench.run_s(ests["d"], 1) - ests["d"]["end_s"] - 1)
    assert steps is None and why.startswith("--budget-s")


def test_dry_run_prints_plans_commands_and_refusals(capsys):
    assert bench.main(["--shape", "qwen3_32b", "--response-len", "4096", "--configs", "a,d", "--dry-run",
                       "--budget-s", "520", "--extra", "engine.release_weights=false"]) == 0
    out = capsys.readouterr().out
    assert "| a: one_copy + w8a16 + KV release (ours) | 32.5 | 0.0 | 4.0 |" in out
    _, plan = _planned("qwen3_32b", "a")
    assert "refused: configuration d" in out and f"engine.kv_cache_memory_gb={plan['kv_budget_gib']:.2f}" in out
    assert bench.main(["--shape", "qwen3_32b", "--response-len", "4096", "--configs", "d", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "| KV + weights | 61.5 |" in out and "refused" not in out


def _metrics(tmp_path, steps, kv):
    rows = [{"step": s, "reward/mean": 0.0, "time/rollout": 4.0 * (2 if s == 1 else 1), "time/train": 6.0,
             "time/sync": 0.5, "time/moves": 0.25, "time/moves/before_train": 0.25, "time/step": 10.5,
             "rollout/tokens_per_s": 1000.0 * s, "train/tokens_per_s": 3000.0,
             "memory/rollout/total_gib": 140.0, "memory/rollout/free_gib": 100.0 - s, "memory/rollout/kv_cache_gib": kv,
             "memory/train/total_gib": 140.0, "memory/train/free_gib": 110.0, "memory/train/kv_cache_gib": 0.0,
             "memory/train/trainer_base_gib": 0.0} for s in range(1, steps + 1)]
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return bench.summarize(tmp_path)


def test_summary_table_and_acceptance_from_metrics(tmp_path):
    a = _metrics(tmp_path / "a", 2, kv=90.0)
    assert a["timed_steps"] == 1 and not a["cold"] and a["step_time_s"]["rollout"] == 4.0   # step 1 excluded
    assert a["moves_s"] == {"before_train": 0.25} and a["memory_gib"]["rollout"]["device_used_gib"] == 42.0
    d = {**_metrics(tmp_path / "d", 1, kv=50.0), "step_time_s": {"step": 20.0}}
    assert d["cold"]
    _, plan = _planned("qwen3_8b", "a")
    configs = {"a": {**a, "status": "ran", "returncode": 0, "wall_s": 90.0, "plan": plan},
               "d": {**d, "status": "ran", "returncode": 0}}
    acc = bench.acceptance({"shape": "qwen3_32b", "response_len": 4096, "configs": configs})
    assert acc["applies"] and acc["step_time"]["verdict"] == "PASS" and acc["step_time"]["ratio"] == 10.5 / 20.0
    assert acc["kv_cache_rollout"]["verdict"] == "PASS" and acc["kv_cache_rollout"]["ratio"] == 90.0 / 50.0
    configs["d"]["step_time_s"] = {"step": 12.0}
    configs["d"]["memory_gib"]["rollout"]["kv_cache_gib"] = 70.0
    acc = bench.acceptance({"shape": "qwen3_8b", "response_len": 1024, "configs": configs})
    assert not acc["applies"] and acc["step_time"]["verdict"] == "FAIL" and acc["kv_cache_rollout"]["verdict"] == "FAIL"
    refused = {"a": configs["a"], "d": {"status": "refused", "refused": "configuration d cannot fit"}}
    acc = bench.acceptance({"shape": "qwen3_32b", "response_len": 4096, "configs": refused})
    assert acc["step_time"] == {"verdict": "N/A", "why": "(d) refused: configuration d cannot fit"}
    assert "(a) step time <= 0.75 x (d): N/A" in bench.acceptance_text(acc)
    text = bench.table({"a": configs["a"], "d": refused["d"]})
    assert "| a | 4.0 | 6.0 | 0.5 | 0.2 | 10.5 | 42.0 / 30.0 / - | 90.0 (113.6) | 2000 | 3000 | 90.0 |" in text
    assert "| d | refused: configuration d cannot fit |" in text


def test_merge_pairs_a_with_d_like_with_like_and_keeps_what_never_ran(tmp_path):
    _, plan = _planned("qwen3_32b", "a")
    ran = lambda path, steps, kv: {**_metrics(path, steps, kv), "status": "ran", "returncode": 0, "wall_s": 1.0,
                                   "plan": plan}

    def result(name, configs):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"command": f"placements {name}", "date": "d", "environment": {"gpu": "g"},
                                    "shape": "qwen3_32b", "response_len": 4096, "configs": configs}))
        return str(path)

    a_cold = ran(tmp_path / "a1", 1, 90.0)
    d_cold = ran(tmp_path / "d1", 1, 50.0)
    d_cold["step_time_s"]["step"] = 20.0
    files = [result("one", {"a": a_cold, "b": {"status": "skipped", "skipped": "--budget-s: 5 s left"}}),
             result("two", {"d": d_cold}), result("three", {"a": ran(tmp_path / "a2", 2, 90.0)})]
    merged = bench.merge(files)
    group = merged["groups"]["qwen3_32b/4096"]
    assert [s["command"] for s in merged["sources"]] == ["placements one", "placements two", "placements three"]
    assert sorted(group["rows"]) == ["a#0", "a#2", "d#1"] and group["rows"]["a#2"]["cold"] is False
    assert group["not_run"] == {"b": [{"source": 0, "status": "skipped", "why": "--budget-s: 5 s left"}]}
    acc = group["acceptance"]        # (a)'s warm run has no warm (d) to compare with: cold against cold
    assert acc["pairing"] == "cold / cold" and acc["sources"] == {"a": 0, "d": 1}
    assert acc["step_time"]["ratio"] == 10.5 / 20.0 and acc["kv_cache_rollout"]["ratio"] == 90.0 / 50.0
    warm_d = bench.merge(files + [result("four", {"d": ran(tmp_path / "d2", 2, 60.0)})])["groups"]["qwen3_32b/4096"]
    assert warm_d["acceptance"]["pairing"] == "warm / warm" and warm_d["acceptance"]["sources"] == {"a": 2, "d": 3}
    assert warm_d["acceptance"]["kv_cache_rollout"]["ratio"] == 90.0 / 60.0
    only_a = bench.merge(files[:1])["groups"]["qwen3_32b/4096"]["acceptance"]
    assert only_a["pairing"] == "none" and only_a["step_time"]["verdict"] == "N/A"
    out = tmp_path / "merged.json"
    assert bench.main(["--merge", *files, "--out", str(out)]) == 0
    assert json.loads(out.read_text())["groups"]["qwen3_32b/4096"]["acceptance"]["pairing"] == "cold / cold"


def test_a_timed_out_run_is_killed_with_its_whole_process_group():
    """The run's child (bash) and its own child (a background sleep, as Ray's actors are the driver's) both end;
    the grandchild may linger as a zombie until init reaps it, but it runs no more."""
    p = subprocess.Popen(["bash", "-c", "sleep 300 & echo $!; wait"], start_new_session=True, stdout=subprocess.PIPE,
                         text=True)
    grandchild = int(p.stdout.readline())
    bench._kill_group(p)
    assert p.poll() is not None

    def state(pid):
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return "gone"
    for _ in range(50):
        if state(grandchild) in ("gone", "Z", "X"):
            break
        time.sleep(0.1)
    assert state(grandchild) in ("gone", "Z", "X")


def test_engine_mode_sets_the_engine_keys_and_the_rollout_estimate(tmp_path):
    from rlfp8.models import architecture_config
    arch = architecture_config("qwen3_8b")
    est = {}
    for mode in bench.ENGINE_MODES:
        args = _args("--shape", "qwen3_8b", "--engine-mode", mode)
        cfg = bench.compose(bench.overrides(args, "a", tmp_path / mode, 50.0))
        assert bench.engine_mode(cfg) == mode
        est[mode] = bench.estimate_wall_s(cfg, arch, bench.memory_plan("a", cfg, arch, 139.8, 128.0), 0.0)
    assert est["eager"]["rollout_s"] > 5 * est["decode_graphs"]["rollout_s"]        # host-bound eager decode
    assert est["compiled"]["start_s"] > est["decode_graphs"]["start_s"] > est["eager"]["start_s"]


def test_eager_estimate_separates_vllm_own_engines_from_ours(tmp_path):
    """Eager decode steps at 8B: ours (K1 + K2 launched from Python) 115 ms, vLLM's own bf16 / FP8 39-41 ms
    (H200 session 4): one eager cost for both overestimated (d) and (e) 1.7x and skipped them in session 5."""
    from rlfp8.models import architecture_config
    arch = architecture_config("qwen3_8b")
    rollout = {}
    for name in ("a", "d", "e"):
        args = _args("--shape", "qwen3_8b", "--engine-mode", "eager")
        cfg = bench.compose(bench.overrides(args, name, tmp_path / name, 50.0))
        rollout[name] = bench.estimate_wall_s(cfg, arch, bench.memory_plan(name, cfg, arch, 139.8, 128.0), 0.0)["rollout_s"]
    assert rollout["d"] == rollout["e"] and rollout["a"] > 2.5 * rollout["d"]
    assert 35 < rollout["d"] < 50                                 # 1024 steps x 40 ms: session 4's 40.0 / 41.8 s
