"""Ray set-up in one place: join or start Ray, reserve the device, create the two role actors.

One placement-group bundle holds the device; both actors are scheduled into it with half of it each
(GPU: num_gpus=0.5 so Ray gives both the same card; CPU: fractional CPUs, and each actor sets its own
thread count to all cores since the phases alternate and never run at the same time).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any


@dataclass
class Actors:
    engine: Any          # a Ray handle of rlfp8.rollout.actor.RolloutActor
    trainer: Any         # a Ray handle of rlfp8.trainer.actor.TrainerActor
    placement_group: Any


def _on_gpu(cfg: dict) -> bool:
    import torch
    return torch.cuda.is_available() and cfg["trainer"]["device"] != "cpu"


def _init_ray(cfg: dict) -> None:
    import ray
    rcfg = cfg["ray"]
    if ray.is_initialized():
        return
    kw = dict(include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING, configure_logging=True)
    if rcfg["address"]:
        ray.init(address=rcfg["address"], **kw)
    else:
        ray.init(num_cpus=int(rcfg["num_cpus"] or max(os.cpu_count() or 1, 2)),
                 object_store_memory=int(float(rcfg["object_store_gb"]) * 2**30), **kw)


def start_actors(cfg: dict, model_path: str, weight_source: str, scratch_dir: str) -> Actors:
    """The engine first (vLLM sizes its memory from what is free when it starts), then the trainer."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rlfp8.rollout.actor import RolloutActor
    from rlfp8.trainer.actor import TrainerActor

    _init_ray(cfg)
    on_gpu = _on_gpu(cfg)
    threads = int(cfg["trainer"]["num_threads"] or os.cpu_count() or 1)
    pg = placement_group([{"GPU": 1, "CPU": 2} if on_gpu else {"CPU": 2}], strategy="PACK")
    ray.get(pg.ready(), timeout=300)
    options = dict(scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                        placement_group_bundle_index=0),
                   runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                                             "PYTHONUNBUFFERED": "1"}})
    res = dict(num_gpus=0.5, num_cpus=1) if on_gpu else dict(num_cpus=1)
    engine = ray.remote(**res)(RolloutActor).options(**options).remote(model_path, cfg, scratch_dir, threads)
    ray.get(engine.memory.remote())
    handles = ray.get(engine.export_weights.remote()) if weight_source == "map" else None
    trainer = ray.remote(**res)(TrainerActor).options(**options).remote(model_path, cfg, weight_source, threads,
                                                                        handles)
    ray.get(trainer.kernel_report.remote())
    return Actors(engine, trainer, pg)


def stop_actors(actors: Actors) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group
    for a in (actors.engine, actors.trainer):
        ray.kill(a)
    remove_placement_group(actors.placement_group)
    ray.shutdown()
