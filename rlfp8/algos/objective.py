"""The RL loss of one micro-batch from the ``algo`` config section: the one call the trainer makes.

    loss = aggregate(l_t * w_t)  +  kl_coef * aggregate(kl_t [* r_t])  -  entropy_coeff * aggregate(H_t)

l_t: ``algo.policy_loss`` (``rlfp8.algos.policy``) with ``clip_eps_low/high`` and ``clip_ratio_c``;
w_t: ``algo.correction`` weights (``rlfp8.algos.correction``: ``tis_cap``, ``tis_low``), divided by
their step-batch mean with ``rollout_is_batch_normalize``, times the ``rollout_rs`` keep mask
(``rlfp8.algos.rejection``); kl_t: ``kl_estimator`` to the reference policy, times the policy ratio
r_t (pi_theta / pi_old; the sequence ratio for gspo; not detached) with ``use_bias_correction_kl``
(TRL); H_t: the token entropy (verl ``entropy_coeff``: aggregated like the policy loss). All three
terms share ``loss_agg`` and its mini-batch denominator, as verl and TRL add them (the KL term is
not importance-weighted). With ``drop_rejected_from_denominator`` tokens a mask mode or
``rollout_rs`` rejects (w = 0) leave the aggregation's mask and denominator (verl's
``response_mask`` update); otherwise they count as zero-loss tokens.

Batch statistics: batch normalisation needs the weights of the whole step and the denominator with
dropped tokens needs the kept counts of the whole mini-batch, before the first backward. The
trainer gets them from ``batch_stats`` of every micro-batch in its no-grad pass (``needs_batch_stats``
says when), sums them (``sum_stats``) and passes the mini-batch sums to ``loss_denominator`` and the
step sums to ``rl_loss``.
"""
from __future__ import annotations

import torch

from .correction import batch_normalised, importance_weights, weight_sums
from .kl import kl_penalty
from .losses import LOG_RATIO_CLAMP, _bool_mask, aggregate, aggregation_denominator, policy_loss_terms
from .rejection import rejection_mask

STAT_KEYS = ("kept_tokens", "kept_rows", "weight_sum", "weight_count")


def _get(cfg: dict, key: str):
    try:
        return cfg[key]
    except KeyError:
        raise KeyError(f"algo.{key} is missing from the algo config (defaults: conf/algo/grpo.yaml)") from None


def needs_batch_stats(cfg: dict) -> bool:
    return bool(_get(cfg, "rollout_is_batch_normalize")) or bool(_get(cfg, "drop_rejected_from_denominator"))


def _weights(cfg, old_logp, rollout_logp, mask, step_stats=None):
    """(w [B, T], kept [B, T] bool, metrics): correction weights (batch-normalised if asked) times
    the rollout_rs keep mask; kept = masked tokens with w > 0."""
    w, metrics = importance_weights(old_logp, rollout_logp, mask, _get(cfg, "correction"),
                                    cap=float(_get(cfg, "tis_cap")), low=_get(cfg, "tis_low"))
    if step_stats is not None and _get(cfg, "rollout_is_batch_normalize"):
        w, factor = batch_normalised(w, step_stats["weight_sum"], step_stats["weight_count"])
        metrics["correction/batch_norm_factor"] = factor
    if _get(cfg, "rollout_rs") is not None:
        keep, rm = rejection_mask(old_logp, rollout_logp, mask, _get(cfg, "rollout_rs"),
                                  _get(cfg, "rollout_rs_threshold"))
        w = w * keep
        metrics.update(rm)
    return w, _bool_mask(mask) & (w > 0), metrics


def batch_stats(cfg: dict, old_logp, rollout_logp, mask) -> dict[str, float]:
    """Additive sums of one micro-batch (``STAT_KEYS``): kept tokens, rows with >= 1 kept token,
    and the (sum, count) of the un-normalised correction weights (``correction.weight_sums``)."""
    w, _ = importance_weights(old_logp, rollout_logp, mask, _get(cfg, "correction"),
                               cap=float(_get(cfg, "tis_cap")), low=_get(cfg, "tis_low"))
    weight_sum, weight_count = weight_sums(w, mask, _get(cfg, "correction"))
    _, kept, _ = _weights(cfg, old_logp, rollout_logp, mask)
    return {"kept_tokens": float(kept.sum()), "kept_rows": float(kept.any(dim=1).sum()),
            "weight_sum": weight_sum, "weight_count": weight_count}


def sum_stats(stats) -> dict[str, float]:
    stats = list(stats)
    return {k: sum(s[k] for s in stats) for k in STAT_KEYS}


def loss_denominator(cfg: dict, mask: torch.Tensor, max_response_len: int, num_micro_batches: int = 1,
                     stats: dict | None = None) -> float:
    """``aggregation_denominator`` of the mini-batch ``mask``; with
    ``drop_rejected_from_denominator`` the token / row counts are the kept ones (``stats``: the
    mini-batch's summed ``batch_stats``)."""
    mode = _get(cfg, "loss_agg")
    if _get(cfg, "drop_rejected_from_denominator"):
        if stats is None:
            raise ValueError("loss_denominator: algo.drop_rejected_from_denominator=true needs the mini-batch's "
                             "batch_stats (the trainer's no-grad pass computes them)")
        if mode == "token-mean":
            return max(stats["kept_tokens"], 1.0)
        if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
            return max(stats["kept_rows"], 1.0)
    return aggregation_denominator(mask, mode, max_response_len, num_micro_batches)


def _policy_ratio(policy_loss: str, logp, old_logp, valid):
    """pi_theta / pi_old with gradient (TRL's coef_1): per row for gspo, per token otherwise."""
    log_ratio = torch.where(valid, logp - old_logp.detach(), 0.0)
    if policy_loss == "gspo":
        row = log_ratio.sum(dim=1, keepdim=True) / valid.sum(dim=1, keepdim=True).clamp(min=1)
        return torch.exp(row).expand_as(logp)
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def rl_loss(
    cfg: dict,                     # the algo config section (plain dict)
    logp: torch.Tensor,            # [B, T] log pi_theta, requires grad
    old_logp: torch.Tensor,        # [B, T] log pi_old
    rollout_logp: torch.Tensor,    # [B, T] log pi_rollout (the engine's)
    advantages: torch.Tensor,      # [B]
    mask: torch.Tensor,            # [B, T] response tokens
    denom: float,                  # loss_denominator(...) of the mini-batch
    ref_logp: torch.Tensor | None = None,   # [B, T] reference log-probs (needed when kl_coef > 0)
    entropy: torch.Tensor | None = None,    # [B, T] token entropy with grad (needed when entropy_coeff > 0)
    step_stats: dict | None = None,         # sum_stats over the step (needed for batch normalisation)
) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the loss (module docstring) and its metrics."""
    if _get(cfg, "rollout_is_batch_normalize") and step_stats is None:
        raise ValueError("rl_loss: algo.rollout_is_batch_normalize=true needs step_stats (summed batch_stats)")
    w, kept, metrics = _weights(cfg, old_logp, rollout_logp, mask, step_stats)
    valid = _bool_mask(mask)
    logp_safe = torch.where(valid, logp, 0.0)       # padding garbage must not reach the KL's gradient
    clip_c = _get(cfg, "clip_ratio_c")
    per_tok, pm = policy_loss_terms(logp, old_logp, advantages, mask, float(_get(cfg, "clip_eps_low")),
                                    float(_get(cfg, "clip_eps_high")), is_weights=w, loss=_get(cfg, "policy_loss"),
                                    clip_ratio_c=None if clip_c is None else float(clip_c))
    metrics.update(pm)
    agg_mask = kept if _get(cfg, "drop_rejected_from_denominator") else _bool_mask(mask)
    mode = _get(cfg, "loss_agg")
    loss = aggregate(per_tok, agg_mask, mode, denom)
    kl_coef, ent_coef = float(_get(cfg, "kl_coef")), float(_get(cfg, "entropy_coeff"))
    if kl_coef > 0:
        if ref_logp is None:
            raise ValueError("rl_loss: algo.kl_coef > 0 needs ref_logp")
        kl = kl_penalty(logp_safe, torch.where(valid, ref_logp, 0.0), _get(cfg, "kl_estimator"))
        if _get(cfg, "use_bias_correction_kl"):
            kl = kl * _policy_ratio(_get(cfg, "policy_loss"), logp_safe, torch.where(valid, old_logp, 0.0), valid)
        loss = loss + kl_coef * aggregate(kl, agg_mask, mode, denom)
        metrics["train/kl_ref"] = float(torch.where(agg_mask, kl.detach(), 0.0).sum() / agg_mask.sum().clamp(min=1))
    if ent_coef > 0:
        if entropy is None or not entropy.requires_grad:
            raise ValueError("rl_loss: algo.entropy_coeff > 0 needs the token entropy with its gradient")
        loss = loss - ent_coef * aggregate(torch.where(valid, entropy, 0.0), agg_mask, mode, denom)
    return loss, metrics
