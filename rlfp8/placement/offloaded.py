"""offloaded: the trainer's FP8 copy waits in pinned host memory while the engine generates (plain
CPU memory on CPU machines): out after set-up and after every sync, back before training."""
from __future__ import annotations

from .base import Placement, call


class Offloaded(Placement):
    name = "offloaded"
    weight_source = "offload"

    def after_setup(self) -> None:
        call(self.trainer.release_base)

    def before_train(self) -> None:
        call(self.trainer.restore_base)

    def after_sync(self) -> None:
        call(self.trainer.release_base)
