"""GPU tier of placement=one_copy and the KV-only release (marked gpu; < 4 min on an H200).

1. CUDA IPC: the engine (vLLM 0.26, rlfp8's W8A16 plugin, a scaled-down random Qwen3 of 4 layers, hidden 1024:
   tests/data/qwen3_gpu_small.json) exports its FP8 codes; a trainer in ANOTHER process maps them. A byte
   written through the engine's fused qkv tensor shows in the trainer's k_proj view; both sides' checksums are
   equal; the trainer process's torch.cuda.memory_allocated stays far below the base it computes on (the
   mapped codes are the engine's allocation, not its own).
2. KV release/resume x100 (model=tiny from a checkpoint, CUDA graphs on, a 2 GiB KV cache): each release frees
   the KV cache, device free memory after each resume does not drift, and greedy generation afterwards
   returns the same tokens as before the loop.

3. Weights to the host and back (engine.release_weights, verl's colocated recipe: a bf16 engine, vLLM's own weights
   in its cuMem pool, decode graphs): three rounds of KV out, weights out (the device gets them back, the host
   holds them, memory() says 0 on the device), weights back, KV back; then the weights' checksum and greedy
   tokens equal those before, the device's free memory is where it was, and the pinned host pages are returned.

Each scenario runs in its own process (one vLLM engine per process); it writes a JSON the test checks.
    python -m pytest tests/gpu/test_one_copy_gpu.py -m gpu -v -s
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
ARCH = f"random:{ROOT / 'tests' / 'data' / 'qwen3_gpu_small.json'}"
MIB = 2**20


def _scenario(name: str, tmp_path: Path, timeout: int = 200) -> dict:
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "RLFP8_CACHE": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, __file__, name, str(out), str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0 and out.exists(), p.stderr[-4000:]
    result = json.loads(out.read_text())
    print(name, json.dumps(result, indent=1))
    return result


def test_trainer_in_another_process_maps_the_engines_codes_through_cuda_ipc(tmp_path):
    r = _scenario("ipc", tmp_path)
    assert r["handle_kinds"] == ["cuda_ipc"]
    assert r["byte_written"] == r["byte_seen_by_trainer"] != r["byte_before"]
    assert r["byte_restored_seen"] == r["byte_before"]
    assert r["checksums_equal"] and r["checksums_equal_after_write_and_restore"] and r["projections"] == 28
    assert r["base_bytes"] > 50 * MIB                                  # 4 layers of FP8 codes + scales
    assert r["trainer_allocated_bytes"] < 0.1 * r["base_bytes"], r     # ...none of them the trainer's own
    assert r["trainer_base_gib"] == 0.0


def test_kv_release_resume_100_times_no_leak_same_greedy_tokens(tmp_path):
    r = _scenario("kv", tmp_path)
    assert not r["enforce_eager"]                                      # CUDA graphs captured before the loop
    assert min(r["released_gib"]) > 0.9 * r["kv_gib"] > 1.5             # every release freed the KV cache
    assert max(r["free_after_resume"]) - min(r["free_after_resume"]) < 64 * MIB, r["free_after_resume"][:5]
    assert r["free_after_resume"][-1] >= r["free_before_loop"] - 64 * MIB
    assert r["reserved_after"] - r["reserved_before"] < 64 * MIB
    assert r["tokens_after"] == r["tokens_before"] and all(len(t) == 32 for t in r["tokens_before"])


def test_weights_to_the_host_and_back_same_weights_same_tokens_host_returned(tmp_path):
    r = _scenario("weights", tmp_path)
    assert r["graph_mode"].startswith("FULL_DECODE_ONLY")               # decode graphs captured before the rounds
    assert min(r["weights_freed_gib"]) > 0.9 * r["weights_gib"] > 0.1   # each release gave the device the weights
    assert min(r["host_gib"]) >= 0.99 * r["weights_gib"]                 # ...and the host holds them
    assert r["engine_weights_gib_while_released"] == [0.0] * 3
    assert r["host_gib_after"] == 0.0 and r["host_cached_after"] is not None, r["host_memory_stats"]
    assert r["host_cached_after"] < 64 * MIB, r["host_memory_stats"]
    assert r["checksum_after"] == r["checksum_before"]
    assert r["free_after"] >= r["free_before"] - 64 * MIB, (r["free_before"], r["free_after"])    # no leak
    assert r["tokens_after"] == r["tokens_before"] and all(len(t) == 32 for t in r["tokens_before"])
    assert "engine.set_adapter while the weights are released" in r["set_adapter_while_released"]   # refused


# ---------------------------------------------------------------------------------------- the scenarios
def _cfg(*extra):
    from rlfp8.config import compose_dict
    return compose_dict(["model.dtype=bfloat16", "adapter.rank=8", "adapter.alpha=16", "engine.precision=w8a16",
                         "engine.max_model_len=512", "engine.max_num_seqs=16", "engine.gpu_memory_utilization=0.3",
                         *extra])


def _sync() -> None:
    import torch
    if torch.cuda.is_available():      # the scenario also runs on a CPU machine (files instead of IPC): a dry run
        torch.cuda.synchronize()


def _trainer_process(conn, folder: str, cfg: dict, handles: dict) -> None:
    """The trainer side in its own process: map, report, then answer reads of the k_proj view."""
    import torch

    from rlfp8.trainer.core import PolicyTrainer
    from rlfp8.trainer.fp8_lora import lora_modules
    trainer = PolicyTrainer(folder, cfg, weight_source="map", weight_handles=handles)
    _sync()
    k_view = lora_modules(trainer.model)["model.layers.0.self_attn.k_proj"].qweight
    conn.send({"checksums": trainer.base_checksums(), "allocated": torch.cuda.memory_allocated(),
               "memory": trainer.memory(), "q_rows": lora_modules(trainer.model)["model.layers.0.self_attn.q_proj"]
               .qweight.shape[0]})
    while (cmd := conn.recv()) != "stop":
        if cmd == "read":
            _sync()
            conn.send(int(k_view.view(torch.uint8)[0, 0].item()))
        elif cmd == "checksums":
            conn.send(trainer.base_checksums())


def scenario_ipc(tmp: Path) -> dict:
    import multiprocessing as mp

    import torch

    from rlfp8.rollout.compat import engine_model
    from rlfp8.rollout.engine import RolloutEngine
    from rlfp8.trainer.hf_models import resolve_model
    cfg = _cfg(f"model.path={ARCH}", "placement=one_copy", "engine.enforce_eager=true", "engine.release_kv=false")
    folder = str(resolve_model(ARCH, tmp / "cache"))
    engine = RolloutEngine(folder, cfg)
    handles = engine.export_weights(str(tmp / "weights"))     # CPU dry run: files there; GPU: IPC
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_trainer_process, args=(child, folder, cfg, handles))
    proc.start()
    first = parent.recv()
    eng = engine.base_checksums()
    qkv = engine_model(engine.llm).model.layers[0].self_attn.qkv_proj.base_layer.weight
    raw = qkv.data.view(torch.uint8)
    before = int(raw[first["q_rows"], 0].item())
    written = (before + 77) % 256
    raw[first["q_rows"], 0] = written
    _sync()
    parent.send("read")
    seen = parent.recv()
    raw[first["q_rows"], 0] = before
    _sync()
    parent.send("read")
    restored = parent.recv()
    parent.send("checksums")
    after = parent.recv()
    parent.send("stop")
    proc.join(60)
    from rlfp8.rollout.weight_export import _rlfp8_linears
    base_bytes = sum(t.numel() * t.element_size() for m in _rlfp8_linears(engine_model(engine.llm)).values()
                     for t in (m.weight, m.weight_scale))
    return {"handle_kinds": sorted({e["weight"][0] for e in handles["projections"].values()}),
            "byte_before": before, "byte_written": written, "byte_seen_by_trainer": seen,
            "byte_restored_seen": restored, "projections": len(first["checksums"]),
            "checksums_equal": first["checksums"] == {k: eng[k] for k in first["checksums"]},
            "checksums_equal_after_write_and_restore": after == first["checksums"],
            "base_bytes": base_bytes, "trainer_allocated_bytes": first["allocated"],
            "trainer_base_gib": first["memory"].get("memory/trainer_base_gib"), "trainer_memory": first["memory"]}


def scenario_kv(tmp: Path) -> dict:
    import torch

    from rlfp8.rollout.engine import RolloutEngine
    from rlfp8.trainer.hf_models import resolve_model
    cfg = _cfg("model=tiny", "model.dtype=bfloat16", "placement=one_copy", "engine.enforce_eager=false",
               "engine.release_kv=true", "engine.kv_cache_memory_gb=2")
    engine = RolloutEngine(str(resolve_model("tiny", tmp / "cache")), cfg)
    prompts = [[1, 5, 9, 20 + i, 7, 3] for i in range(8)]
    greedy = lambda: [s.token_ids for s in engine.generate(prompts, 1, 1.0, 32, greedy=True)]   # noqa: E731
    tokens_before = greedy()
    kv_gib = engine.kv_cache_bytes() / 2**30
    torch.cuda.synchronize()
    free_before, reserved_before = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    released, free_after = [], []
    for _ in range(100):
        released.append(engine.release_kv()["memory/kv_released_gib"])
        engine.resume_kv()
        torch.cuda.synchronize()
        free_after.append(torch.cuda.mem_get_info()[0])
    return {"enforce_eager": bool(cfg["engine"]["enforce_eager"]), "kv_gib": kv_gib, "released_gib": released,
            "free_before_loop": free_before, "free_after_resume": free_after, "reserved_before": reserved_before,
            "reserved_after": torch.cuda.memory_reserved(), "tokens_before": tokens_before, "tokens_after": greedy()}


def scenario_weights(tmp: Path) -> dict:
    import torch

    from rlfp8.rollout.compat import engine_model
    from rlfp8.rollout.engine import RolloutEngine
    from rlfp8.trainer.hf_models import resolve_model
    cfg = _cfg(f"model.path={ARCH}", "engine.precision=bf16", "trainer.weights=bf16", "placement=offloaded",
               "engine.release_weights=true", "engine.parity_probe.every=0", "engine.enforce_eager=false",
               "engine.compile=false", "engine.kv_cache_memory_gb=2")
    engine = RolloutEngine(str(resolve_model(ARCH, tmp / "cache")), cfg)
    model = engine_model(engine.llm)
    checksum = lambda: sum(float(t.double().sum()) for t in model.parameters())    # noqa: E731
    prompts = [[1, 5, 9, 20 + i, 7, 3] for i in range(8)]
    greedy = lambda: [s.token_ids for s in engine.generate(prompts, 1, 1.0, 32, greedy=True)]   # noqa: E731
    tokens_before, checksum_before = greedy(), checksum()
    weights_gib = engine.memory()["memory/engine_weights_gib"]
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    freed, host, shown = [], [], []
    refused = "ran"
    for _ in range(3):
        engine.release_kv()
        out = engine.release_weights()
        freed.append(out["memory/weights_released_gib"])
        host.append(out["memory/engine_host_gib"])
        shown.append(engine.memory()["memory/engine_weights_gib"])
        try:                             # the slot lives among the weights: writing it now must be refused
            engine.set_adapter({"version": 1, "tensors": {}, "config": {}})
        except RuntimeError as e:
            refused = str(e)
        engine.resume_weights()
        engine.resume_kv()
    torch.cuda.synchronize()
    free_after = torch.cuda.mem_get_info()[0]
    stats = torch.cuda.host_memory_stats()
    cached = stats.get("allocated_bytes.current")     # pinned blocks the allocator owns: in use + cached
    return {"graph_mode": engine.graph_mode, "weights_gib": weights_gib, "weights_freed_gib": freed, "host_gib": host,
            "engine_weights_gib_while_released": shown, "set_adapter_while_released": refused,
            "host_gib_after": engine.memory()["memory/engine_host_gib"], "host_cached_after": cached,
            "host_memory_stats": {k: v for k, v in stats.items() if "bytes" in k},
            "checksum_before": checksum_before, "checksum_after": checksum(), "free_before": free_before,
            "free_after": free_after, "tokens_before": tokens_before, "tokens_after": greedy()}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    name, out, tmp = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    result = {"ipc": scenario_ipc, "kv": scenario_kv, "weights": scenario_weights}[name](tmp)
    out.write_text(json.dumps(result))
