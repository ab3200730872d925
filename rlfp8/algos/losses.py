"""Policy loss wrapper (importance weights, masking, shared metrics) and loss aggregation.

Shapes: B sequences (rows) of T response positions; ``mask`` [B, T] (bool or 0/1 float) marks the
sampled response tokens that count. Padding positions may hold anything finite or not: every
function here selects with ``torch.where`` so padding never leaks NaN into values or gradients.

Per-token loss (``policy_loss_terms``): l_t * w_t, with l_t one of ``rlfp8.algos.policy``'s losses
(vanilla PPO clip with optional dual-clip, GSPO, CISPO) and w_t the detached importance weights
(``rlfp8.algos.correction``) multiplying it: the placement of verl (``pg_losses *
rollout_is_weights``), TRL, FlashRL, SkyRL, slime and NeMo-RL.

Aggregation (``aggregate`` + ``aggregation_denominator``), for a mini-batch (one optimizer step)
split into micro-batches (gradient accumulation); S_b = sum_t m l of row b:

- ``"token-mean"``:               sum_b S_b / N_tok(mini-batch)
  (verl default ``token-mean``; TRL ``dapo``; OpenRLHF; nanochat).
- ``"seq-mean-token-mean"``:      sum_b [S_b / N_tok(b)] / N_seq(mini-batch)
  (original GRPO; verl ``seq-mean-token-mean``; TRL ``grpo``). N_seq counts rows with >= 1 token.
- ``"seq-mean-token-sum"``:       sum_b S_b / N_seq(mini-batch)   (verl ``seq-mean-token-sum``).
- ``"seq-mean-token-sum-norm"``:  sum_b S_b / (B(mini-batch) * max_response_len)
  (Dr.GRPO; verl ``seq-mean-token-sum-norm``; TRL ``dr_grpo``). B counts all rows: a constant.
- ``"bnpo"``:                     [sum_b S_b / N_tok(micro-batch)] / K   (TRL ``bnpo``: the token
  mean of each micro-batch, divided by the number K of micro-batches of the mini-batch).

Gradient-accumulation invariance (all modes but bnpo, which is by definition a mean of
micro-batch means): the denominator is computed ONCE from the mask of the whole mini-batch
(``aggregation_denominator``) and every micro-batch's numerator is a plain sum over its own rows,
so ``sum_k aggregate(l[k], mask[k], mode, denom) == aggregate(l, mask, mode, denom)`` for any
split of the rows: call ``backward()`` on each micro-batch's share and the accumulated gradient is
the mini-batch gradient. (A per-micro-batch mean would weight a short micro-batch's tokens more.)
"""
from __future__ import annotations

import torch

from .policy import LOG_RATIO_CLAMP, POLICY_LOSSES

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "bnpo")


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
    loss: str = "vanilla",                   # a key of POLICY_LOSSES (rlfp8.algos.policy)
    clip_ratio_c: float | None = None,       # dual-clip bound (vanilla only), > 1
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token policy loss ``l_t * w_t`` (formulas in ``rlfp8.algos.policy``), 0 outside ``mask``.

    Returns ``(per_token_loss [B, T], metrics)`` (value and gradient 0 outside ``mask``). Metrics,
    python floats over masked tokens (0.0 for an empty mask): the loss's clip fractions
    (``policy/clip_frac_low``: A < 0 and r < 1 - eps_low; ``policy/clip_frac_high``: A > 0 and
    r > 1 + eps_high; ``policy/clip_frac`` their sum, verl ``pg_clipfrac``), and for every loss
    ``policy/ratio_mean``, ``policy/ratio_max`` (token r = pi_theta / pi_old),
    ``policy/approx_kl`` = mean(old_logp - logp) (k1 of KL(pi_old || pi_theta), verl ``ppo_kl``) and
    ``policy/approx_kl_k3`` = mean(r - 1 - log r).
    """
    fn = "policy_loss_terms"
    B, _ = _check_bt(fn, logp=logp, old_logp=old_logp, mask=mask, is_weights=is_weights)
    if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) != (B,):
        shape = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
        raise ValueError(f"{fn}: advantages must be a tensor of shape [B]=({B},), got {shape}")
    if loss not in POLICY_LOSSES:
        raise ValueError(f"{fn}: loss={loss!r}; allowed values are {tuple(POLICY_LOSSES)}")
    if not (0.0 <= clip_eps_low <= 1.0):
        raise ValueError(f"{fn}: clip_eps_low must be in [0, 1], got {clip_eps_low!r}")
    if not (clip_eps_high >= 0.0):
        raise ValueError(f"{fn}: clip_eps_high must be >= 0, got {clip_eps_high!r}")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"{fn}: clip_ratio_c must be None or > 1 (verl's dual-clip bound), got {clip_ratio_c!r}")

    valid = _bool_mask(mask)                                           # [B, T] bool
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    adv = advantages.detach().to(logp.dtype)[:, None]                  # [B, 1]
    per_token, metrics = POLICY_LOSSES[loss](logp, old_logp.detach(), adv, valid, clip_eps_low, clip_eps_high,
                                             clip_ratio_c=clip_ratio_c)
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(per_token.dtype)
    per_token = torch.where(valid, per_token, zero)                    # [B, T]
    metrics.update(_ratio_metrics(logp, old_logp, valid))
    return per_token, metrics


def _ratio_metrics(logp: torch.Tensor, old_logp: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    with torch.no_grad():
        n = valid.sum()
        inv_n = 1.0 / n.clamp(min=1).to(torch.float64)
        lr = torch.where(valid, logp.detach().double() - old_logp.detach().double(), 0.0)
        lr = lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        r = torch.where(valid, torch.exp(lr), 0.0)
        return {
            "policy/ratio_mean": _f(r.sum() * inv_n),
            "policy/ratio_max": _f(r.max()) if bool(n > 0) else 0.0,
            "policy/approx_kl": _f(-lr.sum() * inv_n),
            "policy/approx_kl_k3": _f(torch.where(valid, r - 1.0 - lr, 0.0).sum() * inv_n),
        }


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
    num_micro_batches: int = 1,
) -> float:
    """The mini-batch constant that ``aggregate`` divides by (module docstring):

    - ``token-mean``: number of masked tokens of the mini-batch (at least 1);
    - ``seq-mean-token-mean`` / ``seq-mean-token-sum``: rows with >= 1 masked token (at least 1);
    - ``seq-mean-token-sum-norm``: B * max_response_len (``max_response_len`` required, > 0:
      the generation limit, not the longest sample, so the normaliser is a run constant);
    - ``bnpo``: ``num_micro_batches`` (each micro-batch's token mean is divided by it).

    For data-parallel training sum the counts over ranks before dividing (not needed colocated).
    """
    fn = "aggregation_denominator"
    _check_mode(fn, mode)
    _check_bt(fn, mask=mask)
    valid = _bool_mask(mask)
    if mode == "token-mean":
        return max(float(torch.where(valid, _float_mask(mask), 0.0).sum().item()), 1.0)
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return float(max(int(valid.any(dim=1).sum().item()), 1))
    if mode == "bnpo":
        if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int) or num_micro_batches < 1:
            raise ValueError(f"{fn}: num_micro_batches must be an int >= 1, got {num_micro_batches!r}")
        return float(num_micro_batches)
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

    seq-mean-token-mean: sum_b (sum_t m l / N_tok(b)) / denom (rows without tokens contribute 0);
    bnpo: (sum_{b,t} m l / N_tok(micro-batch)) / denom; the others: sum_{b,t} m l / denom.
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
    if mode == "bnpo":
        return masked.sum() / torch.where(valid, m, 0.0).sum().clamp(min=1.0) / denom
    return masked.sum() / denom
