"""PolicyTrainer on the tiny model: micro-batching, gradient checkpointing, non-finite skip, checkpoints,
and the chunked log-probs against a dense log-softmax."""
import copy

import pytest
import torch

from rlfp8.config import compose_dict
from rlfp8.trainer.core import PolicyTrainer, Rollouts
from rlfp8.trainer.hf_models import make_tiny_qwen3
from rlfp8.trainer.logprobs import token_logprobs
from tests.conftest import rel_err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("m") / "tiny", seed=2))


def _cfg(adapter_type="lora", **trainer):
    """The composed config (every key from conf/) with the test's overrides."""
    over = {"weights": "fp8", "lr": 1e-3, "micro_batch_tokens": 4096, "device": "cpu", **trainer}
    engine = ["engine.precision=w8a16"] if adapter_type == "dora" else []
    return compose_dict(["model=tiny", "adapter.rank=4", "adapter.alpha=8", "algo.temperature=0.9",
                         f"adapter.type={adapter_type}", *engine,
                         "algo.correction=tis", "algo.clip_eps_high=0.28", "algo.max_response_len=12",
                         *[f"trainer.{k}={v}" for k, v in over.items()]])


def _batch(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(14, 22, (n,), generator=g).tolist()
    ids = [torch.randint(0, 300, (L,), generator=g).tolist() for L in lens]
    return Rollouts(ids, [10] * n, [(-torch.rand(L - 10, generator=g) * 3).tolist() for L in lens],
                    torch.randn(n, generator=g).tolist())


def _grads_after_backward_only(trainer, batch):
    """Run train_step with lr=0 (so weights stay) and return the accumulated grads before the step."""
    captured = {}
    orig = trainer.optimizer.step

    def grab(*a, **k):
        captured["g"] = [p.grad.clone() for p in trainer.params]
        return orig(*a, **k)
    trainer.optimizer.step = grab
    m = trainer.train_step(batch)
    trainer.optimizer.step = orig
    return captured["g"], m


def _randomize_B(trainer):
    with torch.no_grad():
        for p in trainer.params:
            if p.shape[-1] == 4:
                p.normal_(0, 0.1)


def test_micro_batching_and_checkpointing_do_not_change_gradients(tiny):
    torch.manual_seed(0)
    ref = PolicyTrainer(tiny, _cfg(micro_batch_tokens=10_000))
    _randomize_B(ref)
    state = copy.deepcopy([p.detach() for p in ref.params])
    g_ref, m_ref = _grads_after_backward_only(ref, _batch())
    for variant in (dict(micro_batch_tokens=40), dict(micro_batch_tokens=60, gradient_checkpointing=True)):
        other = PolicyTrainer(tiny, _cfg(**variant))
        with torch.no_grad():
            for p, s in zip(other.params, state):
                p.copy_(s)
        g, m = _grads_after_backward_only(other, _batch())
        for a, b in zip(g, g_ref):
            assert rel_err(a, b) < 1e-5, variant
        assert m["train/loss"] == pytest.approx(m_ref["train/loss"], rel=1e-5)
        assert m["mismatch/kl_k3"] == pytest.approx(m_ref["mismatch/kl_k3"], rel=1e-5)


def test_non_finite_gradient_skips_the_step(tiny):
    tr = PolicyTrainer(tiny, _cfg())
    _randomize_B(tr)
    before = [p.detach().clone() for p in tr.params]
    bad = _batch()
    bad.advantages[0] = float("nan")
    m = tr.train_step(bad)
    assert m["train/skipped_steps"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, tr.params))
    m = tr.train_step(_batch(seed=1))
    assert m["train/skipped_steps"] == 1 and any(not torch.equal(a, b) for a, b in zip(before, tr.params))


def test_checkpoint_round_trip(tiny, tmp_path):
    tr = PolicyTrainer(tiny, _cfg())
    _randomize_B(tr)
    tr.train_step(_batch())
    tr.save_checkpoint(str(tmp_path / "ck"))
    fresh = PolicyTrainer(tiny, _cfg())
    fresh.load_checkpoint(str(tmp_path / "ck"))
    assert fresh.step == 1 and all(torch.equal(a, b) for a, b in zip(tr.params, fresh.params))
    m1, m2 = tr.train_step(_batch(seed=3)), fresh.train_step(_batch(seed=3))
    assert all(torch.equal(a, b) for a, b in zip(tr.params, fresh.params))       # optimizer state restored too
    assert m1["train/loss"] == m2["train/loss"]


def test_chunked_logprobs_match_dense_log_softmax():
    torch.manual_seed(0)            # fp32 inside vs fp64 math: unseeded draws gave rel. errors up to ~2e-5
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    W = torch.randn(50, 16, dtype=torch.float64)
    y = torch.randint(0, 50, (37,))
    lp, ent = token_logprobs(h, W, y, temperature=0.7, chunk_size=8, entropy=True)
    dense = torch.log_softmax((h @ W.t()) / 0.7, -1)
    ref = dense.gather(1, y[:, None])[:, 0]
    assert torch.allclose(lp.double(), ref, atol=1e-6)
    assert torch.allclose(ent.double(), -(dense.exp() * dense).sum(-1), atol=1e-5)
    g = torch.randn(37, dtype=torch.float64)
    (dh,) = torch.autograd.grad(lp, h, g.float())
    (dh_ref,) = torch.autograd.grad(ref, h, g)
    assert rel_err(dh, dh_ref) < 1e-5
    # the entropy's gradient (entropy bonus) against autograd through the dense entropy, alone and mixed
    ge = torch.randn(37, dtype=torch.float64)
    for wl, we in ((0.0, 1.0), (1.0, 1.0)):
        lp, ent = token_logprobs(h, W, y, temperature=0.7, chunk_size=8, entropy=True)
        (dh,) = torch.autograd.grad((wl * g.float() * lp).sum() + (we * ge.float() * ent).sum(), h)
        dense = torch.log_softmax((h @ W.t()) / 0.7, -1)
        ref, dense_ent = dense.gather(1, y[:, None])[:, 0], -(dense.exp() * dense).sum(-1)
        (dh_ref,) = torch.autograd.grad((wl * g * ref).sum() + (we * ge * dense_ent).sum(), h)
        assert rel_err(dh, dh_ref) < 1e-5
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(h, W, y, temperature=0.0)
