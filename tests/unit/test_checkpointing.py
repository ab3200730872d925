"""trainer.gradient_checkpointing per layer (rlfp8/trainer/checkpointing.py): the modes give the same update, the
saved-bytes measurement predicts other batch shapes, and `auto` checkpoints the fewest layers that fit."""
import copy

import pytest
import torch

from rlfp8.config import ConfigError, compose_dict
from rlfp8.memory_plan import estimate
from rlfp8.models import architecture_config
from rlfp8.trainer import checkpointing as ck
from rlfp8.trainer.core import PolicyTrainer
from rlfp8.trainer.hf_models import make_tiny_qwen3
from tests.unit.test_trainer import _batch as trainer_batch
from tests.unit.test_trainer import _grads_after_backward_only as _grads

LAYERS = 4


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("m") / "tiny4", seed=3, layers=LAYERS))


def _cfg(gc, **trainer):
    over = {"weights": "fp8", "lr": 1e-3, "micro_batch_tokens": 4096, "device": "cpu", "gradient_checkpointing": gc,
            **trainer}
    return compose_dict(["model=tiny", "adapter.rank=4", "adapter.alpha=8", "algo.max_response_len=12",
                         *[f"trainer.{k}={v}" for k, v in over.items()]])


def _batch(n=5, seed=0):
    return trainer_batch(n, seed)


def _trainer(path, gc, state=None):
    tr = PolicyTrainer(path, _cfg(gc))
    with torch.no_grad():
        if state is None:
            for p in tr.params:
                if p.shape[-1] == 4:
                    p.normal_(0, 0.1)          # B != 0: the adapters reach the loss
        else:
            for p, s in zip(tr.params, state):
                p.copy_(s)
    return tr


def test_parse_mode_accepts_the_documented_values_and_names_the_key():
    assert [ck.parse_mode(v, 8) for v in (True, False, "auto", 0, 8)] == [True, False, "auto", 0, 8]
    for bad in ("sometimes", -1, 1.5, None):
        with pytest.raises(ValueError, match="trainer.gradient_checkpointing"):
            ck.parse_mode(bad)
    with pytest.raises(ValueError, match="has 8 decoder layers"):
        ck.parse_mode(9, 8)


def test_config_rejects_a_bad_value_before_anything_starts():
    with pytest.raises(ConfigError, match="trainer.gradient_checkpointing='often'"):
        compose_dict(["model=tiny", "trainer.gradient_checkpointing=often"])
    layers = architecture_config("qwen3_8b")["num_hidden_layers"]
    with pytest.raises(ConfigError, match=f"has {layers} decoder layers.*model.path=random:qwen3_8b"):
        compose_dict(["model.path=random:qwen3_8b", f"trainer.gradient_checkpointing={layers + 1}"])
    assert compose_dict(["model.path=random:qwen3_8b", f"trainer.gradient_checkpointing={layers}"])


@pytest.mark.parametrize("budget, expect", [(1000, 0), (999, 1), (910, 1), (909, 2), (100, 10), (0, 10)])
def test_plan_checkpoints_the_fewest_layers_that_fit(budget, expect):
    # 10 layers, 100 bytes kept or 10 checkpointed each: n layers checkpointed need 10 n + 100 (10 - n)
    assert ck.plan_checkpointed(10, 100.0, 10.0, budget) == expect


def test_plan_is_minimal_for_random_sizes():
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        layers = int(torch.randint(1, 80, (1,), generator=g))
        kept = float(torch.randint(10, 10_000, (1,), generator=g))
        ckpt = float(torch.randint(1, 10, (1,), generator=g))
        budget = float(torch.randint(0, int(layers * kept * 1.2), (1,), generator=g))
        n = ck.plan_checkpointed(layers, kept, ckpt, budget)
        need = lambda k: k * ckpt + (layers - k) * kept       # noqa: E731
        assert 0 <= n <= layers
        assert need(n) <= budget or n == layers
        assert n == 0 or need(n - 1) > budget


def test_every_mode_gives_the_same_update(tiny4, monkeypatch):
    ref = _trainer(tiny4, False)
    state = copy.deepcopy([p.detach() for p in ref.params])
    g_ref, m_ref = _grads(ref, _batch())
    assert m_ref["train/checkpointed_layers"] == 0
    # auto with the memory it may use set so that exactly one layer must be checkpointed
    tr = _trainer(tiny4, "auto", state)
    saved = ck.measure_saved_bytes(tr.model, tr.checkpointing.layers, tr.device, tr.model.config.vocab_size,
                                   tr.model.config.hidden_size, tr.dtype)
    rows, length = tr._collate(_batch(), list(range(5)))["input_ids"].shape
    kept, ckpt = saved.kept(rows, length), saved.checkpointed(rows, length)
    fixed = tr.checkpointing.headroom + tr.checkpointing.logits_bytes + kept
    for free, n_expected in ((fixed + LAYERS * kept, 0), (fixed + (LAYERS - 1) * kept + ckpt, 1), (0.0, LAYERS)):
        auto = _trainer(tiny4, "auto", state)
        monkeypatch.setattr(ck, "free_bytes", lambda device, free=free: free)
        g, m = _grads(auto, _batch())
        assert m["train/checkpointed_layers"] == n_expected
        assert all(torch.equal(a, b) for a, b in zip(g, g_ref)), n_expected
        assert m["train/loss"] == m_ref["train/loss"]
    for mode, n_expected in ((True, LAYERS), (2, 2)):
        other = _trainer(tiny4, mode, state)
        g, m = _grads(other, _batch())
        assert m["train/checkpointed_layers"] == n_expected
        assert all(torch.equal(a, b) for a, b in zip(g, g_ref)), mode


def test_checkpointed_layers_really_recompute(tiny4):
    """The flag reaches the layers: a checkpointed layer runs its forward twice per step (forward + recompute)."""
    for mode, recomputed in ((False, 0), (1, 1), (True, LAYERS)):
        tr = _trainer(tiny4, mode)
        calls = [0] * LAYERS
        for i, layer in enumerate(tr.checkpointing.layers or ck.decoder_layers(tr.model)):
            layer.self_attn.register_forward_hook(lambda m, a, o, i=i: calls.__setitem__(i, calls[i] + 1))
        tr.train_step(_batch(n=2))
        assert sum(c == 2 for c in calls) == recomputed and sum(c == 1 for c in calls) == LAYERS - recomputed
        assert all(c == 2 for c in calls[:recomputed])          # the first layers are the checkpointed ones


def test_measured_bytes_predict_another_batch_shape(tiny4):
    """The fit from three one-row lengths predicts what the layers save for a padded multi-row batch."""
    tr = _trainer(tiny4, "auto")
    layers, cfg = tr.checkpointing.layers, tr.model.config
    saved = ck.measure_saved_bytes(tr.model, layers, tr.device, cfg.vocab_size, cfg.hidden_size, tr.dtype)
    assert saved.per_token > 4 * saved.checkpointed_per_token      # a layer keeps several hidden-size tensors
    ids = torch.randint(0, cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(2))
    small = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(3))
    # the difference of two shapes removes the weights (the fit's constant)
    measured = sum(ck.saved_bytes_by_layer(tr.model, layers, ids)) - sum(ck.saved_bytes_by_layer(tr.model, layers,
                                                                                                  small))
    predicted = LAYERS * (saved.kept(3, 40) - saved.kept(1, 8))
    assert measured == pytest.approx(predicted, rel=0.02)
    assert all(layer.gradient_checkpointing for layer in layers)     # the probe leaves the flags as they were


def test_memory_plan_counts_the_checkpointed_layers():
    arch = architecture_config("qwen3_8b")
    acts = {}
    for gc in (False, 10, True, "auto"):
        cfg = compose_dict(["recipe=qwen3_8b_math", f"trainer.gradient_checkpointing={gc}"])
        acts[gc] = estimate(cfg, arch)["trainer_activations"]
    assert acts[False] > acts[10] > acts[True] == acts["auto"]      # auto's estimate: the floor it can fall back to
