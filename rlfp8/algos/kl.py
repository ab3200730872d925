"""Per-token KL-to-reference penalty estimators (verl ``kl_penalty_forward`` conventions).

With d = logp - ref_logp on the sampled token (samples from pi_theta), each estimates
KL(pi_theta || pi_ref) (Schulman, "Approximating KL divergence"):

- ``"k1"`` (verl ``kl``/``k1``):           d                              unbiased, high variance, signed
- ``"k2"`` (verl ``mse``/``k2``):          0.5 * d^2                      biased, >= 0
- ``"k3"`` (verl ``low_var_kl``/``k3``):   exp(x) - x - 1,  x = ref_logp - logp = -d
  with verl's clamps: x clamped to [-20, 20] before exp, the result clamped to [-10, 10].
  Unbiased before the clamps, >= 0, low variance; TRL / torchtune / Liger / NeMo-RL use the same.
- ``"k1+"`` / ``"k3+"`` (verl ``kl_loss_type=k1+`` / ``k3+``): the k1 / k3 value with the k2
  gradient by straight-through, k2 - sg[k2] + sg[k], since k2's expected gradient is the KL's
  gradient and k1's / k3's are not (verl PR #2953).

TRL's ``use_bias_correction_kl`` (the estimate times the policy ratio pi_theta / pi_old, not
detached) is applied by ``rlfp8.algos.objective``, which knows the ratio.

The reference policy in rlfp8 is the same model with the adapter disabled; the penalty is added
to the policy loss per token (``beta * kl``) and aggregated like it (``losses.aggregate``).
"""
from __future__ import annotations

import torch

from .losses import _check_bt

KL_ESTIMATORS = ("k1", "k2", "k3", "k1+", "k3+")
_ALIASES = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3", "k1+": "k1+",
            "k3+": "k3+", "low_var_kl+": "k3+"}

K3_INPUT_CLAMP = 20.0
K3_OUTPUT_CLAMP = 10.0


def kl_penalty(
    logp: torch.Tensor,       # [B, T] log pi_theta(sampled token)
    ref_logp: torch.Tensor,   # [B, T] log pi_ref(sampled token)
    estimator: str = "k3",
) -> torch.Tensor:            # [B, T] per-token KL estimate (mask it with losses.aggregate)
    """Per-token KL estimate; ``estimator`` in ``KL_ESTIMATORS`` or verl's names
    ("kl", "mse", "low_var_kl", "low_var_kl+"). ``ref_logp`` is treated as a constant (detached)."""
    if estimator not in _ALIASES:
        raise ValueError(
            f"kl_penalty: estimator={estimator!r}; allowed values are {KL_ESTIMATORS} "
            f"(or verl's aliases 'kl', 'mse', 'low_var_kl', 'low_var_kl+')"
        )
    _check_bt("kl_penalty", logp=logp, ref_logp=ref_logp)
    est = _ALIASES[estimator]
    ref = ref_logp.detach()
    if est.endswith("+"):
        value = kl_penalty(logp, ref, est[:-1]).detach()
        k2 = 0.5 * (logp - ref).square()
        return k2 - k2.detach() + value
    if est == "k1":
        return logp - ref
    if est == "k2":
        return 0.5 * (logp - ref).square()
    x = (ref - logp).clamp(-K3_INPUT_CLAMP, K3_INPUT_CLAMP)           # [B, T]
    return (torch.exp(x) - x - 1.0).clamp(-K3_OUTPUT_CLAMP, K3_OUTPUT_CLAMP)
