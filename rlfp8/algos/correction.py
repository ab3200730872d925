"""Importance corrections for the engine-trainer mismatch (off-policy rollouts).

The rollout engine samples from pi_rollout (its own numerics: FP8 activations, other kernels), the
trainer computes pi_old on the same tokens. With the per-token log ratio

    log rho_t = old_logp_t - rollout_logp_t     (rho = pi_old / pi_rollout)

the weights w [B, T] multiply the PPO per-token loss (``losses.policy_loss_terms(is_weights=w)``,
verl's placement). Modes (C = ``cap``, L = ``low``):

- ``"none"``:      w = 1.
- ``"tis"``:       w_t = min(rho_t, C)  (token-level truncated IS; FlashRL "TIS-2", verl
  ``rollout_is=token``, SkyRL ``token_tis_ratio_clip_high``, slime ``--tis-clip``). With ``low``
  given also w_t >= L (TRL / OpenRLHF ``clamp(rho, low, high)``).
- ``"seq_tis"``:   w_t = min(exp(sum_t' log rho_t'), C), the same value on every token of the
  sequence (verl ``rollout_is=sequence``, SkyRL sequence TIS, TRL ``sequence_truncate``); ``low``
  as for tis.
- ``"token_mask"``: w_t = 1[L <= rho_t <= C], L defaults to 1/C (icepop, OpenRLHF; TRL
  ``token_mask``; prime-rl's token mask).
- ``"seq_mask"``:  w_t = 1[L <= exp(mean_t' log rho_t') <= C] for the whole sequence: the
  geometric-mean ratio (OpenRLHF seq-mask, SkyRL geo mask, verl RS ``seq_mean_k1``); L defaults
  to 1/C.

Log ratios (and, for seq modes, their per-sequence sum / mean) are clamped to +-20 before exp
(verl's SAFETY_BOUND). Sums and means run over masked tokens only. Positions outside ``mask``
get weight 1 (neutral) in every mode; the loss masks them anyway. Weights are float32 and carry
no gradient.
"""
from __future__ import annotations

import torch

from .losses import LOG_RATIO_CLAMP, _bool_mask, _check_bt

CORRECTION_MODES = ("none", "tis", "seq_tis", "token_mask", "seq_mask")


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
    if mode not in CORRECTION_MODES:
        raise ValueError(f"{fn}: mode={mode!r}; allowed values are {CORRECTION_MODES}")
    _check_bt(fn, old_logp=old_logp, rollout_logp=rollout_logp, mask=mask)
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise ValueError(f"{fn}: cap must be a number > 0, got {cap!r}")
    if low is not None and (isinstance(low, bool) or not isinstance(low, (int, float)) or not 0 <= low <= cap):
        raise ValueError(f"{fn}: low must be None or a number in [0, cap={cap}], got {low!r}")

    valid = _bool_mask(mask)                                                  # [B, T] bool
    fvalid = valid.to(torch.float32)
    with torch.no_grad():
        d = old_logp.detach().to(torch.float32) - rollout_logp.detach().to(torch.float32)
        log_rho = torch.where(valid, d, 0.0)                                  # [B, T], 0 on padding
        ones = torch.ones_like(log_rho)
        n_tok = fvalid.sum()
        has_tok = valid.any(dim=1)                                            # [B]
        n_seq = has_tok.sum().to(torch.float32)
        clipped = torch.zeros_like(valid)                                     # [B, T] bool
        masked_out = torch.zeros_like(valid)
        seq_clipped = torch.zeros_like(has_tok)                               # [B] bool
        seq_masked = torch.zeros_like(has_tok)

        if mode == "none":
            w = ones
        elif mode == "tis":
            rho = torch.exp(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, T]
            w = rho.clamp(max=cap)
            clipped = rho > cap
            if low is not None:
                w = w.clamp(min=low)
                clipped = clipped | (rho < low)
        elif mode == "seq_tis":
            log_seq = log_rho.sum(dim=1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B]
            rho_seq = torch.exp(log_seq)                                      # [B]
            w_seq = rho_seq.clamp(max=cap)
            seq_clipped = rho_seq > cap
            if low is not None:
                w_seq = w_seq.clamp(min=low)
                seq_clipped = seq_clipped | (rho_seq < low)
            w = w_seq[:, None].expand_as(log_rho)                             # [B, T]
            clipped = seq_clipped[:, None].expand_as(valid)
        else:
            lo = (1.0 / cap) if low is None else low
            if mode == "token_mask":
                rho = torch.exp(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, T]
                keep = (rho >= lo) & (rho <= cap)                            # [B, T]
            else:  # seq_mask: geometric-mean ratio per sequence
                mean_log = log_rho.sum(dim=1) / fvalid.sum(dim=1).clamp(min=1.0)   # [B]
                geo = torch.exp(mean_log.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B]
                keep_seq = (geo >= lo) & (geo <= cap)                        # [B]
                seq_masked = ~keep_seq
                keep = keep_seq[:, None].expand_as(valid)                     # [B, T]
            w = keep.to(torch.float32)
            masked_out = ~keep

        w = torch.where(valid, w, ones).contiguous()                          # [B, T], 1 on padding
        inv_tok = 1.0 / n_tok.clamp(min=1.0)
        inv_seq = 1.0 / n_seq.clamp(min=1.0)
        metrics = {
            "correction/weight_mean": float((w * fvalid).sum() * inv_tok) if n_tok > 0 else 0.0,
            "correction/clip_frac": float((clipped & valid).sum() * inv_tok),
            "correction/mask_frac": float((masked_out & valid).sum() * inv_tok),
            "correction/seq_clip_frac": float((seq_clipped & has_tok).sum() * inv_seq),
            "correction/seq_mask_frac": float((seq_masked & has_tok).sum() * inv_seq),
        }
    return w, metrics
