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

    # ------------------------------------------------------------------ the engine's memory around training
    # two_copies and offloaded (one_copy keeps its weights: the trainer computes on them): engine.release_kv frees the
    # KV cache while the trainer runs; engine.release_weights (vLLM-owned weights) also moves the weights to the host.
    def read_engine_releases(self) -> None:
        self.release_kv = bool(call(self.engine.kv_release_enabled))
        self.release_weights = bool(call(self.engine.weights_release_enabled))
        self.kv_released = self.weights_released = False

    def engine_out(self, trainer_in=None) -> None:
        """Before training: the KV cache out, then `trainer_in` (offloaded: the trainer's base back onto the device,
        its host copy freed when the engine's weights come to the host next), then the weights out."""
        if self.release_kv and not self.kv_released:
            call(self.engine.release_kv)
            self.kv_released = True
        if trainer_in is not None:
            trainer_in()
        if self.release_weights and not self.weights_released:
            call(self.engine.release_weights)
            self.weights_released = True

    def engine_back(self, trainer_out=None) -> None:
        """After training, before the sync: the trainer's cached blocks returned (its activations' memory: the H200's
        32B run ran out mapping the weights beside them), the weights back (the adapter slot lives among them), then
        `trainer_out` (offloaded with release_weights: its base to the host, off the device before the KV cache
        returns), then the KV cache (the sync's parity probe scores on it)."""
        if not (self.weights_released or self.kv_released):
            return
        call(self.trainer.release_cached_memory)
        if self.weights_released:
            call(self.engine.resume_weights)
            self.weights_released = False
        if trainer_out is not None:
            trainer_out()
        if self.kv_released:                  # (the base's move to the host empties the trainer's cache itself)
            call(self.engine.resume_kv)
            self.kv_released = False

    def shutdown(self) -> None:
        stop_actors(self.actors)
        if self.owns_pg:
            release_pairs(self.actors.placement_group)

