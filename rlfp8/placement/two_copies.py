"""two_copies: the engine and the trainer each hold their own copy of the base (the trainer's in FP8, quantized
from the checkpoint), both resident. With engine.release_kv (and, for vLLM-owned weights, engine.release_weights)
the engine frees its KV cache (and weights) while the trainer runs, back before the sync."""
from __future__ import annotations

from .base import Placement


class TwoCopies(Placement):
    name = "two_copies"
    weight_source = "quantize"

    def after_setup(self) -> None:
        self.read_engine_releases()

    def before_rollout(self) -> None:
        self.engine_back()

    def before_train(self) -> None:
        self.engine_out()

    def after_train(self) -> None:
        self.engine_back()
