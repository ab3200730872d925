"""The real architectures of rlfp8/models (model.path=random:<arch>) build in transformers with the parameter
counts of the published checkpoints (their safetensors' total size / 2 bytes), the q/k/v biases their class
implies, and the projection sizes the memory plan counts (rlfp8.memory_plan.projection_params)."""
import pytest
import torch

from rlfp8.memory_plan import projection_params
from rlfp8.models import ARCHITECTURES, architecture_config

PUBLISHED_PARAMETERS = {"qwen3_8b": 8_190_735_360, "qwen3_32b": 32_762_123_264, "llama3_8b": 8_030_261_248,
                        "qwen2_5_7b": 7_615_616_512}
QKV_BIAS = {"qwen2_5_7b"}


def _meta_model(arch: str):
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model(**architecture_config(arch))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_every_architecture_has_a_published_count():
    assert sorted(PUBLISHED_PARAMETERS) == sorted(ARCHITECTURES)


@pytest.mark.parametrize("arch", sorted(PUBLISHED_PARAMETERS))
def test_architecture_builds_at_its_published_size(arch):
    model = _meta_model(arch)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[arch]
    biased = {n.rsplit(".", 2)[-2] for n, _ in model.named_parameters() if n.endswith(".bias")}
    assert biased == ({"q_proj", "k_proj", "v_proj"} if arch in QKV_BIAS else set())
    projections = sum(m.weight.numel() for n, m in model.named_modules() if n.endswith("_proj"))
    assert projection_params(architecture_config(arch)) == projections
