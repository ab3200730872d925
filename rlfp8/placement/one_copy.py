"""one_copy: the trainer maps the engine's FP8 tensors (base-weight source "map") and the engine
releases its KV cache while the trainer runs. Not built yet (issue 14); the config rejects it first
(rlfp8.config.UNAVAILABLE), this class is where it goes."""
from __future__ import annotations

from .base import Placement


class OneCopy(Placement):
    name = "one_copy"
    weight_source = "map"

    def __init__(self, cfg: dict, model_path: str, scratch_dir: str):
        raise NotImplementedError("placement=one_copy is not built yet (issue 14): use placement=two_copies "
                                  "or placement=offloaded")

    def before_rollout(self) -> None:       # what it will do: the KV cache back before generating
        raise NotImplementedError("one_copy: resume_kv before the rollout (issue 14)")

    def before_train(self) -> None:         # and away while the trainer runs
        raise NotImplementedError("one_copy: release_kv before training (issue 14)")
