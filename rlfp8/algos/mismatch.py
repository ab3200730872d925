"""Engine-trainer mismatch metrics, logged every step under ``mismatch/`` (DESIGN.md "Mismatch").

Inputs are the sampled tokens' log-probs under the engine (the distribution actually sampled from)
and under the trainer (same tokens, same temperature). With r = p_tr / p_eng = exp(lt - le):

- ``mismatch/kl_k1``:  mean(le - lt)             k1 estimate of KL(pi_eng || pi_tr) (samples from
  the engine); verl ``rollout_corr/kl`` = mean(log pi_rollout - log pi_old).
- ``mismatch/kl_k3``:  mean(r - 1 - log r)       k3 estimate of the same KL (>= 0, low variance);
  verl ``rollout_corr/k3_kl``, prime-rl ``mismatch_kl``.
- ``mismatch/abs_logp_diff_mean`` / ``_max``:  |lt - le|.
- ``mismatch/probs_diff_mean``:  mean |exp(lt) - exp(le)| on probabilities (verl
  ``rollout_probs_diff``).
- ``mismatch/is_ratio_mean`` / ``_max``:  r.
- ``mismatch/tis_clip_frac``:  fraction of tokens with r > tis_cap (what token TIS would truncate).

Means and maxima run over masked tokens only, in float64; log r is clamped to +-20 where it is
exponentiated (r, k3), as the correction does; an empty mask gives 0.0 everywhere (never NaN).
"""
from __future__ import annotations

import torch

from .losses import LOG_RATIO_CLAMP, _bool_mask, _check_bt

MISMATCH_KEYS = (
    "mismatch/kl_k1",
    "mismatch/kl_k3",
    "mismatch/abs_logp_diff_mean",
    "mismatch/abs_logp_diff_max",
    "mismatch/probs_diff_mean",
    "mismatch/is_ratio_mean",
    "mismatch/is_ratio_max",
    "mismatch/tis_clip_frac",
)


def mismatch_metrics(
    engine_logp: torch.Tensor,    # [B, T] log p_eng(sampled token)
    trainer_logp: torch.Tensor,   # [B, T] log p_tr(sampled token)
    mask: torch.Tensor,           # [B, T] bool or 0/1 float
    tis_cap: float = 2.0,
) -> dict[str, float]:
    """The eight ``mismatch/*`` metrics of the module docstring (exactly ``MISMATCH_KEYS``)."""
    fn = "mismatch_metrics"
    _check_bt(fn, engine_logp=engine_logp, trainer_logp=trainer_logp, mask=mask)
    if isinstance(tis_cap, bool) or not isinstance(tis_cap, (int, float)) or not tis_cap > 0:
        raise ValueError(f"{fn}: tis_cap must be a number > 0, got {tis_cap!r}")
    valid = _bool_mask(mask)
    if not bool(valid.any()):
        return {k: 0.0 for k in MISMATCH_KEYS}
    with torch.no_grad():
        le = engine_logp.detach().to(torch.float64)[valid]                  # [N]
        lt = trainer_logp.detach().to(torch.float64)[valid]                 # [N]
        log_r = lt - le                                                     # [N]
        log_r_c = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        r = torch.exp(log_r_c)                                              # [N]
        absd = log_r.abs()
        return {
            "mismatch/kl_k1": float((le - lt).mean()),
            "mismatch/kl_k3": float((r - 1.0 - log_r_c).mean()),
            "mismatch/abs_logp_diff_mean": float(absd.mean()),
            "mismatch/abs_logp_diff_max": float(absd.max()),
            "mismatch/probs_diff_mean": float((torch.exp(lt) - torch.exp(le)).abs().mean()),
            "mismatch/is_ratio_mean": float(r.mean()),
            "mismatch/is_ratio_max": float(r.max()),
            "mismatch/tis_clip_frac": float((r > tis_cap).to(torch.float64).mean()),
        }
