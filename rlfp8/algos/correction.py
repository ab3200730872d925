"""Importance corrections for the engine-trainer mismatch (off-policy rollouts).

The rollout engine samples from pi_rollout (its own numerics: FP8 activations, other kernels), the
trainer computes pi_old on the same tokens. With the per-token log ratio

    log rho_t = old_logp_t - rollout_logp_t     (rho = pi_old / pi_rollout)

the weights w [B, T] multiply the policy loss per token (``losses.policy_loss_terms(is_weights=w)``,
verl's and TRL's placement). Modes (C = ``cap`` = ``algo.tis_cap``, L = ``low`` = ``algo.tis_low``),
each one function registered in ``CORRECTIONS``:

- ``"none"``:          w = 1.
- ``"tis"``:           w_t = clamp(rho_t, L, C) (L = None: min(rho_t, C)). verl
  ``rollout_is=token, rollout_is_threshold=C``; TRL ``vllm_importance_sampling_mode=token_truncate``
  (clip_min=L, clip_max=C); FlashRL "TIS-C"; SkyRL ``token_tis_ratio_clip_high``; slime ``--tis-clip``.
- ``"seq_tis"``:       w_t = clamp(prod_t' rho_t', L, C) = clamp(exp(sum_t' log rho_t'), L, C) on every
  token of the row. verl ``rollout_is=sequence``; TRL ``sequence_truncate``; SkyRL sequence TIS.
- ``"token_mask"``:    w_t = rho_t * 1[L <= rho_t <= C], L = None: 1/C. TRL ``token_mask``
  (clip_min=L, clip_max=C); OpenRLHF ``icepop``; verl's IcePop = ``rollout_is=token`` (threshold
  >= C, so no truncation inside the band) + ``rollout_rs=token_k1`` whose bounds are on 1/rho
  (``rlfp8.algos.rejection``): verl's threshold "a_b" keeps 1/b <= rho <= 1/a, i.e. this mode with
  low=1/b, cap=1/a (the same band when a = 1/b), plus ``drop_rejected_from_denominator=true``.
- ``"sequence_mask"``: w_t = rho_seq * 1[L <= rho_seq <= C], rho_seq = exp(sum_t' log rho_t'), L = None:
  1/C. TRL ``sequence_mask`` (its default mode); the product ratio keeps its value.
- ``"seq_geo_mask"``:  w_t = 1[L <= exp(mean_t' log rho_t') <= C] (0/1), the geometric-mean ratio,
  L = None: 1/C. SkyRL geo mask; verl ``rollout_rs=seq_mean_k1`` with ``rollout_is=null`` ("a_b"
  there bounds the geometric mean of 1/rho: low=1/b, cap=1/a here). rlfp8's ``seq_mask`` before
  issue 20.

Log ratios (and, for seq modes, their per-sequence sum / mean) are clamped to +-20 before exp
(verl's SAFETY_BOUND; TRL does not clamp: equal wherever |log rho| < 20). Sums and means run over
masked tokens only. Positions outside ``mask`` get weight 1 (neutral); the loss masks them anyway.
A masked-out token is one with w = 0 (rho > 0 otherwise). Weights are float32 and carry no
gradient. ``batch_normalised`` divides them by their mean over a batch (verl
``rollout_is_batch_normalize``): token modes by the mean over tokens, sequence modes by the mean
over sequences of the row weight.
"""
from __future__ import annotations

from typing import Callable

import torch

from .losses import LOG_RATIO_CLAMP, _bool_mask, _check_bt

CORRECTIONS: dict[str, Callable] = {}
SEQUENCE_LEVEL = ("seq_tis", "sequence_mask", "seq_geo_mask")    # one weight per row
RENAMED = {"seq_mask": "'seq_mask' was split in two: 'seq_geo_mask' (its old meaning: geometric-mean ratio, "
                       "0/1 weights) and 'sequence_mask' (TRL's: product ratio, weight rho_seq)"}
BATCH_NORM_EPS = 1e-8          # verl: a batch mean <= 1e-8 leaves the weights unnormalised


def register_correction(name: str):
    def deco(fn):
        CORRECTIONS[name] = fn
        return fn
    return deco


def _exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _truncate(rho, cap, low):
    w = rho.clamp(max=cap) if low is None else rho.clamp(low, cap)
    return w, (rho > cap) | ((rho < low) if low is not None else torch.zeros_like(rho, dtype=torch.bool))


def _band(x, cap, low):
    return (x >= ((1.0 / cap) if low is None else low)) & (x <= cap)


# Each mode: (log_rho [B, T] 0 on padding, valid [B, T] bool, cap, low) ->
#   (w [B, T], token flags: truncated [B, T], masked [B, T]; row flags: truncated [B], masked [B])
@register_correction("none")
def _none(log_rho, valid, cap, low):
    no = torch.zeros_like(valid)
    return torch.ones_like(log_rho), no, no, no[:, 0], no[:, 0]


@register_correction("tis")
def _tis(log_rho, valid, cap, low):
    w, clipped = _truncate(_exp(log_rho), cap, low)
    no = torch.zeros_like(valid)
    return w, clipped, no, no[:, 0], no[:, 0]


@register_correction("seq_tis")
def _seq_tis(log_rho, valid, cap, low):
    w_seq, seq_clipped = _truncate(_exp(log_rho.sum(dim=1)), cap, low)            # [B]
    no = torch.zeros_like(valid)
    return (w_seq[:, None].expand_as(log_rho), seq_clipped[:, None].expand_as(valid), no, seq_clipped,
            no[:, 0])


@register_correction("token_mask")
def _token_mask(log_rho, valid, cap, low):
    rho = _exp(log_rho)
    keep = _band(rho, cap, low)
    no = torch.zeros_like(valid)
    return torch.where(keep, rho, 0.0), no, ~keep, no[:, 0], no[:, 0]


def _row_mask(row_ratio, row_weight, valid, cap, low):
    keep = _band(row_ratio, cap, low)                                             # [B]
    no = torch.zeros_like(valid)
    w = torch.where(keep, row_weight, 0.0)[:, None].expand(valid.shape)
    return w, no, (~keep)[:, None].expand_as(valid), no[:, 0], ~keep


@register_correction("sequence_mask")
def _sequence_mask(log_rho, valid, cap, low):
    rho_seq = _exp(log_rho.sum(dim=1))                                            # [B]
    return _row_mask(rho_seq, rho_seq, valid, cap, low)


@register_correction("seq_geo_mask")
def _seq_geo_mask(log_rho, valid, cap, low):
    geo = _exp(log_rho.sum(dim=1) / valid.sum(dim=1).clamp(min=1))               # [B]
    return _row_mask(geo, torch.ones_like(geo), valid, cap, low)


def check_mode(fn: str, mode: str) -> None:
    if mode in RENAMED:
        raise ValueError(f"{fn}: mode={mode!r}: {RENAMED[mode]}")
    if mode not in CORRECTIONS:
        raise ValueError(f"{fn}: mode={mode!r}; allowed values are {tuple(CORRECTIONS)}")


def importance_weights(
    old_logp: torch.Tensor,       # [B, T] trainer's log pi_old(sampled token)
    rollout_logp: torch.Tensor,   # [B, T] engine's log pi_rollout(sampled token)
    mask: torch.Tensor,           # [B, T] bool or 0/1 float
    mode: str,
    cap: float = 2.0,
    low: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights [B, T] (float32, detached) and metrics (python floats).

    Metrics (every key in every mode, 0.0 where it does not apply or the mask is empty):
    ``correction/weight_mean`` (mean weight over masked tokens), ``correction/clip_frac``
    (fraction of masked tokens whose weight was truncated at ``cap`` or raised to ``low``),
    ``correction/mask_frac`` (fraction of masked tokens given weight 0 by a mask mode),
    ``correction/seq_clip_frac`` / ``correction/seq_mask_frac`` (fraction of sequences with >= 1
    token whose sequence weight was truncated / which were masked out; seq modes only).
    """
    fn = "importance_weights"
    check_mode(fn, mode)
    _check_bt(fn, old_logp=old_logp, rollout_logp=rollout_logp, mask=mask)
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise ValueError(f"{fn}: cap must be a number > 0, got {cap!r}")
    if low is not None and (isinstance(low, bool) or not isinstance(low, (int, float)) or not 0 <= low <= cap):
        raise ValueError(f"{fn}: low must be None or a number in [0, cap={cap}], got {low!r}")

    valid = _bool_mask(mask)                                                  # [B, T] bool
    with torch.no_grad():
        d = old_logp.detach().to(torch.float32) - rollout_logp.detach().to(torch.float32)
        log_rho = torch.where(valid, d, 0.0)                                  # [B, T], 0 on padding
        w, clipped, masked_out, seq_clipped, seq_masked = CORRECTIONS[mode](log_rho, valid, cap, low)
        w = torch.where(valid, w, 1.0).contiguous()                           # [B, T], 1 on padding
        has_tok = valid.any(dim=1)                                            # [B]
        n_tok, n_seq = valid.sum().clamp(min=1), has_tok.sum().clamp(min=1)
        metrics = {
            "correction/weight_mean": float(torch.where(valid, w, 0.0).sum() / n_tok),
            "correction/clip_frac": float((clipped & valid).sum() / n_tok),
            "correction/mask_frac": float((masked_out & valid).sum() / n_tok),
            "correction/seq_clip_frac": float((seq_clipped & has_tok).sum() / n_seq),
            "correction/seq_mask_frac": float((seq_masked & has_tok).sum() / n_seq),
        }
    return w, metrics


def weight_sums(w: torch.Tensor, mask: torch.Tensor, mode: str) -> tuple[float, float]:
    """(sum, count) whose ratio over a batch is the mean ``batch_normalised`` divides by: over
    masked tokens for token modes, over rows with >= 1 masked token (one weight each) for
    sequence modes. Sums add over micro-batches."""
    valid = _bool_mask(mask)
    if mode in SEQUENCE_LEVEL:
        has_tok = valid.any(dim=1)
        row_w = w.gather(1, valid.to(torch.int64).argmax(dim=1, keepdim=True))[:, 0]   # first valid token
        return float(torch.where(has_tok, row_w, 0.0).sum()), float(has_tok.sum())
    return float(torch.where(valid, w, 0.0).sum()), float(valid.sum())


def batch_normalised(w: torch.Tensor, weight_sum: float, count: float) -> tuple[torch.Tensor, float]:
    """w / mean (verl ``rollout_is_batch_normalize``), mean = weight_sum / count over the batch;
    unchanged (factor 1) when the mean is <= 1e-8 or the batch is empty. Returns (w, factor)."""
    mean = weight_sum / count if count > 0 else 0.0
    if mean <= BATCH_NORM_EPS:
        return w, 1.0
    return w / mean, mean
