"""DoRA (issue 16) on the CPU: the factored norm vs fp64 and PEFT's dense norm, FP8DoRALinear vs PEFT's DoRA
on the dequantized weights (outputs and every gradient), the bf16 arm, PEFT-format files, resume."""
import copy

import pytest
import torch
from torch import nn

from rlfp8.kernels import dispatch, fp8
from rlfp8.kernels import dora as kdora
from rlfp8.kernels.fp8 import dequantize_weight
from rlfp8.trainer.adapter_io import adapter_state_dict, load_adapter, save_adapter
from rlfp8.trainer.dora import FP8DoRALinear, trainable_params
from rlfp8.trainer.fp8_lora import apply_lora, lora_modules
from tests.conftest import rel_err
from tests.unit.test_fp8_lora import TwoLayer

peft = pytest.importorskip("peft")
TARGETS = ["up_proj", "down_proj"]


def _norm_fp64(q, sw, A, B, s):
    W = q.double() * sw.double()[:, None]
    return torch.linalg.norm(W + s * (B.double() @ A.double()), dim=1)


@pytest.mark.parametrize("N,K,r,s", [(40, 48, 6, 2.0), (17, 33, 40, 0.5), (64, 16, 1, 3.0), (24, 40, 8, 0.0)])
def test_factored_norm_vs_fp64_and_peft(N, K, r, s):
    q, sw = fp8.quantize_weight_ref(torch.randn(N, K) * 0.1)
    A, B = torch.randn(r, K) * 0.2, torch.randn(N, r) * 0.2
    n = kdora.dora_row_norm(q, sw, A, B, s)
    assert rel_err(n, _norm_fp64(q, sw, A, B, s)) <= 1e-6
    peft_layer = peft.tuners.lora.dora.DoraLinearLayer(fan_in_fan_out=False)
    n_peft = peft_layer.get_weight_norm(dequantize_weight(q, sw), B @ A, s)
    assert rel_err(n, n_peft) <= 1e-6
    w_sq = kdora.weight_sq_norm(q, sw)                                         # the cached base term
    assert rel_err(w_sq, (dequantize_weight(q, sw).double() ** 2).sum(1)) <= 1e-6
    assert torch.equal(kdora.dora_row_norm(q, sw, A, B, s, w_sq=w_sq), n)


def test_norm_reference_chunks_rows(monkeypatch):
    q, sw = fp8.quantize_weight_ref(torch.randn(37, 20))
    A = torch.randn(5, 20)
    whole = kdora.norm_pieces_ref(q, sw, A)
    monkeypatch.setattr(kdora, "CHUNK_ELEMS", 3 * 20)                          # 3 rows per chunk
    for a, b in zip(whole, kdora.norm_pieces_ref(q, sw, A)):
        assert rel_err(a, b) <= 1e-6


def test_column_scale_zero_row_and_m_grad():
    q, sw = fp8.quantize_weight_ref(torch.randn(8, 16))
    q[3] = 0                                                                   # a zero row: PEFT gives NaN
    B = torch.randn(8, 4)
    B[3] = 0
    m = torch.rand(8, requires_grad=True)
    g = kdora.dora_column_scale(m, q, sw, torch.randn(4, 16), B, 1.0)
    assert torch.isfinite(g).all() and g[3] == 0
    g.sum().backward()                                                         # differentiable in m only
    assert m.grad is not None and m.grad[3] == 0 and (m.grad[[0, 1, 2, 4]] != 0).all()


def _peft_oracle(base, ours, check_init=False, **cfg):
    """PEFT DoRA on a plain fp32 model with the dequantized weights; our A, B, m copied in (check_init: first
    assert that PEFT's own init of m equals ours, the row norm of the dequantized weight)."""
    oracle_base = copy.deepcopy(base)
    with torch.no_grad():
        for name, m in lora_modules(ours).items():
            oracle_base.get_submodule(name).weight.copy_(dequantize_weight(m.qweight, m.weight_scale))
    oracle = peft.get_peft_model(oracle_base, peft.LoraConfig(target_modules=TARGETS, use_dora=True, lora_dropout=0.0,
                                                             **cfg))
    with torch.no_grad():
        for name, m in lora_modules(ours).items():
            pm = oracle.base_model.model.get_submodule(name)
            assert pm.scaling["default"] == pytest.approx(m.scaling)
            if check_init:
                assert rel_err(m.lora_magnitude_vector, pm.lora_magnitude_vector["default"].weight) <= 1e-6
            pm.lora_A["default"].weight.copy_(m.lora_A)
            pm.lora_B["default"].weight.copy_(m.lora_B)
            pm.lora_magnitude_vector["default"].weight.copy_(m.lora_magnitude_vector)
    return oracle


@pytest.mark.parametrize("use_rslora,bias", [(False, True), (True, False)])
def test_fp8_dora_matches_peft_forward_backward_fp32(use_rslora, bias):
    base = TwoLayer(bias=bias)
    ours = copy.deepcopy(base)
    apply_lora(ours, rank=6, alpha=12, targets=TARGETS, use_rslora=use_rslora, weights="fp8", module_cls=FP8DoRALinear)
    with torch.no_grad():                         # non-zero B and m != ||W|| so every term contributes
        for m in lora_modules(ours).values():
            m.lora_B.normal_(0, 0.2)
            m.lora_magnitude_vector.mul_(torch.rand_like(m.lora_magnitude_vector) + 0.5)
    oracle = _peft_oracle(base, ours, r=6, lora_alpha=12, use_rslora=use_rslora)
    x = torch.randn(5, 7, 48, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    dy = torch.randn(5, 7, 48)
    dispatch.reset_report()
    y = ours(x)
    y.backward(dy)
    assert dispatch.report()["dora_linear"] == {"torch": 2}
    oracle(x2).backward(dy)
    assert rel_err(y, oracle(x2)) <= 1e-5 and rel_err(x.grad, x2.grad) <= 1e-5
    for name, m in lora_modules(ours).items():
        pm = oracle.base_model.model.get_submodule(name)
        assert set(trainable_params(m)) == {"lora_A.weight", "lora_B.weight", "lora_magnitude_vector"}
        for key, p in trainable_params(m).items():            # A, B and m against PEFT's default adapter
            peft_param = getattr(pm, key.split(".")[0])["default"].weight
            assert rel_err(p.grad, peft_param.grad) <= 1e-5, (name, key)
    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert all(n.rsplit(".", 1)[-1] in ("lora_A", "lora_B", "lora_magnitude_vector") for n in trainable)


def test_dora_init_equals_base_and_merge_matches_peft():
    base = TwoLayer()
    ours = copy.deepcopy(base)
    apply_lora(ours, rank=4, alpha=8, targets=TARGETS, module_cls=FP8DoRALinear)
    lin = ours.up_proj
    x = torch.randn(9, 48)
    y_base = nn.functional.linear(x, dequantize_weight(lin.qweight, lin.weight_scale), lin.bias)
    assert rel_err(lin(x), y_base) <= 1e-6                 # B = 0, m = ||W||: g == 1
    oracle = _peft_oracle(base, ours, check_init=True, r=4, lora_alpha=8)
    with torch.no_grad():
        lin.lora_B.normal_(0, 0.3)
        oracle.base_model.model.up_proj.lora_B["default"].weight.copy_(lin.lora_B)
    merged = oracle.merge_and_unload().up_proj.weight      # PEFT's merge: g ⊙ (W + sBA) row-wise
    W = dequantize_weight(lin.qweight, lin.weight_scale)
    ours_merged = lin.column_scale()[:, None] * (W + lin.scaling * lin.lora_B.detach() @ lin.lora_A.detach())
    assert rel_err(ours_merged, merged) <= 1e-6


def test_norm_cache_reused_until_an_update():
    torch.manual_seed(0)
    lin = FP8DoRALinear.from_linear(nn.Linear(32, 24), rank=4, alpha=8)
    with torch.no_grad():
        lin.lora_B.normal_()
    dispatch.reset_report()
    for _ in range(3):
        lin(torch.randn(2, 32)).sum().backward()
    assert dispatch.report()["dora_norm_pieces"] == {"torch": 1}               # one norm for three passes
    n_old = lin.row_norm().clone()
    torch.optim.AdamW(trainable_params(lin).values(), lr=0.1).step()           # in-place update: recompute
    n_new = lin.row_norm()
    assert dispatch.report()["dora_norm_pieces"] == {"torch": 2}
    assert not torch.equal(n_old, n_new)
    assert rel_err(n_new, _norm_fp64(lin.qweight, lin.weight_scale, lin.lora_A.detach(), lin.lora_B.detach(),
                                     lin.scaling)) <= 1e-6


def test_bf16_arm_dense_dora_matches_peft():
    base = TwoLayer().to(torch.bfloat16)
    ours = copy.deepcopy(base)
    apply_lora(ours, rank=6, alpha=12, targets=TARGETS, weights="bf16", module_cls=FP8DoRALinear)
    oracle = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=6, lora_alpha=12, target_modules=TARGETS,
                                                                     use_dora=True, lora_dropout=0.0))
    with torch.no_grad():
        for name, m in lora_modules(ours).items():
            m.lora_B.normal_(0, 0.2)
            pm = oracle.base_model.model.get_submodule(name)
            pm.lora_A["default"].weight.copy_(m.lora_A)
            pm.lora_B["default"].weight.copy_(m.lora_B)
            m.lora_magnitude_vector.copy_(pm.lora_magnitude_vector["default"].weight)   # PEFT's bf16-rounded m
    x = torch.randn(3, 5, 48, dtype=torch.bfloat16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = torch.randn(3, 5, 48, dtype=torch.bfloat16)
    y = ours(x1)
    y.backward(dy)
    y_ref = oracle(x2)
    y_ref.backward(dy)
    # the same torch ops in PEFT's order; only B·A vs PEFT's B(A(eye))ᵀ may differ in the last fp32 bits
    assert rel_err(y, y_ref) <= 1e-2 and rel_err(x1.grad, x2.grad) <= 1e-2
    for name, m in lora_modules(ours).items():
        pm = oracle.base_model.model.get_submodule(name)
        assert rel_err(m.lora_magnitude_vector.grad, pm.lora_magnitude_vector["default"].weight.grad) <= 1e-2, name
        assert rel_err(m.lora_A.grad, pm.lora_A["default"].weight.grad) <= 1e-2, name
        assert rel_err(m.lora_B.grad, pm.lora_B["default"].weight.grad) <= 1e-2, name


def test_adapter_file_is_peft_dora_and_roundtrips(tmp_path):
    base = TwoLayer()
    ours = copy.deepcopy(base)
    apply_lora(ours, rank=4, alpha=8, targets=TARGETS, module_cls=FP8DoRALinear)
    with torch.no_grad():
        for m in lora_modules(ours).values():
            m.lora_B.normal_(0, 0.2)
            m.lora_magnitude_vector.mul_(1.1)
    save_adapter(ours, tmp_path / "a", base_model="local")
    peft_keys = set(peft.get_peft_model_state_dict(_peft_oracle(base, ours, r=4, lora_alpha=8)))
    assert set(adapter_state_dict(ours)) == peft_keys
    assert "base_model.model.up_proj.lora_magnitude_vector" in peft_keys
    again = copy.deepcopy(base)
    apply_lora(again, rank=4, alpha=8, targets=TARGETS, module_cls=FP8DoRALinear)
    load_adapter(again, tmp_path / "a")
    for name, m in lora_modules(again).items():
        assert torch.equal(m.lora_magnitude_vector, lora_modules(ours)[name].lora_magnitude_vector)
    plain = copy.deepcopy(base)
    apply_lora(plain, rank=4, alpha=8, targets=TARGETS)
    with pytest.raises(ValueError, match="use_dora=True.*adapter.type=dora"):
        load_adapter(plain, tmp_path / "a")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rlfp8.trainer.hf_models import make_tiny_qwen3
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("m") / "tiny", seed=3))


def test_trained_adapter_loads_in_peft_with_same_logits(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlfp8.trainer.core import PolicyTrainer
    from tests.unit.test_trainer import _batch, _cfg, _randomize_B
    tr = PolicyTrainer(tiny, _cfg(adapter_type="dora"))
    assert all(isinstance(m, FP8DoRALinear) for m in lora_modules(tr.model).values())
    assert len(tr.params) == 3 * len(tr.replaced)                               # A, B and m per projection
    _randomize_B(tr)
    m0 = [m.lora_magnitude_vector.detach().clone() for m in lora_modules(tr.model).values()]
    tr.train_step(_batch())
    assert any(not torch.equal(a, m.lora_magnitude_vector) for a, m in zip(m0, lora_modules(tr.model).values()))
    path = tmp_path / "adapter"
    tr.save_checkpoint(str(tmp_path))                                              # writes tmp_path/adapter
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    with torch.no_grad():                        # the oracle's base: the dequantized FP8 weights
        for name, m in lora_modules(tr.model).items():
            base.get_submodule(name).weight.copy_(dequantize_weight(m.qweight, m.weight_scale))
    pm = peft.PeftModel.from_pretrained(base, path)
    assert pm.peft_config["default"].use_dora
    ids = torch.randint(0, 300, (2, 19))
    tr.model.eval()
    pm.eval()
    with torch.no_grad():
        ours, ref = tr.model(ids).logits, pm(ids).logits
    assert rel_err(ours, ref) <= 1e-5
