"""rlfp8.algos against hand-computed values (each expected number is derived in a comment)."""
import math

import pytest
import torch

from rlfp8.algos import (
    MISMATCH_KEYS,
    aggregate,
    aggregation_denominator,
    compute_advantages,
    importance_weights,
    kl_penalty,
    mismatch_metrics,
    policy_loss_terms,
)

LN = math.log


def close(t, expected, tol=1e-6):
    exp = torch.tensor(expected, dtype=torch.float64)
    assert t.shape == exp.shape, (t.shape, exp.shape)
    assert torch.allclose(t.double(), exp, atol=tol, rtol=0), (t, exp)


# =============================================================================================
# advantages
# =============================================================================================
def test_grpo_bessel_std_hand_values():
    # group [1, 0, 0]: mu = 1/3; Bessel var = ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3 -> sigma = 1/sqrt3
    #   A = (2/3) sqrt3 = 2/sqrt3, (-1/3) sqrt3 = -1/sqrt3
    # group [2, 2, 2]: centred 0 -> A = 0 (sigma 0, no NaN)
    r = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0])
    s3 = math.sqrt(3.0)
    close(compute_advantages(r, 3, "grpo", std_eps=0.0)[:3], [2 / s3, -1 / s3, -1 / s3])
    close(compute_advantages(r, 3, "grpo")[3:], [0.0, 0.0, 0.0])
    # default eps 1e-6 enters as (sigma + eps): 2/3 / (1/sqrt3 + 1e-6)
    a = compute_advantages(r, 3)
    assert a[0].item() == pytest.approx((2 / 3) / (1 / s3 + 1e-6), rel=1e-6)
    # group of 2, [0, 1]: mu .5, Bessel sigma = sqrt(.25 + .25) = 1/sqrt2 -> A = -+ .5 sqrt2
    close(compute_advantages(torch.tensor([0.0, 1.0]), 2, std_eps=0.0),
          [-0.5 * math.sqrt(2), 0.5 * math.sqrt(2)])


def test_drgrpo_and_rloo_hand_values():
    r = torch.tensor([1.0, 0.0, 0.0, 3.0, 1.0, 2.0])
    # drgrpo: r - mu; group 1 mu = 1/3, group 2 mu = 2
    close(compute_advantages(r, 3, "drgrpo"), [2 / 3, -1 / 3, -1 / 3, 1.0, -1.0, 0.0])
    # rloo: r_i - mean of the others
    #   [1,0,0]: 1 - 0 = 1; 0 - (1+0)/2 = -.5; -.5
    #   [3,1,2]: 3 - 1.5 = 1.5; 1 - 2.5 = -1.5; 2 - 2 = 0
    close(compute_advantages(r, 3, "rloo"), [1.0, -0.5, -0.5, 1.5, -1.5, 0.0])


def test_singleton_groups_follow_verl():
    r = torch.tensor([3.0, -1.0])
    # verl: mu = 0, sigma = 1 -> grpo r/(1+eps); drgrpo r; rloo r
    close(compute_advantages(r, 1, "grpo"), [3.0 / (1 + 1e-6), -1.0 / (1 + 1e-6)])
    close(compute_advantages(r, 1, "drgrpo"), [3.0, -1.0])
    close(compute_advantages(r, 1, "rloo"), [3.0, -1.0])


def test_advantages_int_rewards_and_detached():
    a = compute_advantages(torch.tensor([1, 0]), 2, "drgrpo")
    assert a.dtype == torch.float32
    close(a, [0.5, -0.5])
    r = torch.tensor([1.0, 0.0], requires_grad=True)
    assert not compute_advantages(r, 2).requires_grad


@pytest.mark.parametrize("kwargs, words", [
    (dict(rewards=torch.zeros(5), group_size=2), ["group_size=2", "B=5"]),
    (dict(rewards=torch.zeros(4), group_size=2, estimator="ppo"), ["estimator", "grpo", "rloo"]),
    (dict(rewards=torch.zeros(4), group_size=0), ["group_size"]),
    (dict(rewards=torch.zeros(2, 2), group_size=2), ["rewards", "1-D"]),
    (dict(rewards=torch.zeros(4), group_size=2, std_eps=-1.0), ["std_eps"]),
])
def test_advantages_bad_arguments(kwargs, words):
    with pytest.raises(ValueError) as e:
        compute_advantages(**kwargs)
    for w in words:
        assert w in str(e.value)


# =============================================================================================
# policy loss
# =============================================================================================
def _ppo_case():
    # old_logp = 0, logp = ln(rho), so rho is exactly what is written.
    # row 0: A = +1, rho = [1.5, 1.1, 0.5]; row 1: A = -2, rho = [1.5, 0.7, <pad: NaN>]
    rho = torch.tensor([[1.5, 1.1, 0.5], [1.5, 0.7, 1.0]], dtype=torch.float64)
    logp = rho.log()
    logp[1, 2] = float("nan")                      # padding garbage must not leak
    logp.requires_grad_(True)
    old = torch.zeros(2, 3, dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return logp, old, adv, mask


def test_ppo_clip_higher_hand_values_and_grads():
    logp, old, adv, mask = _ppo_case()
    per_tok, m = policy_loss_terms(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28)
    # clip range [0.8, 1.28]. l = -min(rho A, clip(rho) A)
    # row 0 (A=1):  1.5 -> -min(1.5, 1.28) = -1.28 (clipped high); 1.1 -> -1.1; 0.5 -> -min(.5,.8) = -.5
    # row 1 (A=-2): 1.5 -> 2 max(1.5, 1.28) = 3.0; 0.7 -> 2 max(.7, .8) = 1.6 (clipped low); pad -> 0
    close(per_tok, [[-1.28, -1.1, -0.5], [3.0, 1.6, 0.0]], 1e-12)
    # d l / d logp = -A rho where the unclipped term is active, 0 where the clip is active
    per_tok.sum().backward()
    close(logp.grad, [[0.0, -1.1, -0.5], [3.0, 0.0, 0.0]], 1e-12)
    # 5 valid tokens: one clipped high (row0 tok0), one clipped low (row1 tok1)
    assert m["policy/clip_frac_high"] == pytest.approx(0.2)
    assert m["policy/clip_frac_low"] == pytest.approx(0.2)
    assert m["policy/clip_frac"] == pytest.approx(0.4)
    # ratio mean = (1.5 + 1.1 + .5 + 1.5 + .7)/5 = 1.06, max 1.5
    assert m["policy/ratio_mean"] == pytest.approx(1.06)
    assert m["policy/ratio_max"] == pytest.approx(1.5)
    # approx kl = mean(old - logp) = -(2 ln1.5 + ln1.1 + ln.5 + ln.7)/5 = 0.0287164...
    s = 2 * LN(1.5) + LN(1.1) + LN(0.5) + LN(0.7)
    assert m["policy/approx_kl"] == pytest.approx(-s / 5)
    assert m["policy/approx_kl"] == pytest.approx(0.0287164, abs=1e-6)
    # k3 = mean(rho - 1 - ln rho) = (5.3 - 5 - s)/5 = 0.0887164...
    assert m["policy/approx_kl_k3"] == pytest.approx(0.0887164, abs=1e-6)
    assert all(isinstance(v, float) for v in m.values())


def test_ppo_symmetric_clip_and_is_weights_detached():
    logp, old, adv, mask = _ppo_case()
    w = torch.tensor([[2.0, 1.0, 0.5], [1.0, 0.25, 7.0]], dtype=torch.float64, requires_grad=True)
    per_tok, m = policy_loss_terms(logp, old, adv, mask, 0.2, 0.2, is_weights=w)
    # symmetric [0.8, 1.2]: row0 [-1.2, -1.1, -.5]; row1 [2 max(1.5,1.2)=3, 2 max(.7,.8)=1.6, 0]
    # times w: row0 [-2.4, -1.1, -.25]; row1 [3.0, .4, 0 (pad, w=7 ignored)]
    close(per_tok, [[-2.4, -1.1, -0.25], [3.0, 0.4, 0.0]], 1e-12)
    per_tok.sum().backward()
    assert w.grad is None                                   # weights are constants
    # grads: -A rho w on unclipped tokens: row0 tok1 -1.1*1, tok2 -.5*.5; row1 tok0 3*1
    close(logp.grad, [[0.0, -1.1, -0.25], [3.0, 0.0, 0.0]], 1e-12)


def test_ppo_empty_mask_and_bad_args():
    logp, old, adv, _ = _ppo_case()
    per_tok, m = policy_loss_terms(logp, old, adv, torch.zeros(2, 3, dtype=torch.bool))
    assert torch.equal(per_tok, torch.zeros(2, 3, dtype=torch.float64))
    assert all(v == 0.0 for v in m.values())
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss_terms(logp, old, adv[:1], mask)
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss_terms(logp, old[:, :2], adv, mask)
    with pytest.raises(ValueError, match="clip_eps_low"):
        policy_loss_terms(logp, old, adv, mask, clip_eps_low=1.5)


# =============================================================================================
# aggregation
# =============================================================================================
# rows: l0=[1,2,3] m=[1,1,0]; l1=[4,5,6] m=[1,0,0]; l2=[7,8,9] m=[1,1,1]; l3=[10,11,12] m=[0,0,0]
L = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [10.0, 11.0, 12.0]]
M = [[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]]


@pytest.mark.parametrize("mode, denom, total", [
    # tokens 2+1+3 = 6; masked sum 1+2+4+7+8+9 = 31
    ("token-mean", 6.0, 31 / 6),
    # rows with tokens: 3; row means 1.5, 4, 8 -> 13.5 / 3
    ("seq-mean-token-mean", 3.0, 4.5),
    # B * max_response_len = 4 * 4 = 16 (constant, the empty row counts) -> 31/16
    ("seq-mean-token-sum-norm", 16.0, 31 / 16),
])
def test_aggregate_hand_values_and_microbatch_invariance(mode, denom, total):
    lossv = torch.tensor(L, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(M, dtype=torch.bool)
    d = aggregation_denominator(mask, mode, max_response_len=4)
    assert d == denom
    whole = aggregate(lossv, mask, mode, d)
    assert whole.item() == pytest.approx(total, abs=1e-12)
    (g_whole,) = torch.autograd.grad(whole, lossv)

    # 3 micro-batches (rows [0], [1, 2], [3]) with the mini-batch's denominator, summed as
    # gradient accumulation does: equal to the whole mini-batch, value and gradient.
    acc_val, acc_grad = 0.0, torch.zeros_like(lossv)
    for rows in ([0], [1, 2], [3]):
        part = aggregate(lossv[rows], mask[rows], mode, d)
        acc_val += part.item()
        acc_grad += torch.autograd.grad(part, lossv)[0]
    assert acc_val == pytest.approx(total, abs=1e-12)
    assert torch.allclose(acc_grad, g_whole, atol=1e-15, rtol=0)
    # float 0/1 mask gives the same result
    fmask = mask.to(torch.float32)
    assert aggregation_denominator(fmask, mode, 4) == denom
    assert aggregate(lossv, fmask, mode, d).item() == pytest.approx(total, abs=1e-12)


def test_aggregate_token_mean_grad_hand_values():
    # token-mean: d/dl = m / 6
    lossv = torch.tensor(L, dtype=torch.float64, requires_grad=True)
    aggregate(lossv, torch.tensor(M).bool(), "token-mean", 6.0).backward()
    close(lossv.grad, [[1 / 6, 1 / 6, 0], [1 / 6, 0, 0], [1 / 6] * 3, [0, 0, 0]], 1e-15)
    # seq-mean-token-mean: d/dl = m / (N_tok(row) * 3)
    lossv.grad = None
    aggregate(lossv, torch.tensor(M).bool(), "seq-mean-token-mean", 3.0).backward()
    close(lossv.grad, [[1 / 6, 1 / 6, 0], [1 / 3, 0, 0], [1 / 9] * 3, [0, 0, 0]], 1e-15)


def test_aggregate_random_split_invariance():
    B, T = 7, 5
    lossv = torch.randn(B, T, dtype=torch.float64)
    mask = torch.rand(B, T) > 0.4
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        d = aggregation_denominator(mask, mode, max_response_len=T)
        whole = aggregate(lossv, mask, mode, d)
        parts = sum(aggregate(lossv[s], mask[s], mode, d) for s in (slice(0, 2), slice(2, 3), slice(3, 7)))
        assert torch.allclose(parts, whole, atol=1e-12, rtol=0)


def test_aggregate_empty_and_bad_args():
    empty = torch.zeros(2, 3, dtype=torch.bool)
    for mode in ("token-mean", "seq-mean-token-mean"):
        d = aggregation_denominator(empty, mode)
        assert d == 1.0                                     # never divides by zero
        assert aggregate(torch.ones(2, 3), empty, mode, d).item() == 0.0
    with pytest.raises(ValueError, match="allowed values"):
        aggregation_denominator(empty, "sum")
    with pytest.raises(ValueError, match="allowed values"):
        aggregate(torch.ones(2, 3), empty, "seq-mean", 1.0)
    with pytest.raises(ValueError, match="max_response_len"):
        aggregation_denominator(empty, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="denom"):
        aggregate(torch.ones(2, 3), empty, "token-mean", 0.0)
    with pytest.raises(ValueError, match="mask"):
        aggregate(torch.ones(2, 3), torch.ones(2, 4), "token-mean", 1.0)


# =============================================================================================
# KL penalty
# =============================================================================================
def test_kl_penalty_hand_values():
    logp = torch.tensor([[0.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.0, 0.0]], dtype=torch.float64)
    # d = logp - ref = [1, -1]
    close(kl_penalty(logp, ref, "k1"), [[1.0, -1.0]], 1e-15)
    close(kl_penalty(logp, ref, "k2"), [[0.5, 0.5]], 1e-15)
    # k3: x = ref - logp = [-1, 1]; e^x - x - 1 = [e^-1, e - 2] = [0.3678794, 0.7182818]
    close(kl_penalty(logp, ref, "k3"), [[0.36787944117, 0.71828182846]], 1e-10)
    assert torch.equal(kl_penalty(logp, ref, "low_var_kl"), kl_penalty(logp, ref, "k3"))
    assert torch.equal(kl_penalty(logp, ref, "kl"), kl_penalty(logp, ref, "k1"))


def test_kl_k3_clamps():
    # x = ref - logp = -25 -> clamped to -20: e^-20 + 20 - 1 ~ 19 -> output clamp 10
    # x = +1000 -> clamped to 20 (no overflow): e^20 - 21 ~ 4.85e8 -> 10; x = -12: e^-12 + 11 -> 10
    # x = 2.5: e^2.5 - 3.5 = 8.6824940 (inside both clamps)
    logp = torch.tensor([[0.0, -1000.0, 0.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[-25.0, 0.0, -12.0, 2.5]])
    k3 = kl_penalty(logp, ref, "k3")
    close(k3, [[10.0, 10.0, 10.0, math.exp(2.5) - 3.5]], 1e-5)
    k3.sum().backward()
    assert torch.isfinite(logp.grad).all()
    with pytest.raises(ValueError, match="k1"):
        kl_penalty(logp, ref, "k4")


# =============================================================================================
# importance corrections
# =============================================================================================
def _corr_case():
    # rollout = -1 everywhere, old = rollout + ln(rho);
    # row 0 rho = [0.25, 1.0, 3.0]; row 1 rho = [1.5, 0.8, <pad NaN>]; 5 valid tokens
    rho = torch.tensor([[0.25, 1.0, 3.0], [1.5, 0.8, 1.0]], dtype=torch.float64)
    rollout = torch.full((2, 3), -1.0, dtype=torch.float64)
    old = (rollout + rho.log())
    old[1, 2] = float("nan")
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return old, rollout, mask


def test_none_weights_are_ones():
    old, rollout, mask = _corr_case()
    w, m = importance_weights(old, rollout, mask, "none")
    assert torch.equal(w, torch.ones(2, 3))
    assert m["correction/weight_mean"] == 1.0 and m["correction/clip_frac"] == 0.0


def test_tis_caps_at_c():
    old, rollout, mask = _corr_case()
    w, m = importance_weights(old, rollout, mask, "tis", cap=2.0)
    # min(rho, 2): row0 [.25, 1, 2 (3 capped)]; row1 [1.5, .8, 1 (pad neutral)]
    close(w, [[0.25, 1.0, 2.0], [1.5, 0.8, 1.0]])
    assert w.dtype == torch.float32 and not w.requires_grad
    assert m["correction/clip_frac"] == pytest.approx(1 / 5)
    # mean over valid tokens: (.25 + 1 + 2 + 1.5 + .8)/5 = 1.11
    assert m["correction/weight_mean"] == pytest.approx(1.11, abs=1e-6)
    # with low=0.5 also raised from below: .25 -> .5; two tokens affected
    w, m = importance_weights(old, rollout, mask, "tis", cap=2.0, low=0.5)
    close(w, [[0.5, 1.0, 2.0], [1.5, 0.8, 1.0]])
    assert m["correction/clip_frac"] == pytest.approx(2 / 5)


def test_seq_tis():
    old, rollout, mask = _corr_case()
    # row0: exp(ln .25 + ln 1 + ln 3) = 0.75; row1: exp(ln 1.5 + ln .8) = 1.2 (pad excluded)
    w, m = importance_weights(old, rollout, mask, "seq_tis", cap=2.0)
    close(w, [[0.75, 0.75, 0.75], [1.2, 1.2, 1.0]])
    assert m["correction/seq_clip_frac"] == 0.0
    # cap 1.0: row1 truncated to 1.0 -> 1 of 2 sequences, 2 of 5 tokens
    w, m = importance_weights(old, rollout, mask, "seq_tis", cap=1.0)
    close(w, [[0.75, 0.75, 0.75], [1.0, 1.0, 1.0]])
    assert m["correction/seq_clip_frac"] == pytest.approx(0.5)
    assert m["correction/clip_frac"] == pytest.approx(2 / 5)
    # weight mean = (3 * .75 + 2 * 1)/5 = 0.85
    assert m["correction/weight_mean"] == pytest.approx(0.85, abs=1e-6)


def test_token_mask():
    old, rollout, mask = _corr_case()
    # cap 2, low = 1/2: kept tokens (rho in [.5, 2]) weigh rho (issue 20: TRL token_mask / icepop),
    # masked ones 0: row0 [0, 1, 0]; row1 [1.5, .8, pad 1]
    w, m = importance_weights(old, rollout, mask, "token_mask", cap=2.0)
    close(w, [[0.0, 1.0, 0.0], [1.5, 0.8, 1.0]])
    assert m["correction/mask_frac"] == pytest.approx(2 / 5)
    # (0 + 1 + 0 + 1.5 + .8) / 5
    assert m["correction/weight_mean"] == pytest.approx(3.3 / 5)


def test_seq_mask_geometric_mean_over_masked_tokens():
    old, rollout, mask = _corr_case()
    # geo means: row0 .75^(1/3) = 0.90856; row1 1.2^(1/2) = 1.09545 (over its 2 valid tokens;
    # dividing by T=3 would give 1.2^(1/3) = 1.0627 and fail the check below).
    # [low, cap] = [1.08, 1.2]: row0 masked, row1 kept.
    w, m = importance_weights(old, rollout, mask, "seq_geo_mask", cap=1.2, low=1.08)
    close(w, [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert m["correction/seq_mask_frac"] == pytest.approx(0.5)
    assert m["correction/mask_frac"] == pytest.approx(3 / 5)
    assert m["correction/weight_mean"] == pytest.approx(2 / 5)
    # default low = 1/cap: cap 2 -> [.5, 2] keeps both rows
    w, m = importance_weights(old, rollout, mask, "seq_geo_mask", cap=2.0)
    close(w, [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    assert m["correction/seq_mask_frac"] == 0.0


def test_log_ratio_clamped_at_20():
    # log rho = +50 / -50 is clamped to +-20 before exp: exp(20) = 4.85e8 <= cap 1e10 and
    # exp(-20) = 2.06e-9 >= low 1e-10, so both are kept (unclamped, exp(50) = 5e21 > cap would drop).
    old = torch.tensor([[50.0, -50.0]])
    rollout = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    w, _ = importance_weights(old, rollout, mask, "token_mask", cap=1e10, low=1e-10)
    assert bool((w > 0).all())                              # both kept, weight = the clamped rho
    assert w[0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-6)
    w, _ = importance_weights(old, rollout, mask, "tis", cap=1e10)
    close(w, [[math.exp(20.0), math.exp(-20.0)]], tol=1e3)
    assert w[0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-6)
    # seq: sum = 0 -> weight 1
    w, _ = importance_weights(torch.tensor([[50.0, -50.0]]), rollout, mask, "seq_tis", cap=5.0)
    close(w, [[1.0, 1.0]])


def test_correction_empty_mask_and_bad_args():
    old, rollout, _ = _corr_case()
    empty = torch.zeros(2, 3, dtype=torch.bool)
    for mode in ("none", "tis", "seq_tis", "token_mask", "sequence_mask", "seq_geo_mask"):
        w, m = importance_weights(old, rollout, empty, mode)
        assert torch.isfinite(w).all()
        assert all(v == 0.0 for v in m.values()), (mode, m)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="allowed values"):
        importance_weights(old, rollout, mask, "icepop")
    with pytest.raises(ValueError, match="seq_geo_mask"):                  # renamed in issue 20
        importance_weights(old, rollout, mask, "seq_mask")
    with pytest.raises(ValueError, match="cap"):
        importance_weights(old, rollout, mask, "tis", cap=0.0)
    with pytest.raises(ValueError, match="low"):
        importance_weights(old, rollout, mask, "token_mask", cap=2.0, low=3.0)
    with pytest.raises(ValueError, match="rollout_logp"):
        importance_weights(old, rollout[:1], mask, "tis")


# =============================================================================================
# mismatch metrics
# =============================================================================================
def test_mismatch_hand_values():
    # tokens (p_eng, p_tr): (.5, .25) -> r = .5; (.2, .6) -> r = 3; (.9, .9) -> r = 1; 4th = padding
    p_eng = torch.tensor([[0.5, 0.2], [0.9, 0.3]])
    p_tr = torch.tensor([[0.25, 0.6], [0.9, 0.3]])
    le, lt = p_eng.log(), p_tr.log()
    le[1, 1] = float("-inf")                    # padding garbage
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    m = mismatch_metrics(le, lt, mask, tis_cap=2.0)
    assert tuple(m) == MISMATCH_KEYS
    assert set(m) == {
        "mismatch/kl_k1", "mismatch/kl_k3", "mismatch/abs_logp_diff_mean", "mismatch/abs_logp_diff_max",
        "mismatch/probs_diff_mean", "mismatch/is_ratio_mean", "mismatch/is_ratio_max",
        "mismatch/tis_clip_frac",
    }
    tol = 1e-6
    # log r = [ln .5, ln 3, 0] = [-0.693147, 1.098612, 0]
    # k1 = mean(le - lt) = -mean(log r) = -(0.405465)/3 = -0.135155
    assert m["mismatch/kl_k1"] == pytest.approx(-0.1351550, abs=tol)
    # k3 = mean(r - 1 - log r) = [(.5 - 1 + .693147) + (3 - 1 - 1.098612) + 0]/3 = 0.364845
    assert m["mismatch/kl_k3"] == pytest.approx(0.3648450, abs=tol)
    # |log r|: mean (0.693147 + 1.098612)/3 = 0.597253, max 1.098612
    assert m["mismatch/abs_logp_diff_mean"] == pytest.approx(0.5972532, abs=tol)
    assert m["mismatch/abs_logp_diff_max"] == pytest.approx(1.0986123, abs=tol)
    # |p_tr - p_eng|: (.25 + .4 + 0)/3 = 0.216667
    assert m["mismatch/probs_diff_mean"] == pytest.approx(0.65 / 3, abs=tol)
    # r: mean (.5 + 3 + 1)/3 = 1.5, max 3; r > 2 on 1 of 3 tokens
    assert m["mismatch/is_ratio_mean"] == pytest.approx(1.5, abs=tol)
    assert m["mismatch/is_ratio_max"] == pytest.approx(3.0, abs=tol)
    assert m["mismatch/tis_clip_frac"] == pytest.approx(1 / 3)
    assert all(isinstance(v, float) and math.isfinite(v) for v in m.values())


def test_mismatch_identical_and_empty():
    lp = torch.log(torch.rand(3, 4) * 0.9 + 0.05)
    mask = torch.ones(3, 4, dtype=torch.bool)
    m = mismatch_metrics(lp, lp.clone(), mask)
    assert m["mismatch/kl_k1"] == 0.0 and m["mismatch/kl_k3"] == 0.0
    assert m["mismatch/is_ratio_mean"] == 1.0 and m["mismatch/tis_clip_frac"] == 0.0
    empty = mismatch_metrics(lp, lp + 1.0, torch.zeros(3, 4, dtype=torch.bool))
    assert tuple(empty) == MISMATCH_KEYS and all(v == 0.0 for v in empty.values())
    with pytest.raises(ValueError, match="tis_cap"):
        mismatch_metrics(lp, lp, mask, tis_cap=0)
    with pytest.raises(ValueError, match="mask"):
        mismatch_metrics(lp, lp, mask[:, :2])
