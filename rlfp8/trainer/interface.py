"""What the RL loop (and later the one-copy and many-GPU work) may ask of a trainer.

The train step is split so that a gradient all-reduce fits between its halves:
    forward_backward(mini_batch)   gradients of one mini-batch, accumulated over its micro-batches
    optimizer_step()               clip + step + scheduler (data parallel: gradients summed over the pairs first)
    train_step(rollouts)           both, for trainer.mini_batches x trainer.epochs: one RL update
An adapter update travels as {"version": int, "tensors": {PEFT key: CPU tensor}, "config": PEFT
adapter_config dict} (export_adapter), the same dict the engine's set_adapter takes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class Rollouts:
    """One RL batch, sequence-major. input_ids = prompt + response token ids."""
    input_ids: list[list[int]]
    prompt_lens: list[int]
    rollout_logprobs: list[list[float]]     # per response token, under the distribution sampled from
    advantages: list[float]
    row_offset: int = 0                     # data parallel: this share's first row in the step's whole batch
    total_rows: int | None = None           # data parallel: rows of the whole batch (None: this batch is whole)

    def __post_init__(self):
        n = len(self.input_ids)
        total = n if self.total_rows is None else self.total_rows
        if self.row_offset < 0 or self.row_offset + n > total:
            raise ValueError(f"Rollouts rows [{self.row_offset}, {self.row_offset + n}) outside the whole batch's "
                             f"{total} rows (row_offset, total_rows)")
        for name in ("prompt_lens", "rollout_logprobs", "advantages"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Rollouts.{name} has {len(getattr(self, name))} rows, input_ids has {n}")
        for i, (ids, p, lp) in enumerate(zip(self.input_ids, self.prompt_lens, self.rollout_logprobs)):
            if len(ids) - p != len(lp) or len(lp) == 0:
                raise ValueError(f"Rollouts row {i}: {len(ids) - p} response tokens but {len(lp)} rollout log-probs")


@dataclass
class MiniBatch:
    """One optimizer step's rows as collated micro-batches (device tensors). A micro-batch holds
    "old_logp" when pi_old is not the current policy and "ref_logp" when a KL term is on."""
    micro_batches: list[dict[str, torch.Tensor]]
    denominator: float                      # rlfp8.algos.aggregation_denominator of the whole mini-batch
    mismatch: list | None = field(default=None)   # a list: (pi_old, engine log-probs, mask) get appended


class TrainerInterface(ABC):
    @abstractmethod
    def forward_backward(self, mini_batch: MiniBatch) -> dict[str, list[float]]:
        """Zero the gradients, then accumulate those of every micro-batch; per-micro-batch metrics."""

    @abstractmethod
    def optimizer_step(self) -> dict[str, float]:
        """Clip, step, schedule (skipped, and counted, on a non-finite gradient norm)."""

    @abstractmethod
    def train_step(self, batch: Rollouts) -> dict[str, float]:
        """One RL update of the adapter from a batch of rollouts."""

    @abstractmethod
    def export_adapter(self) -> dict:
        """The adapter update for the engine (module docstring)."""

    @abstractmethod
    def save_checkpoint(self, ckpt_dir: str) -> None: ...

    @abstractmethod
    def load_checkpoint(self, ckpt_dir: str) -> None: ...

    @abstractmethod
    def score(self, batch: Rollouts) -> list[list[float]]:
        """Trainer log-probs of each row's response tokens (no grad)."""

    @abstractmethod
    def kernel_report(self) -> dict: ...

    @abstractmethod
    def memory(self) -> dict[str, float]: ...

    @abstractmethod
    def release_cached_memory(self) -> float: ...

    @abstractmethod
    def release_base(self) -> None:
        """Before the engine runs: the base-weight source may move the frozen base away."""

    @abstractmethod
    def restore_base(self, free_host: bool = False) -> None:
        """Before training: the frozen base is back where the forward pass needs it (free_host: and its host
        copy's pinned memory returned to the OS)."""

    def take_phase_times(self, synchronize: bool | None = None) -> dict[str, dict[str, float]]:
        """This process's phase times since the last call (rlfp8.profiling; bench/step_profile.py)."""
        from rlfp8.profiling import take_phase_times
        return take_phase_times(synchronize)
