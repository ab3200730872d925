"""A placement: where the engine and the trainer live and what happens around each phase.

The RL loop calls the hooks in this order every step:
    before_rollout -> (generate) -> settle -> before_train -> (train_step) -> after_train
    -> (export + set_adapter, the parity probe started: both sides score) -> after_sync
and after_setup once, when both actors are up. settle checks what the last sync started (the RL loop also calls
it before a checkpoint and at the end), so those checks can run beside the next rollout. A strategy names its
trainer's base-weight source (rlfp8.trainer.weights.SOURCES).
"""
from __future__ import annotations

from . import call  # noqa: F401  (the strategies' way to run an actor method)
from .ray_setup import Actors, release_pairs, reserve_pairs, start_pairs, stop_actors


class Placement:
    name = ""
    weight_source = "quantize"

    def __init__(self, cfg: dict, model_path: str, scratch_dir: str, actors: Actors | None = None):
        """actors: this pair's, started by rlfp8.placement.pairs; None: this placement reserves a bundle and
        starts (and owns) its own."""
        self.cfg = cfg
        self.owns_pg = actors is None
        if actors is None:
            actors = start_pairs(cfg, model_path, self.weight_source, [scratch_dir], reserve_pairs(cfg))[0]
        self.actors = actors
        self.engine, self.trainer = self.actors.engine, self.actors.trainer
        self.after_setup()

    def after_setup(self) -> None:
        """Both actors are up."""

    def before_rollout(self) -> None:
        """The engine is about to generate."""

    def before_train(self) -> None:
        """The trainer is about to run train_step."""

    def after_train(self) -> None:
        """The trainer is done with this step's update; the engine runs next (the sync's probe scores on it)."""

    def after_sync(self) -> None:
        """The engine holds the new adapter; the parity probe's calls are queued on both actors."""

    def settle(self) -> None:
        """Raise if a check started at the last sync failed (waits for it)."""

    def shutdown(self) -> None:
        stop_actors(self.actors)
        if self.owns_pg:
            release_pairs(self.actors.placement_group)

