"""RL algorithms in pure torch: advantages, policy loss + aggregation, KL penalty, importance
corrections and engine-trainer mismatch metrics. No vLLM / Ray imports (DESIGN.md layout)."""
from .advantages import ESTIMATORS, compute_advantages
from .correction import CORRECTION_MODES, importance_weights
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

__all__ = [
    "AGG_MODES",
    "CORRECTION_MODES",
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "MISMATCH_KEYS",
    "aggregate",
    "aggregation_denominator",
    "compute_advantages",
    "importance_weights",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "mismatch_metrics",
    "policy_loss_terms",
]
