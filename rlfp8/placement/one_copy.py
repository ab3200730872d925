"""one_copy: ONE FP8 copy of the base. The engine exports its FP8 codes and scales (CUDA IPC handles on a GPU,
/dev/shm-backed tensors on a CPU machine) and the trainer maps them (base-weight source "map": q/k/v and
gate/up as row views of the engine's fused tensors), so the trainer holds no base of its own. With
engine.release_kv (auto = on, on a GPU) the engine frees its KV cache while the trainer runs and maps it back
as soon as the update is done (the trainer first returns its cached blocks), before the sync's parity probe
scores on the engine. placement.checksum_every: every N syncs the engine's and the trainer's checksums of
the shared base are compared with the one taken at set-up (the base must never be written); they are started
at the sync and compared at settle (before the next update), so they do not hold up the next rollout.
"""
from __future__ import annotations

import logging

from .base import Placement, call

log = logging.getLogger("rlfp8.placement")


class BaseWrittenError(RuntimeError):
    pass


class OneCopy(Placement):
    name = "one_copy"
    weight_source = "map"

    def after_setup(self) -> None:
        self.kv_released = False
        self.syncs = 0
        self.pending_base = None        # (syncs, engine's ref, trainer's ref) of checksums started at a sync
        self.checksum = call(self.engine.base_checksums)
        self._compare(call(self.trainer.base_checksums), "right after mapping (trainer vs engine)")
        self.release_kv = call(self.engine.kv_release_enabled)
        log.info("one_copy: the trainer maps the engine's FP8 base (%d projections, checksums equal); KV release %s",
                 len(self.checksum), "on" if self.release_kv else "off")

    def before_rollout(self) -> None:
        if self.kv_released:
            call(self.engine.resume_kv)
            self.kv_released = False

    def after_train(self) -> None:
        if self.kv_released:
            call(self.trainer.release_cached_memory)
            call(self.engine.resume_kv)
            self.kv_released = False

    def before_train(self) -> None:
        if self.release_kv and not self.kv_released:
            call(self.engine.release_kv)
            self.kv_released = True

    def after_sync(self) -> None:
        self.syncs += 1
        every = self.cfg["placement"]["checksum_every"]
        if every and self.syncs % every == 0:
            self.pending_base = (self.syncs, self.engine.base_checksums.remote(), self.trainer.base_checksums.remote())

    def settle(self) -> None:
        """The checksums started at the last checked sync equal the set-up ones (raises BaseWrittenError)."""
        if self.pending_base is None:
            return
        import ray
        syncs, engine_ref, trainer_ref = self.pending_base
        self.pending_base = None
        self._compare(ray.get(engine_ref), f"after {syncs} syncs (engine)")
        self._compare(ray.get(trainer_ref), f"after {syncs} syncs (trainer)")

    def _compare(self, got: dict[str, int], when: str) -> None:
        bad = sorted(k for k in got if got[k] != self.checksum.get(k))
        if bad:
            raise BaseWrittenError(f"one_copy: the shared FP8 base differs {when} in {len(bad)} projections, e.g. "
                                   f"{bad[:3]}: it must never be written")
