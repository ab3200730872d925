"""What the RL loop and the placements may ask of a rollout engine.

An adapter update is {"version": int, "tensors": {PEFT key name: CPU tensor}, "config": PEFT
adapter_config dict}, as rlfp8.trainer's export_adapter produces it; set_adapter writes it in place into the
engine's resident slot. release_kv / resume_kv (vLLM's sleep mode: a GPU) and export_weights (rlfp8's FP8
codes) serve the one-copy placement; release_weights / resume_weights (vLLM-owned weights to the host and back)
serve verl's colocated recipe (engine.release_weights).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from .engine import Sample  # the engine's result type: token ids, sampled log-probs, finish reason, text

__all__ = ["RolloutEngineInterface", "Sample"]


class RolloutEngineInterface(ABC):
    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float, max_tokens: int,
                 top_p: float = 1.0, top_k: int = -1, stop_token_ids: list[int] | None = None,
                 use_adapter: bool = True, greedy: bool = False, seed: int | None = None) -> list[Sample]:
        """n samples per prompt with each sampled token's log-prob under the distribution sampled
        from; greedy=True (evaluation): argmax decoding, one sample, no log-probs."""

    @abstractmethod
    def set_adapter(self, update: dict) -> int:
        """Serve this adapter from the next generate() on; returns the version now served."""

    @abstractmethod
    def score(self, sequences: list[list[int]], prompt_lens: list[int], use_adapter: bool = True) -> list[list[float]]:
        """Log-probs (temperature 1) of each sequence's tokens after its prompt (the parity probe)."""

    @abstractmethod
    def slot_checksums(self) -> dict[str, float]:
        """Per projection family, the checksum of what the engine's adapter slot holds."""

    @abstractmethod
    def release_kv(self) -> None:
        """Free the KV cache while the trainer runs (one_copy)."""

    @abstractmethod
    def resume_kv(self) -> None:
        """Re-allocate the KV cache before the next rollout (one_copy)."""

    @abstractmethod
    def release_weights(self) -> dict:
        """Move vLLM-owned weights to the host while the trainer runs, after release_kv (engine.release_weights)."""

    @abstractmethod
    def resume_weights(self) -> None:
        """Bring them back at the same addresses before the sync writes the adapter slot."""

    @abstractmethod
    def export_weights(self) -> dict:
        """Handles of the engine's FP8 weight tensors for the trainer to map (one_copy)."""

    @abstractmethod
    def memory(self) -> dict[str, float]:
        """memory/* metrics of the engine's process."""

    def take_phase_times(self, synchronize: bool | None = None) -> dict[str, dict[str, float]]:
        """This process's phase times since the last call (rlfp8.profiling; bench/step_profile.py)."""
        from rlfp8.profiling import take_phase_times
        return take_phase_times(synchronize)
