"""rlfp8.algos against the peers' formulas (issue 20), written out here from the peers' code, not
imported: verl @b178a3c ``verl/trainer/ppo/core_algos.py`` and ``rollout_corr_helper.py``, TRL
@f2cd577 ``trl/trainer/grpo_trainer.py``. Random float64 cases with padding (finite garbage there),
varying lengths, ratios outside the clip range and both signs of advantage; values and gradients
within 1e-6. Each option also has a small hand-computed case."""
import math

import pytest
import torch

from rlfp8 import algos
from rlfp8.algos import aggregate, aggregation_denominator, kl_penalty, policy_loss_terms
from rlfp8.algos.correction import importance_weights
from rlfp8.config import ConfigError, compose

TOL = 1e-6
D = torch.float64


def _case(seed, B=7, T=9, spread=0.8):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, T + 1, (B,), generator=g)
    lens[0] = T
    mask = torch.arange(T)[None, :] < lens[:, None]                          # [B, T] bool
    old = -torch.rand(B, T, generator=g, dtype=D) * 3
    logp = old + torch.randn(B, T, generator=g, dtype=D) * spread
    rollout = old + torch.randn(B, T, generator=g, dtype=D) * 0.5
    ref = old + torch.randn(B, T, generator=g, dtype=D) * 0.3
    garbage = torch.randn(B, T, generator=g, dtype=D) * 30                   # padding: masked, finite
    logp, old, rollout, ref = (torch.where(mask, x, garbage) for x in (logp, old, rollout, ref))
    adv = torch.randn(B, generator=g, dtype=D)
    adv[0], adv[1] = abs(adv[0]) + 0.1, -abs(adv[1]) - 0.1                    # both signs
    return logp.requires_grad_(True), old, rollout, ref, adv, mask


def _close(a, b, tol=TOL):
    assert torch.allclose(a.double(), b.double(), atol=tol, rtol=tol), (a, b)


def _grad(loss, x):
    return torch.autograd.grad(loss, x, retain_graph=True)[0]


# ---------------------------------------------------------------- peer formulas (written out)
def verl_agg_loss(loss_mat, loss_mask, mode, loss_scale_factor=None):
    # verl/trainer/ppo/core_algos.py::agg_loss (dp_size 1, global sizes = this batch)
    m = loss_mask.to(D)
    if mode == "token-mean":
        return (loss_mat * m).sum() / m.sum()
    if mode == "seq-mean-token-sum":
        seq_losses = (loss_mat * m).sum(-1)
        seq_mask = (m.sum(-1) > 0).to(D)
        return (seq_losses * seq_mask).sum() / seq_mask.sum()
    if mode == "seq-mean-token-mean":
        seq_losses = (loss_mat * m).sum(-1) / (m.sum(-1) + 1e-8)
        seq_mask = (m.sum(-1) > 0).to(D)
        return (seq_losses * seq_mask).sum() / seq_mask.sum()
    return (loss_mat * m).sum(-1).sum() / (loss_scale_factor or m.shape[-1])   # seq-mean-token-sum-norm


def verl_vanilla(old, logp, adv, c_low, c_high, clip_ratio_c=3.0):
    # core_algos.py::compute_policy_loss_vanilla, per-token pg_losses (before agg_loss)
    neg_kl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    a = adv[:, None]
    pg1 = -a * ratio
    pg2 = -a * torch.clamp(ratio, 1 - c_low, 1 + c_high)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -a * clip_ratio_c
    clip2 = torch.min(pg3, clip1)
    return torch.where(a < 0, clip2, clip1)


def verl_gspo(old, logp, adv, mask, c_low, c_high):
    # core_algos.py::compute_policy_loss_gspo (aggregated seq-mean-token-mean by verl)
    m = mask.to(D)
    neg_kl = logp - old
    seq_len = m.sum(-1).clamp(min=1)
    neg_kl_seq = (neg_kl * m).sum(-1) / seq_len
    log_s = logp - logp.detach() + neg_kl_seq.detach().unsqueeze(-1)
    s = torch.exp(torch.clamp(log_s, max=10.0))
    a = adv[:, None]
    return torch.maximum(-a * s, -a * torch.clamp(s, 1 - c_low, 1 + c_high))


def verl_cispo(old, logp, adv, c_low, c_high):
    # core_algos.py::compute_policy_loss_cispo
    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    clipped_sg = torch.clamp(ratio, 1 - c_low, 1 + c_high).detach()
    return -clipped_sg * adv[:, None] * logp


def trl_per_token_loss(logp, old, adv, mask, eps_low, eps_high, level="token", loss_type="dapo"):
    # trl/trainer/grpo_trainer.py::GRPOTrainer._compute_loss (importance_sampling_level, loss_type)
    m = mask.to(D)
    log_ratio = logp - old
    if level == "token":
        liw = log_ratio
    else:
        liw = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(liw)
    a = adv[:, None]
    if loss_type == "cispo":
        return -torch.clamp(coef_1, max=eps_high).detach() * a * logp, coef_1
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    return -torch.min(coef_1 * a, coef_2 * a), coef_1


def trl_aggregate(per_token_loss, mask, loss_type, max_completion_length=None, accum_steps=1, num_items=None):
    # _compute_loss's loss_type branches (one process; normalizer = gradient accumulation steps)
    m = mask.to(D)
    if loss_type == "grpo":
        return ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean() / accum_steps
    if loss_type == "bnpo":
        return (per_token_loss * m).sum() / m.sum().clamp(min=1.0) / accum_steps
    if loss_type == "dr_grpo":
        return (per_token_loss * m).sum() / (per_token_loss.size(0) * max_completion_length) / accum_steps
    return (per_token_loss * m).sum() / num_items.clamp(min=1.0)                      # dapo / cispo


def verl_kl(logprob, ref, name):
    # core_algos.py::kl_penalty + kl_penalty_forward (forward on the base name: k3+ -> k3)
    base = name.rstrip("+")
    if base in ("kl", "k1"):
        fwd = logprob - ref
    elif base in ("mse", "k2"):
        fwd = 0.5 * (logprob - ref).square()
    else:
        kl = torch.clamp(ref - logprob, min=-20, max=20)
        fwd = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    if not name.endswith("+"):
        return fwd
    back = 0.5 * (logprob - ref).square()
    return back - back.detach() + fwd.detach()


def trl_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    # grpo_trainer.py::_generate_and_score_completions, vllm_importance_sampling_mode branches
    diff = (old - sampling) * mask.to(D)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = clip_min if clip_min is not None else -math.inf
    hi = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def verl_is_weights(log_ratio, mask, level, threshold, batch_normalize=False):
    # rollout_corr_helper.py::compute_rollout_correction_weights
    m = mask.to(D)
    if level == "token":
        w = torch.exp(torch.clamp(log_ratio, -20, 20))
    else:
        s = (log_ratio * m).sum(-1, keepdim=True)
        w = torch.exp(torch.clamp(s, -20, 20)).expand_as(log_ratio)
    w = (w * m).clamp(max=threshold)
    if batch_normalize:
        if level == "token":
            mean = (w * m).sum() / m.sum()
        else:
            seq_w = (w * m).sum(-1) / (m.sum(-1) + 1e-8)
            seq_mask = (m.sum(-1) > 0).to(D)
            mean = (seq_w * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if mean > 1e-8:
            w = w / mean
    return w


def verl_rs_mask(log_ratio, mask, option, lower=None, upper=None):
    # rollout_corr_helper.py::compute_rollout_rejection_mask (one option); k1 bounds: log(lower), log(upper)
    m = mask.to(D)
    lr = torch.clamp(log_ratio, -20, 20)
    k = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1.0 - lr}[option[-2:]]
    if option.startswith("token"):
        stat = k
    elif option.startswith("seq_sum"):
        stat = (k * m).sum(-1, keepdim=True)
    elif option.startswith("seq_mean"):
        stat = ((k * m).sum(-1) / (m.sum(-1) + 1e-8)).unsqueeze(-1)
    else:
        mx = k.masked_fill(~mask, float("-inf")).max(-1).values
        stat = torch.where(mx == float("-inf"), torch.zeros_like(mx), mx).unsqueeze(-1)
    if option.endswith("k1"):
        keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
    else:
        keep = stat <= upper
    return keep.expand_as(mask) & mask


def _cfg(**kw):
    from omegaconf import OmegaConf
    from rlfp8.config import CONF_DIR
    return {**OmegaConf.to_container(OmegaConf.load(CONF_DIR / "algo" / "grpo.yaml")), **kw}


def _masked(x, mask):
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype))


# ================================================================ policy losses
def test_dual_clip_hand_values():
    # A = -1: rho 5 -> max(5, 1.2) = 5, dual-clip min(5, 3) = 3 (no gradient); rho 2 -> 2 (< 3, kept)
    # A = +1: rho 5 -> -min(5, 1.2) = -1.2 (dual-clip never applies to A > 0)
    rho = torch.tensor([[5.0, 2.0], [5.0, 1.0]], dtype=D)
    logp = rho.log().requires_grad_(True)
    adv = torch.tensor([-1.0, 1.0], dtype=D)
    mask = torch.ones(2, 2, dtype=torch.bool)
    per_tok, m = policy_loss_terms(logp, torch.zeros(2, 2, dtype=D), adv, mask, 0.2, 0.2, clip_ratio_c=3.0)
    _close(per_tok, torch.tensor([[3.0, 2.0], [-1.2, -1.0]], dtype=D))
    # d/dlogp: dual-clipped 0; rho 2 with A=-1: -A rho = 2; clipped high 0; rho 1, A=1: -1
    _close(_grad(per_tok.sum(), logp), torch.tensor([[0.0, 2.0], [0.0, -1.0]], dtype=D))
    assert m["policy/dual_clip_frac"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss_terms(logp, torch.zeros(2, 2, dtype=D), adv, mask, clip_ratio_c=1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_vanilla_dual_clip_equals_verl(seed, mode):
    logp, old, _, _, adv, mask = _case(seed, spread=1.2)
    ours, _ = policy_loss_terms(logp, old, adv, mask, 0.2, 0.28, clip_ratio_c=3.0)
    peer = verl_vanilla(old, logp, adv, 0.2, 0.28, 3.0)
    # the case exercises the dual clip: A < 0 tokens with rho > 3
    assert bool((mask & (adv[:, None] < 0) & ((logp - old).exp() > 3.0)).any())
    _close(_masked(ours, mask), _masked(peer, mask))
    T = mask.shape[1]
    ours_l = aggregate(ours, mask, mode, aggregation_denominator(mask, mode, max_response_len=T))
    peer_l = verl_agg_loss(peer, mask, mode, loss_scale_factor=mask.shape[0] * T)   # rlfp8: B x max_response_len
    _close(ours_l, peer_l)
    _close(_grad(ours_l, logp), _grad(peer_l, logp))


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("loss_type, mode", [("grpo", "seq-mean-token-mean"), ("bnpo", "bnpo"),
                                             ("dr_grpo", "seq-mean-token-sum-norm"), ("dapo", "token-mean")])
def test_vanilla_no_dual_clip_equals_trl_loss_types(seed, loss_type, mode):
    # two equal gradient-accumulation steps of 4 rows (TRL's grpo / dr_grpo divide by the micro-batch's
    # rows x accumulation steps, which is the mini-batch's row count only when the steps are equal)
    logp, old, _, _, adv, mask = _case(seed, B=8)
    T = mask.shape[1]
    micro = [slice(0, 4), slice(4, 8)]
    denom = aggregation_denominator(mask, mode, max_response_len=T, num_micro_batches=len(micro))
    ours = sum(aggregate(policy_loss_terms(logp[s], old[s], adv[s], mask[s], 0.2, 0.28)[0], mask[s], mode, denom)
               for s in micro)
    peer = sum(trl_aggregate(trl_per_token_loss(logp[s], old[s], adv[s], mask[s], 0.2, 0.28)[0], mask[s], loss_type,
                             max_completion_length=T, accum_steps=len(micro), num_items=mask.sum().to(D))
               for s in micro)
    _close(ours, peer)
    _close(_grad(ours, logp), _grad(peer, logp))


def test_gspo_hand_values():
    # row 0: log ratios [ln 2, 0] -> s = exp(ln2 / 2) = sqrt2 = 1.41421; A = +1, clip 1.2 -> -1.2 per token
    # row 1: [ln .9, pad] -> s = .9; A = -1 -> max(.9, .8) = .9, gradient -A s / 1 token = .9
    logp = torch.tensor([[math.log(2.0), 0.0], [math.log(0.9), 7.0]], dtype=D, requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    per_tok, m = policy_loss_terms(logp, torch.zeros(2, 2, dtype=D), torch.tensor([1.0, -1.0], dtype=D), mask,
                                   0.2, 0.2, loss="gspo")
    _close(per_tok, torch.tensor([[-1.2, -1.2], [0.9, 0.0]], dtype=D))
    _close(_grad(per_tok.sum(), logp), torch.tensor([[0.0, 0.0], [0.9, 0.0]], dtype=D))
    assert m["policy/clip_frac_high"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("seed", [0, 1, 4])
@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_gspo_equals_verl_and_trl_sequence_level(seed, mode):
    logp, old, _, _, adv, mask = _case(seed, spread=0.5)
    ours, _ = policy_loss_terms(logp, old, adv, mask, 0.1, 0.1, loss="gspo")
    verl = verl_gspo(old, logp, adv, mask, 0.1, 0.1)
    trl, coef = trl_per_token_loss(logp, old, adv, mask, 0.1, 0.1, level="sequence")
    assert bool(((coef > 1.1) | (coef < 0.9)).any()) and bool(((coef < 1.1) & (coef > 0.9)).any())
    d = aggregation_denominator(mask, mode)
    ours_l = aggregate(ours, mask, mode, d)
    verl_l = verl_agg_loss(verl, mask, mode)
    trl_l = verl_agg_loss(trl.expand_as(mask), mask, mode)
    _close(ours_l, verl_l)
    _close(ours_l, trl_l)
    _close(_grad(ours_l, logp), _grad(verl_l, logp))
    _close(_grad(ours_l, logp), _grad(trl_l, logp))       # TRL: no straight-through, same gradient


def test_cispo_hand_values():
    # rho = [2, .5] (old = 0), A = 1, clip [0.8, 1.2]: l = -sg[clip(rho)] A logp = [-1.2 ln2, -.8 ln.5]
    logp = torch.tensor([[math.log(2.0), math.log(0.5)]], dtype=D, requires_grad=True)
    per_tok, m = policy_loss_terms(logp, torch.zeros(1, 2, dtype=D), torch.tensor([1.0], dtype=D),
                                   torch.ones(1, 2, dtype=torch.bool), 0.2, 0.2, loss="cispo")
    _close(per_tok, torch.tensor([[-1.2 * math.log(2.0), -0.8 * math.log(0.5)]], dtype=D))
    _close(_grad(per_tok.sum(), logp), torch.tensor([[-1.2, -0.8]], dtype=D))   # every token has a gradient
    assert m["policy/clip_frac"] == 1.0


@pytest.mark.parametrize("seed", [0, 5])
def test_cispo_equals_verl_and_trl(seed):
    logp, old, _, _, adv, mask = _case(seed)
    d = aggregation_denominator(mask, "token-mean")
    ours = aggregate(policy_loss_terms(logp, old, adv, mask, 0.2, 0.28, loss="cispo")[0], mask, "token-mean", d)
    verl = verl_agg_loss(verl_cispo(old, logp, adv, 0.2, 0.28), mask, "token-mean")
    _close(ours, verl)
    _close(_grad(ours, logp), _grad(verl, logp))
    # TRL cispo: clamp(rho, max=eps_high) only = clip_eps_low 1, clip_eps_high eps_high - 1
    ours_t = aggregate(policy_loss_terms(logp, old, adv, mask, 1.0, 4.0, loss="cispo")[0], mask, "token-mean", d)
    trl = trl_aggregate(trl_per_token_loss(logp, old, adv, mask, None, 5.0, loss_type="cispo")[0], mask, "cispo",
                        num_items=mask.sum().to(D))
    _close(ours_t, trl)
    _close(_grad(ours_t, logp), _grad(trl, logp))


# ================================================================ aggregation hand values
def test_seq_mean_token_sum_and_bnpo_hand_values():
    # rows: l0 = [1, 2, 3] m = [1, 1, 0]; l1 = [4, 5, 6] m = [1, 0, 0]; l2 = [7, 8, 9] m = [1, 1, 1]
    lv = torch.tensor([[1.0, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=D)
    m = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    # seq-mean-token-sum: (3 + 4 + 24) / 3 rows
    d = aggregation_denominator(m, "seq-mean-token-sum")
    assert d == 3.0 and aggregate(lv, m, "seq-mean-token-sum", d).item() == pytest.approx(31 / 3)
    # bnpo with micro-batches [row 0] and [rows 1, 2]: (3 / 2 + 28 / 4) / 2 = 4.25
    d = aggregation_denominator(m, "bnpo", num_micro_batches=2)
    total = aggregate(lv[:1], m[:1], "bnpo", d) + aggregate(lv[1:], m[1:], "bnpo", d)
    assert d == 2.0 and total.item() == pytest.approx(4.25)


# ================================================================ KL
def test_k3_plus_hand_values():
    # d = logp - ref = 1: value k3 = e^-1 - (-1) - 1 = e^-1 = .367879; gradient of k2 = d = 1
    logp = torch.tensor([[0.0]], dtype=D, requires_grad=True)
    ref = torch.tensor([[-1.0]], dtype=D)
    k = kl_penalty(logp, ref, "k3+")
    assert k.item() == pytest.approx(math.exp(-1.0))
    assert _grad(k.sum(), logp).item() == pytest.approx(1.0)
    # plain k3's gradient is 1 - e^(ref - logp) = 1 - e^-1 = .632121
    assert _grad(kl_penalty(logp, ref, "k3").sum(), logp).item() == pytest.approx(1 - math.exp(-1.0))


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "k1+", "k3+", "low_var_kl+"])
def test_kl_equals_verl(name):
    logp, _, _, ref, _, mask = _case(6)
    ours = _masked(kl_penalty(logp, ref, name), mask)
    peer = _masked(verl_kl(logp, ref, {"low_var_kl+": "k3+"}.get(name, name)), mask)
    _close(ours, peer)
    _close(_grad(ours.sum(), logp), _grad(peer.sum(), logp))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bias_corrected_kl_equals_trl(level):
    # TRL: per_token_kl = (exp(ref - logp) - (ref - logp) - 1) * coef_1 (coef_1 = exp(log importance
    # weights), not detached), added to the per-token loss before the dapo (token-mean) normalisation.
    logp, old, rollout, ref, adv, mask = _case(7)
    cfg = _cfg(policy_loss="gspo" if level == "sequence" else "vanilla", clip_ratio_c=None, kl_coef=0.05,
               use_bias_correction_kl=True, clip_eps_high=0.28)
    d = algos.loss_denominator(cfg, mask, mask.shape[1])
    ours, met = algos.rl_loss(cfg, logp, old, rollout, adv, mask, d, ref_logp=ref)
    ptl, coef_1 = trl_per_token_loss(logp, old, adv, mask, 0.2, 0.28, level=level)
    x = ref - logp
    per_token_kl = (torch.exp(x) - x - 1) * coef_1
    peer = trl_aggregate(ptl + 0.05 * per_token_kl, mask, "dapo", num_items=mask.sum().to(D))
    _close(ours, peer)
    _close(_grad(ours, logp), _grad(peer, logp))
    assert met["train/kl_ref"] > 0


# ================================================================ corrections
def _corr_hand():
    # rollout = 0, old = ln rho: row 0 rho = [.25, 1, 3]; row 1 rho = [1.5, .8, pad]
    rho = torch.tensor([[0.25, 1.0, 3.0], [1.5, 0.8, 1.0]], dtype=D)
    return rho.log(), torch.zeros(2, 3, dtype=D), torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)


def test_sequence_mask_hand_values():
    old, rollout, mask = _corr_hand()
    # products: row 0 .75, row 1 1.2; band [1/1.1, 1.1] = [.909, 1.1]: row 0 out, row 1 out;
    # band [.7, 1.3]: both kept with weight = the product (TRL sequence_mask), pad 1
    w, m = importance_weights(old, rollout, mask, "sequence_mask", cap=1.1)
    _close(w, torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]], dtype=D))
    assert m["correction/seq_mask_frac"] == 1.0
    w, _ = importance_weights(old, rollout, mask, "sequence_mask", cap=1.3, low=0.7)
    _close(w, torch.tensor([[0.75, 0.75, 0.75], [1.2, 1.2, 1.0]], dtype=D))


@pytest.mark.parametrize("seed", [0, 8])
@pytest.mark.parametrize("mode, trl_mode, cap, low", [
    ("tis", "token_truncate", 2.0, None), ("tis", "token_truncate", 1.5, 0.7),
    ("seq_tis", "sequence_truncate", 3.0, None), ("seq_tis", "sequence_truncate", 3.0, 0.5),
    ("token_mask", "token_mask", 1.5, 0.6), ("sequence_mask", "sequence_mask", 2.0, 0.3),
])
def test_corrections_equal_trl(seed, mode, trl_mode, cap, low):
    _, old, rollout, _, _, mask = _case(seed)
    w, _ = importance_weights(old, rollout, mask, mode, cap=cap, low=low)
    peer = trl_is_ratio(old, rollout, mask, trl_mode, low, cap).expand_as(mask)
    n_masked = int((mask & (peer == 0)).sum())
    assert mode in ("tis", "seq_tis") or n_masked > 0                      # the band rejects something
    _close(_masked(w, mask), _masked(peer, mask))


@pytest.mark.parametrize("seed", [0, 9])
@pytest.mark.parametrize("mode, level", [("tis", "token"), ("seq_tis", "sequence")])
@pytest.mark.parametrize("normalize", [False, True])
def test_tis_and_batch_normalisation_equal_verl(seed, mode, level, normalize):
    _, old, rollout, _, _, mask = _case(seed)
    cfg = _cfg(correction=mode, tis_cap=2.0, rollout_is_batch_normalize=normalize)
    micro = [slice(0, 2), slice(2, 7)]
    step = algos.sum_stats(algos.batch_stats(cfg, old[s], rollout[s], mask[s]) for s in micro)
    peer = verl_is_weights(old - rollout, mask, level, 2.0, batch_normalize=normalize)
    for s in micro:                      # normalised by the whole batch's mean, micro-batch by micro-batch
        w, _, _ = algos.objective._weights(cfg, old[s], rollout[s], mask[s], step)
        _close(_masked(w, mask[s]), _masked(peer[s], mask[s]))


def test_seq_geo_mask_equals_skyrl_geo_mask():
    # SkyRL geo mask (skyrl_train off_policy_correction): keep the row iff L <= exp(mean log rho) <= C
    _, old, rollout, _, _, mask = _case(10)
    w, _ = importance_weights(old, rollout, mask, "seq_geo_mask", cap=1.15, low=0.85)
    m = mask.to(D)
    geo = torch.exp(((old - rollout) * m).sum(-1) / m.sum(-1))
    keep = ((geo >= 0.85) & (geo <= 1.15)).to(D)[:, None].expand_as(m)
    assert 0 < keep[:, 0].sum() < mask.shape[0]
    _close(_masked(w, mask), _masked(keep, mask))


# ================================================================ rejection (verl rollout_rs)
def test_rollout_rs_hand_values():
    old, rollout, mask = _corr_hand()
    # token_k1 "0.5_2": keep 0.5 <= 1/rho <= 2, i.e. rho in [.5, 2]: row 0 [0, 1, 0], row 1 [1, 1, pad]
    keep, m = algos.rejection_mask(old, rollout, mask, "token_k1", "0.5_2")
    assert keep.tolist() == [[False, True, False], [True, True, True]]
    assert m["rejection/token_frac"] == pytest.approx(2 / 5) and m["rejection/seq_frac"] == pytest.approx(0.5)
    # asymmetric "0.5_4": 1/rho in [.5, 4] = rho in [.25, 2]: the .25 token is kept, 3 is not
    keep, _ = algos.rejection_mask(old, rollout, mask, "token_k1", "0.5_4")
    assert keep[0].tolist() == [True, True, False]
    # seq_max_k2 0.5: row 0 max .5 (ln 4)^2 / 2 = .961 > .5 rejected; row 1 .5 (ln 1.5)^2 = .082 kept
    keep, _ = algos.rejection_mask(old, rollout, mask, "seq_max_k2", 0.5)
    assert keep.tolist() == [[False] * 3, [True] * 3]


@pytest.mark.parametrize("option", algos.ROLLOUT_RS_OPTIONS)
def test_rollout_rs_equals_verl(option):
    _, old, rollout, _, _, mask = _case(11)
    if option.endswith("k1"):
        grid = [(0.95, 1.05), (0.9, 1.2), (0.7, 1.2), (0.5, 2.0), (0.3, 3.0), (0.1, 10.0)]
        specs = [(f"{lo}_{hi}", lo, hi) for lo, hi in grid] + [(1.5, 1 / 1.5, 1.5)]   # one number: L = 1/U
    else:
        specs = [(u, None, u) for u in (0.002, 0.01, 0.03, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 3.0)]
    bites = 0
    for threshold, lower, upper in specs:
        keep, _ = algos.rejection_mask(old, rollout, mask, option, threshold)
        peer = verl_rs_mask(old - rollout, mask, option, lower, upper)
        assert torch.equal(keep & mask, peer), threshold
        bites += 0 < int(peer.sum()) < int(mask.sum())
    assert bites >= 2                                                       # thresholds that reject some


def test_rollout_rs_threshold_errors():
    with pytest.raises(ValueError, match="algo.rollout_rs_threshold"):
        algos.parse_rollout_rs_threshold("token_k2", "0.5_2")
    with pytest.raises(ValueError, match="algo.rollout_rs_threshold"):
        algos.parse_rollout_rs_threshold("token_k1", None)
    with pytest.raises(ValueError, match="algo.rollout_rs"):
        algos.parse_rollout_rs_threshold("seq_max_k1", 2.0)


# ================================================================ advantages (TRL scale_rewards)
def trl_advantages(rewards, n, scale_rewards):
    # grpo_trainer.py::_generate_and_score_completions (sum_then_normalize, one reward function)
    mean_g = rewards.view(-1, n).mean(dim=1).repeat_interleave(n, dim=0)
    if scale_rewards in ("group", "none"):
        std = rewards.view(-1, n).std(dim=1).repeat_interleave(n, dim=0)
    else:
        std = rewards.std().expand_as(rewards)
    adv = rewards - mean_g
    return adv / (std + 1e-4) if scale_rewards != "none" else adv


def test_scale_rewards_hand_values():
    r = torch.tensor([1.0, 0.0, 3.0, 3.0], dtype=D)
    # batch: centred [.5, -.5, 0, 0] / std([1, 0, 3, 3]) (Bessel: mean 1.75, var (0.5625 + 3.0625 + 2 * 1.5625)/3
    # = 2.25, std 1.5) -> [1/3, -1/3, 0, 0]
    _close(algos.compute_advantages(r, 2, "grpo", 0.0, "batch"), torch.tensor([1 / 3, -1 / 3, 0, 0], dtype=D))
    _close(algos.compute_advantages(r, 2, "grpo", 0.0, "none"), torch.tensor([0.5, -0.5, 0, 0], dtype=D))
    with pytest.raises(ValueError, match="scale_rewards"):
        algos.compute_advantages(r, 2, "rloo", 0.0, "batch")


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_scale_rewards_equals_trl(scale):
    r = torch.randint(0, 3, (24,), generator=torch.Generator().manual_seed(3)).to(D)
    _close(algos.compute_advantages(r, 6, "grpo", 1e-4, scale), trl_advantages(r, 6, scale))


# ================================================================ the whole loss against verl's actor
def _verl_actor_loss(logp, old, rollout, ref, adv, mask, entropy, cfg):
    # verl dp_actor.update_policy with: rollout_is=token (+ batch normalize), rollout_rs=token_k1 (the
    # rejection updates response_mask), compute_policy_loss_vanilla (dual-clip), agg_loss token-mean
    # over the modified mask, policy_loss -= entropy_coeff * agg(entropy), += kl_loss_coef * agg(kl)
    log_ratio = old - rollout
    w = verl_is_weights(log_ratio, mask, "token", cfg["tis_cap"], batch_normalize=True)
    lo, hi = (float(x) for x in cfg["rollout_rs_threshold"].split("_"))
    response_mask = verl_rs_mask(log_ratio, mask, "token_k1", lo, hi)
    pg = verl_vanilla(old, logp, adv, cfg["clip_eps_low"], cfg["clip_eps_high"], cfg["clip_ratio_c"]) * w
    loss = verl_agg_loss(pg, response_mask, "token-mean")
    loss = loss - cfg["entropy_coeff"] * verl_agg_loss(entropy, response_mask, "token-mean")
    return loss + cfg["kl_coef"] * verl_agg_loss(verl_kl(logp, ref, cfg["kl_estimator"]), response_mask, "token-mean")


def test_rl_loss_equals_verl_actor_pipeline():
    logp, old, rollout, ref, adv, mask = _case(12, B=8)
    entropy = (torch.rand(mask.shape, generator=torch.Generator().manual_seed(1), dtype=D) * 3).requires_grad_(True)
    cfg = _cfg(correction="tis", tis_cap=1.6, rollout_is_batch_normalize=True, rollout_rs="token_k1",
               rollout_rs_threshold="0.6_1.4", drop_rejected_from_denominator=True, clip_eps_high=0.28,
               clip_ratio_c=3.0, kl_coef=0.1, kl_estimator="k3+", entropy_coeff=0.01)
    micro = [slice(0, 3), slice(3, 8)]
    stats = {i: algos.batch_stats(cfg, old[s], rollout[s], mask[s]) for i, s in enumerate(micro)}
    step = algos.sum_stats(stats.values())
    denom = algos.loss_denominator(cfg, mask, mask.shape[1], len(micro), step)   # one mini-batch
    ours = sum(algos.rl_loss(cfg, logp[s], old[s], rollout[s], adv[s], mask[s], denom, ref_logp=ref[s],
                             entropy=entropy[s], step_stats=step)[0] for s in micro)
    peer = _verl_actor_loss(logp, old, rollout, ref, adv, mask, entropy, cfg)
    assert 0 < step["kept_tokens"] < int(mask.sum())
    _close(ours, peer)
    _close(_grad(ours, logp), _grad(peer, logp))
    _close(_grad(ours, entropy), _grad(peer, entropy))


def test_drop_rejected_from_denominator_hand_values():
    old, rollout, mask = _corr_hand()
    logp = old.clone().requires_grad_(True)                     # on-policy: r = 1, per-token loss -A
    adv = torch.tensor([1.0, 2.0], dtype=D)
    # token_mask cap 2 (band [.5, 2]) keeps row 0 tok 1 (w 1) and row 1 both tokens (w 1.5, .8)
    # loss numerator: -(1 * 1) - 2 * (1.5 + .8) = -5.6; kept 3 tokens (dropped) vs 5 (kept in denominator)
    for drop, n in ((True, 3.0), (False, 5.0)):
        cfg = _cfg(correction="token_mask", tis_cap=2.0, drop_rejected_from_denominator=drop)
        st = algos.batch_stats(cfg, old, rollout, mask)
        d = algos.loss_denominator(cfg, mask, 3, 1, st)
        assert d == n
        loss, _ = algos.rl_loss(cfg, logp, old, rollout, adv, mask, d)
        assert loss.item() == pytest.approx(-5.6 / n)


# ================================================================ config validation
@pytest.mark.parametrize("override, words", [
    ("algo.clip_ratio_c=1.0", ["algo.clip_ratio_c", "> 1"]),
    ("algo.correction=seq_mask", ["algo.correction", "seq_geo_mask", "sequence_mask"]),
    ("algo.policy_loss=ppo", ["algo.policy_loss", "gspo", "cispo"]),
    ("algo.loss_agg=dapo", ["algo.loss_agg", "bnpo"]),
    ("algo.rollout_rs=token_k2", ["algo.rollout_rs_threshold"]),
    ("algo.rollout_rs_threshold=2.0", ["algo.rollout_rs"]),
    ("algo.scale_rewards=batch algo.advantage=rloo", ["algo.scale_rewards", "grpo"]),
    ("algo.rollout_is_batch_normalize=true", ["algo.rollout_is_batch_normalize", "correction"]),
    ("algo.tis_low=3.0", ["algo.tis_low", "tis_cap"]),
    ("algo.entropy_coeff=-1", ["algo.entropy_coeff", ">= 0"]),
    ("algo.kl_estimator=k2+", ["algo.kl_estimator", "k3+"]),
])
def test_config_rejects_bad_algo_values(override, words):
    with pytest.raises(ConfigError) as e:
        compose(["recipe=quickstart", "model=tiny", *override.split()])
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_config_accepts_the_new_options():
    cfg = compose(["recipe=quickstart", "model=tiny", "algo.policy_loss=gspo", "algo.loss_agg=seq-mean-token-sum",
                   "algo.correction=sequence_mask", "algo.rollout_rs=token_k1", "algo.rollout_rs_threshold='0.5_2'",
                   "algo.clip_ratio_c=null", "algo.kl_estimator=k3+", "algo.scale_rewards=batch"])
    assert cfg.algo.policy_loss == "gspo" and cfg.algo.clip_ratio_c is None
    assert compose(["model=tiny"]).algo.clip_ratio_c == 3.0                  # dual-clip on by default (verl)


def test_token_mask_equals_verl_icepop_with_asymmetric_bounds():
    # verl IcePop: rollout_is=token (threshold above the band) + rollout_rs=token_k1 "a_b" (keeps
    # a <= 1/rho <= b, rejected tokens leave response_mask) == token_mask low=1/b, cap=1/a, dropped
    logp, old, rollout, _, adv, mask = _case(13)
    a, b = 0.6, 1.25
    cfg = _cfg(correction="token_mask", tis_low=1 / b, tis_cap=1 / a, drop_rejected_from_denominator=True,
               clip_ratio_c=3.0)
    st = algos.batch_stats(cfg, old, rollout, mask)
    ours, _ = algos.rl_loss(cfg, logp, old, rollout, adv, mask, algos.loss_denominator(cfg, mask, 9, 1, st))
    response_mask = verl_rs_mask(old - rollout, mask, "token_k1", a, b)
    w = verl_is_weights(old - rollout, mask, "token", 100.0)
    peer = verl_agg_loss(verl_vanilla(old, logp, adv, 0.2, 0.2, 3.0) * w, response_mask, "token-mean")
    assert 0 < int(response_mask.sum()) < int(mask.sum())
    _close(ours, peer)
    _close(_grad(ours, logp), _grad(peer, logp))
