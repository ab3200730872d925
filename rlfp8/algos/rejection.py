"""Rejection of tokens / sequences by a divergence between pi_old and pi_rollout (verl
``algorithm.rollout_correction.rollout_rs``, ``rollout_corr_helper.compute_rollout_rejection_mask``).

With log r_t = old_logp_t - rollout_logp_t clamped to +-20 (verl's SAFETY_BOUND), the per-token
divergences are verl's:

    k1_t = -log r_t        k2_t = 0.5 (log r_t)^2        k3_t = r_t - 1 - log r_t

An option ``<level>_<estimator>`` keeps a token when its statistic passes the threshold:
``token_*`` on the token's own k; ``seq_sum_*`` / ``seq_mean_*`` / ``seq_max_*`` on the sum / mean /
max of k over the row's masked tokens, keeping or rejecting the whole row. k1 options keep
log L <= stat <= log U (verl's threshold "L_U"; a single number U means L = 1/U); note the bound is
on -log r, i.e. on pi_rollout / pi_old. k2 / k3 options keep stat <= U. ``rollout_rs_threshold`` is
verl's: a number, or "L_U" for k1 options. One option per run (verl also chains options with commas).

Rejected tokens get weight 0 in the loss; with ``algo.drop_rejected_from_denominator`` they also leave
the aggregation denominator, as verl removes them from ``response_mask``.
"""
from __future__ import annotations

import math

import torch

from .losses import LOG_RATIO_CLAMP, _bool_mask, _check_bt

_K = {
    "k1": lambda lr: -lr,
    "k2": lambda lr: 0.5 * lr.square(),
    "k3": lambda lr: torch.exp(lr) - 1.0 - lr,
}
_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")
ROLLOUT_RS_OPTIONS = tuple(f"{lv}_{k}" for lv in _LEVELS for k in _K if not (lv == "seq_max" and k == "k1"))


def parse_threshold(option: str, threshold) -> tuple[float | None, float]:
    """(lower, upper) bounds of the statistic: log-space for k1 options, (None, U) otherwise.
    Raises ValueError naming ``algo.rollout_rs_threshold`` for a missing or malformed value."""
    key = "algo.rollout_rs_threshold"
    if option not in ROLLOUT_RS_OPTIONS:
        raise ValueError(f"algo.rollout_rs={option!r}; allowed values are {(None,) + ROLLOUT_RS_OPTIONS}")
    if threshold is None or isinstance(threshold, bool):
        raise ValueError(f"{key}={threshold!r}: rollout_rs={option} needs a threshold (a number, or 'L_U' for k1)")
    text = str(threshold)
    parts = text.split("_")
    if len(parts) > 2 or (len(parts) == 2 and not option.endswith("k1")):
        raise ValueError(f"{key}={text!r}: a single upper bound for {option} ('L_U' only for k1 options)")
    try:
        vals = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"{key}={text!r}: not a number (or 'L_U' pair of numbers)") from None
    if any(not v > 0 for v in vals):
        raise ValueError(f"{key}={text!r}: bounds must be > 0")
    if not option.endswith("k1"):
        return None, vals[0]
    lower, upper = (1.0 / vals[0], vals[0]) if len(vals) == 1 else vals
    if lower > upper:
        raise ValueError(f"{key}={text!r}: lower bound {lower} > upper bound {upper}")
    return math.log(lower), math.log(upper)


def rejection_mask(
    old_logp: torch.Tensor,       # [B, T]
    rollout_logp: torch.Tensor,   # [B, T]
    mask: torch.Tensor,           # [B, T] bool or 0/1 float
    option: str,
    threshold,
) -> tuple[torch.Tensor, dict[str, float]]:
    """keep [B, T] bool (True = kept; padding True) and metrics ``rejection/token_frac`` (masked tokens
    rejected), ``rejection/seq_frac`` (rows with >= 1 rejected token), ``rejection/stat_mean``."""
    _check_bt("rejection_mask", old_logp=old_logp, rollout_logp=rollout_logp, mask=mask)
    lower, upper = parse_threshold(option, threshold)
    level, est = option.rsplit("_", 1)
    valid = _bool_mask(mask)
    with torch.no_grad():
        lr = torch.where(valid, old_logp.detach().double() - rollout_logp.detach().double(), 0.0)
        k = _K[est](lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))                       # [B, T]
        n_row = valid.sum(dim=1).clamp(min=1)
        if level == "token":
            stat = k
        elif level == "seq_sum":
            stat = torch.where(valid, k, 0.0).sum(dim=1, keepdim=True)
        elif level == "seq_mean":
            stat = torch.where(valid, k, 0.0).sum(dim=1, keepdim=True) / n_row[:, None]
        else:
            stat = torch.where(valid, k, -math.inf).max(dim=1, keepdim=True).values.clamp(min=0.0)
        keep = stat <= upper
        if lower is not None:
            keep = keep & (stat >= lower)
        keep = (keep.expand_as(valid) | ~valid).contiguous()
        rejected = valid & ~keep
        n_tok, has_tok = valid.sum().clamp(min=1), valid.any(dim=1)
        stat_tok = stat.expand_as(k)
        metrics = {
            "rejection/token_frac": float(rejected.sum() / n_tok),
            "rejection/seq_frac": float(rejected.any(dim=1).sum() / has_tok.sum().clamp(min=1)),
            "rejection/stat_mean": float(torch.where(valid, stat_tok, 0.0).sum() / n_tok),
        }
    return keep, metrics
