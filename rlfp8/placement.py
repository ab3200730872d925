"""Ray placement: the rollout engine and the trainer as two actors on ONE device.

One placement-group bundle holds the device; both actors are scheduled into it with half of it each
(GPU: num_gpus=0.5 so Ray gives both the same card; CPU: fractional CPUs, and each actor sets its own
thread count to all cores since the phases alternate and never run at the same time).

Placements (conf/placement):
  two_copies  the trainer holds its own FP8 copy of the base, resident;
  offloaded   the trainer's copy waits in pinned host memory while the engine generates
              (moved back at the start of each training phase); plain CPU memory on CPU machines.
"""
from __future__ import annotations

import logging
import os


class _TrainerActor:
    def __init__(self, model_path: str, cfg: dict, num_threads: int):
        _actor_setup(num_threads, quiet_vllm=False)
        from rlfp8.trainer.core import PolicyTrainer
        self.impl = PolicyTrainer(model_path, cfg)

    def call(self, method: str, *args, **kwargs):
        return getattr(self.impl, method)(*args, **kwargs)


class _RolloutActor:
    def __init__(self, model_path: str, cfg: dict, num_threads: int):
        _actor_setup(num_threads, quiet_vllm=not cfg.get("verbose", False))
        from rlfp8.rollout.engine import RolloutEngine
        self.impl = RolloutEngine(model_path, cfg)

    def call(self, method: str, *args, **kwargs):
        return getattr(self.impl, method)(*args, **kwargs)


def _actor_setup(num_threads: int, quiet_vllm: bool) -> None:
    import logging as _l
    _l.basicConfig(level=_l.INFO, format="%(levelname)s %(name)s: %(message)s")
    if quiet_vllm:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch
    if not torch.cuda.is_available():
        torch.set_num_threads(num_threads)


class Placement:
    """Starts Ray (or joins `ray.address`), reserves the device, creates the two actors."""

    def __init__(self, cfg: dict, model_path: str):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        import torch
        self.cfg = cfg
        self.name = cfg["placement"]["name"]
        rcfg = cfg.get("ray", {})
        on_gpu = torch.cuda.is_available() and cfg["trainer"].get("device", "auto") != "cpu"
        ncpu = os.cpu_count() or 1
        threads = int(cfg["trainer"].get("num_threads") or ncpu)
        if not ray.is_initialized():
            kw = dict(include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING,
                      configure_logging=True)
            if rcfg.get("address"):
                ray.init(address=rcfg["address"], **kw)
            else:
                ray.init(num_cpus=int(rcfg.get("num_cpus") or max(ncpu, 2)),
                         object_store_memory=int(float(rcfg.get("object_store_gb", 1)) * 2**30), **kw)
        bundle = {"GPU": 1, "CPU": 2} if on_gpu else {"CPU": 2}
        self.pg = placement_group([bundle], strategy="PACK")
        ray.get(self.pg.ready(), timeout=300)
        strat = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=0)
        res = dict(num_gpus=0.5, num_cpus=1) if on_gpu else dict(num_cpus=1)
        env = {"env_vars": {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                            "PYTHONUNBUFFERED": "1"}}
        # The engine first: vLLM sizes its memory from what is free when it starts.
        self.engine = ray.remote(**res)(_RolloutActor).options(
            scheduling_strategy=strat, runtime_env=env).remote(model_path, cfg, threads)
        ray.get(self.engine.call.remote("memory"))
        self.trainer = ray.remote(**res)(_TrainerActor).options(
            scheduling_strategy=strat, runtime_env=env).remote(model_path, cfg, threads)
        ray.get(self.trainer.call.remote("kernel_report"))
        self.offload_trainer = self.name == "offloaded"
        if self.offload_trainer:
            ray.get(self.trainer.call.remote("offload"))

    def train(self, batch):
        """Training phase: the trainer's base comes back from host memory first (offloaded)."""
        import ray
        metrics = ray.get(self.trainer.call.remote("train_step", batch))
        return metrics

    def after_sync(self):
        import ray
        if self.offload_trainer:
            ray.get(self.trainer.call.remote("offload"))

    def shutdown(self):
        import ray
        from ray.util.placement_group import remove_placement_group
        for a in (getattr(self, "engine", None), getattr(self, "trainer", None)):
            if a is not None:
                ray.kill(a)
        remove_placement_group(self.pg)
        ray.shutdown()
