"""FP8LoRALinear against PEFT's LoRA on the dequantized weights, and adapter files PEFT can read."""
import copy

import pytest
import torch
from torch import nn

from rlfp8.kernels.fp8 import dequantize_weight
from rlfp8.trainer.adapter_io import load_adapter, save_adapter
from rlfp8.trainer.fp8_lora import FP8LoRALinear, adapters_disabled, apply_lora, lora_modules
from tests.conftest import rel_err

peft = pytest.importorskip("peft")


class TwoLayer(nn.Module):
    def __init__(self, k=48, n=40, bias=True):
        super().__init__()
        self.up_proj = nn.Linear(k, n, bias=bias)
        self.down_proj = nn.Linear(n, k, bias=False)

    def forward(self, x):
        return self.down_proj(torch.tanh(self.up_proj(x)))


@pytest.mark.parametrize("use_rslora", [False, True])
def test_fp8_lora_matches_peft_forward_backward_fp32(use_rslora):
    base = TwoLayer()
    ours = copy.deepcopy(base)
    apply_lora(ours, rank=6, alpha=12, targets=["up_proj", "down_proj"], use_rslora=use_rslora, weights="fp8")
    with torch.no_grad():                         # non-zero B so the adapter contributes
        for m in lora_modules(ours).values():
            m.lora_B.normal_(0, 0.2)
    # The oracle: PEFT LoRA on a plain fp32 model holding the dequantized weights s_w * q.
    oracle_base = copy.deepcopy(base)
    with torch.no_grad():
        for name, m in lora_modules(ours).items():
            oracle_base.get_submodule(name).weight.copy_(dequantize_weight(m.qweight, m.weight_scale))
    oracle = peft.get_peft_model(oracle_base, peft.LoraConfig(r=6, lora_alpha=12, target_modules=["up_proj", "down_proj"],
                                                             use_rslora=use_rslora, lora_dropout=0.0))
    with torch.no_grad():
        for name, m in lora_modules(ours).items():
            pm = oracle.base_model.model.get_submodule(name)
            pm.lora_A["default"].weight.copy_(m.lora_A)
            pm.lora_B["default"].weight.copy_(m.lora_B)
            assert pm.scaling["default"] == pytest.approx(m.scaling)
    x = torch.randn(5, 7, 48, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    dy = torch.randn(5, 7, 48)
    y = ours(x)
    y.backward(dy)
    y_ref = oracle(x2)
    y_ref.backward(dy)
    assert rel_err(y, y_ref) <= 1e-5
    assert rel_err(x.grad, x2.grad) <= 1e-5
    for name, m in lora_modules(ours).items():
        pm = oracle.base_model.model.get_submodule(name)
        assert rel_err(m.lora_A.grad, pm.lora_A["default"].weight.grad) <= 1e-5, name
        assert rel_err(m.lora_B.grad, pm.lora_B["default"].weight.grad) <= 1e-5, name
    # only the adapters train; the FP8 base is buffers
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == {
        "up_proj.lora_A", "up_proj.lora_B", "down_proj.lora_A", "down_proj.lora_B"}
    assert ours.up_proj.qweight.dtype == torch.float8_e4m3fn and ours.up_proj.weight is None


def test_peft_init_and_disable():
    m = FP8LoRALinear.from_linear(nn.Linear(32, 16), rank=4, alpha=8)
    assert torch.all(m.lora_B == 0) and m.lora_A.abs().max() > 0 and m.scaling == 2.0
    bound = 1 / 32 ** 0.5                          # kaiming_uniform(a=sqrt(5)) on fan_in=32
    assert m.lora_A.abs().max() <= bound
    holder = nn.Sequential(m)
    with torch.no_grad():
        m.lora_B.normal_()
    x = torch.randn(3, 32)
    with_adapter = holder(x)
    with adapters_disabled(holder):
        without = holder(x)
    assert not torch.allclose(with_adapter, without)
    assert torch.allclose(holder(x), with_adapter)


def test_bad_config_errors():
    with pytest.raises(ValueError, match="trainer.weights"):
        FP8LoRALinear(8, 8, 2, 4, weights="int4")
    with pytest.raises(ValueError, match="target_modules"):
        apply_lora(TwoLayer(), rank=2, alpha=4, targets=["nonexistent_proj"])


def test_saved_adapter_loads_in_peft_with_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from rlfp8.trainer.hf_models import make_tiny_qwen3
    folder = make_tiny_qwen3(tmp_path / "tiny", seed=3)
    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    apply_lora(ours, rank=8, alpha=16, weights="fp8")
    with torch.no_grad():
        for m in lora_modules(ours).values():
            m.lora_B.normal_(0, 0.1)
    adir = save_adapter(ours, tmp_path / "adapter", str(folder))

    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():                          # the same base PEFT would see: s_w * q
        for name, m in lora_modules(ours).items():
            base.get_submodule(name).weight.copy_(dequantize_weight(m.qweight, m.weight_scale))
    pm = peft.PeftModel.from_pretrained(base, str(adir))
    ids = torch.randint(0, ours.config.vocab_size, (2, 17))
    with torch.no_grad():
        ref = pm(input_ids=ids).logits
        out = ours(input_ids=ids).logits
    assert rel_err(out, ref) <= 1e-5
    with torch.no_grad(), pm.disable_adapter():
        assert rel_err(pm(input_ids=ids).logits, ref) > 1e-3       # the adapter really mattered

    # and back: a fresh model loads the file and reproduces the logits exactly
    fresh = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    apply_lora(fresh, rank=8, alpha=16, weights="fp8")
    load_adapter(fresh, adir)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, out)
    wrong = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    apply_lora(wrong, rank=4, alpha=16, weights="fp8")
    with pytest.raises(ValueError, match="adapter.rank"):
        load_adapter(wrong, adir)
