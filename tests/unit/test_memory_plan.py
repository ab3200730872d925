"""An out-of-memory error in any phase is re-raised with the memory plan and the config keys that size that phase
(rlfp8.memory_plan); other errors pass unchanged. The errors are injected: torch's OutOfMemoryError, vLLM's
KV-cache-too-small ValueError (its own text), and one wrapped the way Ray wraps an actor's error."""
import pytest
import torch

from rlfp8.config import compose_dict
from rlfp8.memory_plan import OutOfMemoryPlanError, is_out_of_memory, on_out_of_memory, phase_metrics

VLLM_KV_TOO_SMALL = ("To serve at least one request with the model's max seq len (1536), (0.21 GiB KV cache is "
                     "needed, which is larger than the available KV cache memory (0.10 GiB). Try increasing "
                     "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.")


class RayTaskErrorLike(Exception):
    def __init__(self, cause):
        super().__init__("ray.exceptions.RayTaskError(...): the actor died")
        self.cause = cause


@pytest.fixture(scope="module")
def cfg():
    return compose_dict(["model=tiny", "placement=one_copy", "engine.precision=w8a16", "engine.max_num_seqs=64",
                         "trainer.micro_batch_tokens=4096"])


def _raise_in(phase, cfg, error, measured=None):
    with pytest.raises(OutOfMemoryPlanError) as info:
        with on_out_of_memory(phase, cfg, measured or {}):
            raise error
    return str(info.value), info.value


def test_train_oom_names_the_trainer_keys_and_shows_the_measured_plan(cfg):
    measured = phase_metrics("rollout", {"memory/kv_cache_gib": 24.0, "memory/engine_weights_gib": 9.5})
    msg, err = _raise_in("train", cfg, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
                         measured)
    assert "phase 'train'" in msg and "rollout/kv_cache_gib: 24.00" in msg and "rollout/engine_weights_gib: 9.50" in msg
    for key in ("trainer.micro_batch_tokens=4096", "trainer.gradient_checkpointing=False", "engine.release_kv=auto"):
        assert key in msg
    assert "Tried to allocate 20.00 GiB" in msg and isinstance(err.__cause__, torch.OutOfMemoryError)


def test_vllm_kv_cache_too_small_at_setup_names_the_engine_keys(cfg, tmp_path):
    import json

    from rlfp8.models import architecture_config
    (tmp_path / "config.json").write_text(json.dumps(architecture_config("qwen3_8b")))
    cfg = {**cfg, "model": {**cfg["model"], "resolved_path": str(tmp_path)}}
    msg, _ = _raise_in("setup", cfg, ValueError(VLLM_KV_TOO_SMALL))
    assert "planned (rough" in msg and "kv_cache_needed" in msg
    for key in ("engine.gpu_memory_utilization=", "engine.kv_cache_memory_gb=None", "engine.max_num_seqs=64",
                "engine.max_model_len=", "nothing measured yet"):
        assert key in msg


def test_an_error_wrapped_by_ray_is_recognised_in_rollout(cfg):
    msg, _ = _raise_in("rollout", cfg, RayTaskErrorLike(torch.OutOfMemoryError("CUDA out of memory")))
    assert "phase 'rollout'" in msg and "engine.max_num_seqs=64" in msg and "OutOfMemoryError" in msg


def test_other_errors_pass_unchanged(cfg):
    assert not is_out_of_memory(ValueError("algo.temperature=0: RL needs sampling"))
    with pytest.raises(KeyError):
        with on_out_of_memory("sync", cfg, {}):
            raise KeyError("x")


def test_phase_metrics_prefix():
    assert phase_metrics("train", {"memory/trainer_peak_gib": 1.5}) == {"memory/train/trainer_peak_gib": 1.5}


def test_adapter_and_optimizer_sizes_match_the_trainer_at_qwen3_8b():
    """adapter_params reproduces the trainer's count on the H200 (its log: 87293952 trainable params at rank 32);
    the optimizer holds 16 bytes per parameter (fp32 value, gradient, two AdamW moments); one_copy on a random
    model maps the engine's embeddings/lm_head too, so the trainer owns no dense tensors there."""
    from rlfp8.memory_plan import adapter_params, estimate
    from rlfp8.models import architecture_config
    arch = architecture_config("qwen3_8b")
    cfg = compose_dict(["recipe=qwen3_8b_math", "model.dtype=bfloat16"])
    assert adapter_params(cfg, arch) == 87293952
    plan = estimate(cfg, arch)
    assert plan["trainer_optimizer"] == pytest.approx(87293952 * 16 / 2**30)
    assert plan["engine_lora"] == pytest.approx(87293952 * 2 / 2**30)
    assert plan["trainer_dense"] == 0 and plan["trainer_base"] == 0
    two = estimate(compose_dict(["recipe=qwen3_8b_math", "model.dtype=bfloat16", "placement=two_copies"]), arch)
    assert two["trainer_dense"] == pytest.approx(2 * 151936 * 4096 * 2 / 2**30)
    q_only = compose_dict(["recipe=qwen3_8b_math", "adapter.target_modules=[q_proj]", "adapter.rank=8"])
    assert adapter_params(q_only, arch) == 8 * (4096 + 4096) * 36


def test_release_weights_takes_the_engine_off_the_train_phase_and_counts_both_bases_between():
    """engine.release_weights: training holds no engine weights; the peak is the larger of rollout, train and the
    moment between them when both bases are on the device (rlfp8/placement/offloaded.py's order)."""
    from rlfp8.memory_plan import estimate
    from rlfp8.models import architecture_config
    arch = architecture_config("qwen3_32b")
    cfg = {"model": {"dtype": "bfloat16", "path": "random:qwen3_32b"}, "placement": {"name": "offloaded"},
           "engine": {"precision": "bf16", "max_num_seqs": 64, "max_model_len": 4608, "kv_cache_memory_gb": None,
                      "release_kv": "auto", "release_weights": False},
           "trainer": {"weights": "bf16", "micro_batch_tokens": 8192, "gradient_checkpointing": True,
                       "logprob_chunk": 1024},
           "data": {"prompts_per_step": 8}, "algo": {"group_size": 8},
           "adapter": {"rank": 64, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"]}}
    awake = estimate(cfg, arch)
    asleep = estimate({**cfg, "engine": {**cfg["engine"], "release_weights": True}}, arch)
    rollout = asleep["engine_weights"] + asleep["kv_cache"]             # the trainer's base waits on the host
    between = asleep["engine_weights"] + asleep["trainer_base"] + asleep["trainer_dense"]
    assert awake["peak"] == pytest.approx(rollout + awake["trainer_base"] + awake["trainer_dense"]
                                          + awake["trainer_activations"])     # train: all of it with the KV cache
    assert asleep["peak"] == pytest.approx(max(rollout, between, asleep["trainer_base"] + asleep["trainer_dense"]
                                               + asleep["trainer_activations"]))
    assert asleep["peak"] < awake["peak"] - 50
