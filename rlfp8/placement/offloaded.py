"""offloaded: the trainer's copy waits in pinned host memory while the engine generates (plain CPU memory on CPU
machines): out after set-up and after every sync, back before training.

With engine.release_weights (vLLM-owned weights: verl's colocated recipe, the engine asleep while the trainer
runs) the order keeps ONE 16-bit copy on the host at a time (a 32B base is 61 GiB; two would not fit a 128 GiB
host): before training the engine's KV cache goes, the trainer's base comes onto the device and its pinned host
pages are returned, then the engine's weights go to the host; after training the engine's weights come back
(their host pages returned), the trainer's base goes to the host, then the KV cache returns. The device holds
both bases for the moments between (no KV cache, no activations then).
"""
from __future__ import annotations

from .base import Placement, call


class Offloaded(Placement):
    name = "offloaded"
    weight_source = "offload"

    def after_setup(self) -> None:
        self.read_engine_releases()
        call(self.trainer.release_base)

    def before_rollout(self) -> None:
        self.engine_back(self._base_out_first)

    def before_train(self) -> None:
        self.engine_out(lambda: call(self.trainer.restore_base, self.release_weights))

    def after_train(self) -> None:
        self.engine_back(self._base_out_first)

    def after_sync(self) -> None:
        call(self.trainer.release_base)

    def _base_out_first(self) -> None:
        if self.release_weights:
            call(self.trainer.release_base)
