"""RL algorithms in pure torch: advantages, policy losses + aggregation, KL penalty, importance
corrections, rejection, engine-trainer mismatch metrics, and ``rl_loss`` combining them from the
``algo`` config section. No vLLM / Ray imports (DESIGN.md layout).

The registries below own the allowed values of the ``algo.*`` choice keys (rlfp8.config reads them).
"""
from .advantages import ESTIMATORS, SCALE_REWARDS, compute_advantages
from .correction import CORRECTIONS, RENAMED as RENAMED_CORRECTIONS, importance_weights
from .kl import KL_ESTIMATORS, kl_penalty
from .losses import (
    AGG_MODES,
    aggregate,
    aggregation_denominator,
    masked_mean,
    masked_sum,
    policy_loss_terms,
)
from .mismatch import MISMATCH_KEYS, mismatch_metrics
from .objective import batch_stats, loss_denominator, needs_batch_stats, rl_loss, sum_stats
from .policy import POLICY_LOSSES
from .rejection import ROLLOUT_RS_OPTIONS, parse_threshold as parse_rollout_rs_threshold, rejection_mask

CORRECTION_MODES = tuple(CORRECTIONS)

__all__ = [
    "AGG_MODES",
    "CORRECTIONS",
    "CORRECTION_MODES",
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "MISMATCH_KEYS",
    "POLICY_LOSSES",
    "RENAMED_CORRECTIONS",
    "ROLLOUT_RS_OPTIONS",
    "SCALE_REWARDS",
    "aggregate",
    "aggregation_denominator",
    "batch_stats",
    "compute_advantages",
    "importance_weights",
    "kl_penalty",
    "loss_denominator",
    "masked_mean",
    "masked_sum",
    "mismatch_metrics",
    "needs_batch_stats",
    "parse_rollout_rs_threshold",
    "policy_loss_terms",
    "rejection_mask",
    "rl_loss",
    "sum_stats",
]
