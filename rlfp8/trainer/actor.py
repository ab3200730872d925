"""TrainerActor: the trainer role as a Ray actor. Its typed methods are PolicyTrainer's
(TrainerInterface); the actor only sets up its process first."""
from __future__ import annotations

from rlfp8.kernels.knobs import apply_config, knobs, set_knobs
from rlfp8.process import setup_actor_process

from .core import PolicyTrainer
from .data_parallel import rendezvous_address


def apply_trainer_kernel_knobs(cfg: dict) -> None:
    """The kernels.* knobs of the config in this process, as the trainer runs them (bench/lab scripts that
    build a PolicyTrainer without the actor call it too)."""
    apply_config(cfg["kernels"])
    if knobs().batch_invariant == "auto" and cfg["engine"]["precision"] != "w8a16":
        set_knobs(batch_invariant="off")         # no matched engine to agree with: the tuned (faster) configs


class TrainerActor(PolicyTrainer):
    def __init__(self, model_path: str, cfg: dict, weight_source: str, num_threads: int,
                 weight_handles: dict | None = None):
        setup_actor_process(num_threads, quiet_vllm=False)
        apply_trainer_kernel_knobs(cfg)
        super().__init__(model_path, cfg, weight_source=weight_source, weight_handles=weight_handles)

    def rendezvous_address(self) -> tuple[str, int]:
        """(host, free port) of this actor's node: pair 0's trainer hosts the data-parallel rendezvous."""
        return rendezvous_address()
