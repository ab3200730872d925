"""Placement strategies: one class per placement (conf/placement/<name>.yaml sets placement.name).

    two_copies  the trainer holds its own FP8 copy of the base, resident
    offloaded   the trainer's copy waits in host memory while the engine generates
    one_copy    the trainer maps the engine's tensors; the engine releases KV while training

The placement joins the two roles: the trainer knows no engine and the engine no trainer.
Ray set-up is in ray_setup.py. Modules are imported when a placement starts (Ray is heavy).
"""
from __future__ import annotations

import importlib

# placement.name -> "module:class" (rlfp8.config reads the names from here)
STRATEGIES = {
    "two_copies": "two_copies:TwoCopies",
    "offloaded": "offloaded:Offloaded",
    "one_copy": "one_copy:OneCopy",
}


def call(actor_method, *args, **kwargs):
    """Run one actor method and wait for its result: call(placement.engine.memory)."""
    import ray
    return ray.get(actor_method.remote(*args, **kwargs))


def start_together(*calls) -> list:
    """Start several actor methods at once without waiting (actors work side by side): their object refs, in
    order, start_together((engine.score, seqs, lens), (trainer.score_tokens, seqs, lens)); ray.get them later.
    Each actor runs its calls in the order they were started, so a later call to the same actor waits."""
    return [method.remote(*args) for method, *args in calls]


def placement_class(cfg: dict):
    name = cfg["placement"]["name"]
    if name not in STRATEGIES:
        raise ValueError(f"placement.name={name!r}: allowed values are {list(STRATEGIES)}")
    module, cls = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def make_placement(cfg: dict, model_path: str, scratch_dir: str, actors=None):
    """One pair's placement, around `actors` (rlfp8.placement.pairs starts them) or its own."""
    return placement_class(cfg)(cfg, model_path, scratch_dir, actors)
