"""Policy losses (per-token surrogate), one function per loss, registered in ``POLICY_LOSSES``.

Shapes: ``logp``/``old_logp`` [B, T], ``adv`` [B, 1] (already detached, in logp's dtype),
``valid`` [B, T] bool. Each function returns ``(per_token_loss [B, T], metrics)``; the caller
(``policy_loss_terms``) multiplies by the importance weights, zeroes padding and adds the ratio
metrics every loss shares. eps_lo / eps_hi = ``algo.clip_eps_low`` / ``algo.clip_eps_high``.

- ``"vanilla"`` (verl ``policy_loss.loss_mode=vanilla``, ``compute_policy_loss_vanilla``; TRL
  ``loss_type`` grpo/bnpo/dr_grpo/dapo with ``importance_sampling_level="token"``):
  r = exp(clamp(logp - old_logp, +-20)), l = max(-A r, -A clip(r, 1 - eps_lo, 1 + eps_hi)); with
  dual-clip (``clip_ratio_c`` = c, verl default 3, Ye et al. 2019) l = min(l, -A c) where A < 0, so
  a negative-advantage token's loss is at most c |A| however large r grows. c = None: no dual-clip
  (TRL has none).
- ``"gspo"`` (verl ``compute_policy_loss_gspo``; TRL ``importance_sampling_level="sequence"``):
  the sequence ratio s = exp(mean_t (logp - old_logp)) over the row's valid tokens, written per
  token as log s_t = sg[log s] + logp_t - sg[logp_t] (verl; value s, d s_t / d logp_t = s), clamped
  at log s_t <= 10 (verl), then the vanilla clip on s (no dual-clip). TRL's exp(mean) without the
  straight-through has the same value and, under every ``loss_agg`` here, the same gradient.
- ``"cispo"`` (verl ``compute_policy_loss_cispo``): l = -sg[clip(r, 1 - eps_lo, 1 + eps_hi)] A logp:
  a REINFORCE term whose weight is the clipped, detached ratio; every token keeps a gradient.
  TRL ``loss_type="cispo"`` (clamp(r, max=eps_TRL), no lower bound) = clip_eps_low=1,
  clip_eps_high=eps_TRL - 1.
"""
from __future__ import annotations

from typing import Callable

import torch

LOG_RATIO_CLAMP = 20.0
GSPO_LOG_RATIO_MAX = 10.0

POLICY_LOSSES: dict[str, Callable] = {}


def register_policy_loss(name: str):
    def deco(fn):
        POLICY_LOSSES[name] = fn
        return fn
    return deco


def _frac(x: torch.Tensor, valid: torch.Tensor) -> float:
    n = int(valid.sum())
    return float((x & valid).sum()) / n if n else 0.0


def _clip_metrics(ratio, adv, valid, eps_lo, eps_hi) -> dict[str, float]:
    """Tokens whose clip is active (the clipped term is the larger loss: no gradient)."""
    r, a = ratio.detach(), adv.expand_as(ratio)
    low = (a < 0) & (r < 1.0 - eps_lo)
    high = (a > 0) & (r > 1.0 + eps_hi)
    return {"policy/clip_frac_low": _frac(low, valid), "policy/clip_frac_high": _frac(high, valid),
            "policy/clip_frac": _frac(low | high, valid)}


def _clipped_surrogate(ratio, adv, eps_lo, eps_hi):
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - eps_lo, 1.0 + eps_hi))


@register_policy_loss("vanilla")
def vanilla_loss(logp, old_logp, adv, valid, eps_lo, eps_hi, clip_ratio_c=None):
    log_ratio = torch.where(valid, logp - old_logp, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)                                       # [B, T]
    loss = _clipped_surrogate(ratio, adv, eps_lo, eps_hi)              # [B, T]
    metrics = _clip_metrics(ratio, adv, valid, eps_lo, eps_hi)
    dual = torch.zeros_like(valid)
    if clip_ratio_c is not None:
        bound = -adv * clip_ratio_c                                    # [B, 1], > 0 where A < 0
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    metrics["policy/dual_clip_frac"] = _frac(dual, valid)             # verl pg_clipfrac_lower
    return loss, metrics


@register_policy_loss("gspo")
def gspo_loss(logp, old_logp, adv, valid, eps_lo, eps_hi, clip_ratio_c=None):
    lp = torch.where(valid, logp, 0.0)
    log_ratio = torch.where(valid, logp - old_logp, 0.0)
    n_tok = valid.sum(dim=1, keepdim=True).clamp(min=1)               # [B, 1]
    log_seq = (log_ratio.sum(dim=1, keepdim=True) / n_tok).detach()   # [B, 1] sg[log s]
    log_s = (lp - lp.detach() + log_seq).clamp(max=GSPO_LOG_RATIO_MAX)  # [B, T], value log s
    ratio = torch.exp(log_s)
    loss = _clipped_surrogate(ratio, adv, eps_lo, eps_hi)
    metrics = _clip_metrics(ratio, adv, valid, eps_lo, eps_hi)
    metrics["policy/seq_ratio_mean"] = float(torch.exp(log_seq)[valid.any(dim=1)].mean()) if valid.any() else 0.0
    return loss, metrics


@register_policy_loss("cispo")
def cispo_loss(logp, old_logp, adv, valid, eps_lo, eps_hi, clip_ratio_c=None):
    lp = torch.where(valid, logp, 0.0)
    log_ratio = torch.where(valid, logp - old_logp, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio).detach()
    weight = ratio.clamp(1.0 - eps_lo, 1.0 + eps_hi)                  # detached: gradient only via logp
    loss = -weight * adv * lp
    low, high = ratio < 1.0 - eps_lo, ratio > 1.0 + eps_hi
    return loss, {"policy/clip_frac_low": _frac(low, valid), "policy/clip_frac_high": _frac(high, valid),
                  "policy/clip_frac": _frac(low | high, valid)}
