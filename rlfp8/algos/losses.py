"""PPO-clip policy loss (with clip-higher and importance weights) and loss aggregation.

Shapes: B sequences (rows) of T response positions; ``mask`` [B, T] (bool or 0/1 float) marks the
sampled response tokens that count. Padding positions may hold anything finite or not: every
function here selects with ``torch.where`` so padding never leaks NaN into values or gradients.

Per-token loss (``policy_loss_terms``), with rho_t = exp(logp_t - old_logp_t) and A the sequence's
advantage:

    l_t = -min(rho_t * A, clip(rho_t, 1 - eps_low, 1 + eps_high) * A) * w_t

where w_t are the detached importance weights (TIS / masks from ``rlfp8.algos.correction``)
multiplying the clipped surrogate, the placement of verl (``pg_losses * rollout_is_weights``),
FlashRL, SkyRL, slime and NeMo-RL. eps_high > eps_low is DAPO's clip-higher. The log-ratio is clamped
to +-20 before exp, as verl does.

Aggregation (``aggregate`` + ``aggregation_denominator``), for a mini-batch (one optimizer step)
split into micro-batches (gradient accumulation):

- ``"token-mean"``:               sum_{b,t} m l / N_tok(mini-batch)
  (verl default ``token-mean``; TRL ``dapo``; OpenRLHF; nanochat).
- ``"seq-mean-token-mean"``:      sum_b [sum_t m l / N_tok(b)] / N_seq(mini-batch)
  (original GRPO; verl ``seq-mean-token-mean``; TRL ``grpo``). N_seq counts rows with >= 1 token.
- ``"seq-mean-token-sum-norm"``:  sum_{b,t} m l / (B(mini-batch) * max_response_len)
  (Dr.GRPO; verl ``seq-mean-token-sum-norm``; TRL ``dr_grpo``). B counts all rows: a constant.

Gradient-accumulation invariance: the denominator is computed ONCE from the mask of the whole
mini-batch (``aggregation_denominator``) and every micro-batch's numerator is a plain sum over its
own rows, so

    sum_k aggregate(l[k], mask[k], mode, denom) == aggregate(l, mask, mode, denom)

for any split of the mini-batch's rows into micro-batches: call ``backward()`` on each
micro-batch's ``aggregate`` with no extra re-weighting and the accumulated gradient is the
mini-batch gradient. (A per-micro-batch mean would weight a short micro-batch's tokens more.)
"""
from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")

LOG_RATIO_CLAMP = 20.0


# --------------------------------------------------------------------------------------------
# helpers shared by the algos modules
# --------------------------------------------------------------------------------------------
def _check_bt(fn: str, **tensors: torch.Tensor | None) -> tuple[int, int]:
    """All given tensors must be 2-D [B, T] with one common shape; returns (B, T)."""
    shape = None
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{fn}: {name} must be a torch.Tensor [B, T], got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{fn}: {name} must be 2-D [B, T], got shape {tuple(t.shape)}")
        if shape is None:
            shape = (name, tuple(t.shape))
        elif tuple(t.shape) != shape[1]:
            raise ValueError(
                f"{fn}: {name} has shape {tuple(t.shape)} but {shape[0]} has shape {shape[1]}; "
                "all [B, T] inputs must have the same shape"
            )
    assert shape is not None
    return shape[1]


def _bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: True where the token counts (a float mask counts where > 0)."""
    return mask if mask.dtype == torch.bool else mask > 0


def _float_mask(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return mask.to(dtype)


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum of x over mask (x [B, T], mask [B, T] bool or float weights) -> scalar; NaN-safe on padding."""
    m = _float_mask(mask, x.dtype if x.is_floating_point() else torch.float32)
    return torch.where(_bool_mask(mask), x * m, torch.zeros_like(x, dtype=m.dtype)).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """masked_sum / sum(mask); 0 (not NaN) when the mask is empty -> scalar."""
    n = _float_mask(mask).sum()
    return masked_sum(x, mask) / n.clamp(min=1.0)


def _f(x: torch.Tensor) -> float:
    return float(x.detach().item())


# --------------------------------------------------------------------------------------------
# policy loss
# --------------------------------------------------------------------------------------------
def policy_loss_terms(
    logp: torch.Tensor,          # [B, T] log pi_theta(sampled token), requires grad
    old_logp: torch.Tensor,      # [B, T] log pi_old (behaviour policy as recomputed by the trainer)
    advantages: torch.Tensor,    # [B] one advantage per sequence
    mask: torch.Tensor,          # [B, T] bool or 0/1 float
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    is_weights: torch.Tensor | None = None,  # [B, T] importance weights (detached here)
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate per token (see the module docstring for the formula).

    Returns ``(per_token_loss [B, T], metrics)``; per_token_loss is 0 outside ``mask`` (both value
    and gradient). Metrics, python floats over masked tokens (0.0 for an empty mask):

    - ``policy/clip_frac_low``:  A < 0 and rho < 1 - eps_low (the clip is active, no gradient);
    - ``policy/clip_frac_high``: A > 0 and rho > 1 + eps_high;
    - ``policy/clip_frac``: their sum (verl ``pg_clipfrac``: the clipped term is the larger loss);
    - ``policy/ratio_mean``, ``policy/ratio_max``: rho;
    - ``policy/approx_kl``: mean(old_logp - logp), the k1 estimate of KL(pi_old || pi_theta)
      (verl ``ppo_kl``); ``policy/approx_kl_k3``: mean(rho - 1 - log rho), the same KL by k3.
    """
    fn = "policy_loss_terms"
    B, _ = _check_bt(fn, logp=logp, old_logp=old_logp, mask=mask, is_weights=is_weights)
    if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) != (B,):
        shape = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
        raise ValueError(f"{fn}: advantages must be a tensor of shape [B]=({B},), got {shape}")
    if not (0.0 <= clip_eps_low < 1.0):
        raise ValueError(f"{fn}: clip_eps_low must be in [0, 1), got {clip_eps_low!r}")
    if not (clip_eps_high >= 0.0):
        raise ValueError(f"{fn}: clip_eps_high must be >= 0, got {clip_eps_high!r}")

    valid = _bool_mask(mask)                                           # [B, T] bool
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    log_ratio = torch.where(valid, logp - old_logp.detach(), zero)     # [B, T]
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)                                       # [B, T]
    adv = advantages.detach().to(logp.dtype)[:, None]                  # [B, 1]

    surr1 = -adv * ratio                                               # [B, T]
    surr2 = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = torch.maximum(surr1, surr2)                                 # [B, T] = -min(rho A, clip A)
    if is_weights is not None:
        loss = loss * is_weights.detach().to(loss.dtype)
    per_token = torch.where(valid, loss, zero)                         # [B, T]

    with torch.no_grad():
        n = valid.sum()
        inv_n = 1.0 / n.clamp(min=1).to(torch.float64)
        r = ratio.detach().to(torch.float64)
        lr = log_ratio.detach().to(torch.float64)
        a = adv.detach().to(torch.float64).expand_as(r)
        low = valid & (a < 0) & (r < 1.0 - clip_eps_low)
        high = valid & (a > 0) & (r > 1.0 + clip_eps_high)
        metrics = {
            "policy/clip_frac_low": _f(low.sum() * inv_n),
            "policy/clip_frac_high": _f(high.sum() * inv_n),
            "policy/clip_frac": _f((low | high).sum() * inv_n),
            "policy/ratio_mean": _f(torch.where(valid, r, 0.0).sum() * inv_n),
            "policy/ratio_max": _f(torch.where(valid, r, 0.0).max()) if bool(n > 0) else 0.0,
            "policy/approx_kl": _f(torch.where(valid, -lr, 0.0).sum() * inv_n),
            "policy/approx_kl_k3": _f(torch.where(valid, r - 1.0 - lr, 0.0).sum() * inv_n),
        }
    return per_token, metrics


# --------------------------------------------------------------------------------------------
# aggregation
# --------------------------------------------------------------------------------------------
def _check_mode(fn: str, mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"{fn}: mode={mode!r}; allowed values are {AGG_MODES}")


def aggregation_denominator(
    mask: torch.Tensor,                  # [B, T] mask of the WHOLE mini-batch (all micro-batches)
    mode: str,
    max_response_len: int | None = None,
) -> float:
    """The mini-batch constant that ``aggregate`` divides by (module docstring):

    - ``token-mean``: number of masked tokens of the mini-batch (at least 1);
    - ``seq-mean-token-mean``: number of rows with >= 1 masked token (at least 1);
    - ``seq-mean-token-sum-norm``: B * max_response_len (``max_response_len`` required, > 0:
      the generation limit, not the longest sample, so the normaliser is a run constant).

    For data-parallel training sum the counts over ranks before dividing (not needed colocated).
    """
    fn = "aggregation_denominator"
    _check_mode(fn, mode)
    _check_bt(fn, mask=mask)
    valid = _bool_mask(mask)
    if mode == "token-mean":
        return max(float(torch.where(valid, _float_mask(mask), 0.0).sum().item()), 1.0)
    if mode == "seq-mean-token-mean":
        return float(max(int(valid.any(dim=1).sum().item()), 1))
    if max_response_len is None or isinstance(max_response_len, bool) or not max_response_len > 0:
        raise ValueError(
            f"{fn}: mode='seq-mean-token-sum-norm' needs max_response_len > 0 (the generation "
            f"length limit), got {max_response_len!r}"
        )
    return float(mask.shape[0] * max_response_len)


def aggregate(
    per_token: torch.Tensor,   # [b, T] per-token loss of one micro-batch (or the whole mini-batch)
    mask: torch.Tensor,        # [b, T] bool or 0/1 float, the same rows
    mode: str,
    denom: float,              # aggregation_denominator(mask of the whole mini-batch, mode, ...)
) -> torch.Tensor:             # scalar
    """This micro-batch's share of the mini-batch loss; shares sum to the mini-batch loss.

    token-mean and seq-mean-token-sum-norm: sum_{b,t} m l / denom; seq-mean-token-mean:
    sum_b (sum_t m l / N_tok(b)) / denom (rows without tokens contribute 0).
    """
    fn = "aggregate"
    _check_mode(fn, mode)
    _check_bt(fn, per_token=per_token, mask=mask)
    if not (isinstance(denom, (int, float)) and not isinstance(denom, bool) and denom > 0):
        raise ValueError(f"{fn}: denom must be a number > 0 (from aggregation_denominator), got {denom!r}")
    valid = _bool_mask(mask)
    m = _float_mask(mask, per_token.dtype)
    masked = torch.where(valid, per_token * m, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if mode == "seq-mean-token-mean":
        tok_per_seq = m.sum(dim=1).clamp(min=1.0)                     # [b]
        return (masked.sum(dim=1) / tok_per_seq).sum() / denom
    return masked.sum() / denom
