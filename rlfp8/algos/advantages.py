"""Outcome advantages for group-sampled RL (GRPO, Dr.GRPO, RLOO).

Layout: the B = num_prompts * group_size rewards are group-contiguous, i.e. rewards[g*n:(g+1)*n]
are the n samples of prompt g (what ``engine.generate(prompts, n=n)`` returns, flattened).

Estimators (n = group_size, r_i one sample's scalar reward, mu_g / sigma_g over its group):

- ``"grpo"``:   A_i = (r_i - mu_g) / (sigma_g + eps), sigma_g = ``torch.std`` (Bessel, n-1).
  Matches verl ``compute_grpo_outcome_advantage`` (epsilon 1e-6 default); TRL uses the same form
  with eps 1e-4, OpenRLHF ``group_norm`` with eps 1e-9 -> pass ``std_eps`` to reproduce them.
  A group whose rewards are all equal gets A = 0 (sigma = 0, numerator 0).
- ``"drgrpo"``: A_i = r_i - mu_g (Dr.GRPO; verl ``norm_adv_by_std_in_grpo=False``, OpenRLHF
  ``dr_grpo`` / ``reinforce_baseline``, nanochat).
- ``"rloo"``:   A_i = r_i - mean_{j != i} r_j = (r_i - mu_g) * n / (n - 1). Matches verl
  ``compute_rloo_outcome_advantage`` and OpenRLHF ``rloo``.

``scale_rewards`` (TRL's key; grpo only) picks sigma: ``"group"`` (default) sigma_g as above,
``"batch"`` the Bessel std of all B rewards of the step (TRL ``scale_rewards="batch"``:
A_i = (r_i - mu_g) / (std(r_1..r_B) + eps)), ``"none"`` no division (TRL ``"none"``, = drgrpo).

Singleton groups (n = 1) follow verl: mu = 0 and sigma = 1, so grpo gives r / (1 + eps), drgrpo
gives r, and rloo (no other member to leave out) gives r.
"""
from __future__ import annotations

import torch

ESTIMATORS = ("grpo", "drgrpo", "rloo")
SCALE_REWARDS = ("group", "batch", "none")


def compute_advantages(
    rewards: torch.Tensor,      # [B] float, group-contiguous, B = num_prompts * group_size
    group_size: int,
    estimator: str = "grpo",
    std_eps: float = 1e-6,
    scale_rewards: str = "group",
) -> torch.Tensor:              # [B], same dtype as rewards (float32 if rewards are not float)
    """Per-sample advantages from per-sample scalar rewards; see the module docstring for formulas.

    Raises ValueError for a non-1-D ``rewards``, ``group_size`` < 1 or not dividing B, an unknown
    ``estimator`` or ``scale_rewards`` (not "group" with an estimator other than grpo) or a
    negative ``std_eps``. The result is detached (rewards carry no gradient).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"compute_advantages: estimator={estimator!r}; allowed values are {ESTIMATORS}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"compute_advantages: scale_rewards={scale_rewards!r}; allowed values are {SCALE_REWARDS}")
    if scale_rewards != "group" and estimator != "grpo":
        raise ValueError(f"compute_advantages: scale_rewards={scale_rewards!r} applies to estimator='grpo' only, "
                         f"got estimator={estimator!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"compute_advantages: group_size must be an int >= 1, got {group_size!r}")
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"compute_advantages: rewards must be a 1-D tensor [B], got {shape}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"compute_advantages: rewards has B={rewards.numel()} entries, not a multiple of "
            f"group_size={group_size} (rewards must be group-contiguous, B = num_prompts * group_size)"
        )
    if not (std_eps >= 0.0):
        raise ValueError(f"compute_advantages: std_eps must be >= 0, got {std_eps!r}")

    r = rewards.detach()
    if not r.is_floating_point():
        r = r.to(torch.float32)
    n = group_size
    grouped = r.reshape(-1, n)                                   # [P, n]
    if n == 1:                                                   # verl: mu = 0, sigma = 1
        centred, group_std = grouped, torch.ones_like(grouped)
    else:
        centred = grouped - grouped.mean(dim=1, keepdim=True)    # [P, n]
        group_std = grouped.std(dim=1, keepdim=True, correction=1)   # [P, 1], Bessel as torch.std
    if estimator == "grpo":
        if scale_rewards == "none":
            return centred.reshape(-1).clone()
        std = group_std if scale_rewards == "group" else (r.std(correction=1) if r.numel() > 1 else r.new_zeros(()))
        adv = centred / (std + std_eps)
    elif estimator == "drgrpo" or n == 1:                        # rloo singleton: nothing to leave out
        adv = centred
    else:  # rloo: r_i - (sum_g - r_i)/(n-1) = (r_i - mu) * n/(n-1)
        adv = centred * (n / (n - 1))
    return adv.reshape(-1)                                       # [B]
