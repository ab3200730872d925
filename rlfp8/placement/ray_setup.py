"""Ray set-up in one place: join or start Ray, reserve one bundle per engine + trainer pair, create a
pair's two role actors.

Each pair's bundle holds its device; both actors of a pair are scheduled into it with half of it each
(GPU: num_gpus=0.5 so Ray gives both the same card; CPU: fractional CPUs). On a CPU machine each actor sets
its thread count to the machine's cores divided by ray.num_pairs: a pair's phases alternate, but the pairs
run side by side. ray.address: null starts a local Ray instance; "auto" or "host:port" joins a cluster.
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
    bundle_index: int = 0


class NotEnoughGPUsError(RuntimeError):
    """ray.num_pairs asks for more GPUs than Ray has (rlfp8.train reports it as a config error)."""


def _num_pairs(cfg: dict) -> int:
    return int(cfg["ray"]["num_pairs"])


def _on_gpu(cfg: dict) -> bool:
    """GPU pairs unless trainer.device=cpu: the driver's own CUDA, or GPUs in the joined cluster."""
    import ray
    import torch
    if cfg["trainer"]["device"] == "cpu":
        return False
    return torch.cuda.is_available() or (ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0)


def _init_ray(cfg: dict) -> None:
    import ray
    rcfg = cfg["ray"]
    if ray.is_initialized():
        return
    kw = dict(include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING, configure_logging=True)
    if rcfg["address"]:
        ray.init(address=rcfg["address"], **kw)
    else:
        cpus = rcfg["num_cpus"] or max(os.cpu_count() or 1, 2 * _num_pairs(cfg))   # 2 logical CPUs per bundle
        ray.init(num_cpus=int(cpus), object_store_memory=int(float(rcfg["object_store_gb"]) * 2**30), **kw)


def reserve_pairs(cfg: dict) -> Any:
    """Ray up, and a placement group of ray.num_pairs bundles (one GPU each on GPUs). Too few GPUs:
    NotEnoughGPUsError before any actor starts."""
    import ray
    from ray.util.placement_group import placement_group
    _init_ray(cfg)
    n = _num_pairs(cfg)
    if _on_gpu(cfg):
        gpus = ray.cluster_resources().get("GPU", 0)
        if gpus < n:
            raise NotEnoughGPUsError(f"ray.num_pairs={n} needs {n} GPUs (one per engine + trainer pair); the Ray "
                              f"{'cluster at ray.address=' + str(cfg['ray']['address']) if cfg['ray']['address'] else 'instance'}"
                              f" has {gpus:g}")
        bundle = {"GPU": 1, "CPU": 2}
    else:
        bundle = {"CPU": 2}
    pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
    ray.get(pg.ready(), timeout=300)
    return pg


def release_pairs(pg: Any) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group
    remove_placement_group(pg)
    ray.shutdown()


def _multicast_env() -> dict[str, str]:
    """NVLink multicast stays off in the actors' NCCL unless the user turned it on (the adapter all-reduce
    is small; on shared hosts a multicast fault can take the GPUs out of service); the driver's own
    multicast settings reach the actors unchanged."""
    env = {k: os.environ[k] for k in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS") if k in os.environ}
    return {"NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0"), **env}


def _actor_options(cfg: dict, pg: Any, bundle_index: int) -> tuple[dict, dict, int]:
    """(scheduling options, resources, threads) of an actor in bundle `bundle_index` of `pg`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    threads = int(cfg["trainer"]["num_threads"] or max(1, (os.cpu_count() or 1) // _num_pairs(cfg)))
    options = dict(scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                        placement_group_bundle_index=bundle_index),
                   runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                                             "PYTHONUNBUFFERED": "1", **_multicast_env()}})
    res = dict(num_gpus=0.5, num_cpus=1) if _on_gpu(cfg) else dict(num_cpus=1)
    return options, res, threads


def start_pairs(cfg: dict, model_path: str, weight_source: str, scratch_dirs: list[str], pg: Any) -> list[Actors]:
    """One pair per bundle of `pg` (scratch_dirs[i]: pair i's), the pairs side by side: every engine first
    (vLLM sizes its memory from what is free on its card when it starts), then every trainer."""
    import ray

    from rlfp8.rollout.actor import RolloutActor
    from rlfp8.trainer.actor import TrainerActor
    engines = []
    for i, scratch_dir in enumerate(scratch_dirs):
        options, res, threads = _actor_options(cfg, pg, i)
        engines.append(ray.remote(**res)(RolloutActor).options(**options).remote(model_path, cfg, scratch_dir,
                                                                                 threads))
    ray.get([e.memory.remote() for e in engines])
    handles = (ray.get([e.export_weights.remote() for e in engines]) if weight_source == "map"
               else [None] * len(engines))
    trainers = []
    for i, h in enumerate(handles):
        options, res, threads = _actor_options(cfg, pg, i)
        trainers.append(ray.remote(**res)(TrainerActor).options(**options).remote(model_path, cfg, weight_source,
                                                                                  threads, h))
    ray.get([t.kernel_report.remote() for t in trainers])
    return [Actors(e, t, pg, i) for i, (e, t) in enumerate(zip(engines, trainers))]


def stop_actors(actors: Actors) -> None:
    import ray
    for a in (actors.engine, actors.trainer):
        ray.kill(a)
