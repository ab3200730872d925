"""Set-up of an actor's process (a leaf module: both role actors call it, importing nothing of rlfp8)."""
from __future__ import annotations

import logging
import os


def setup_actor_process(num_threads: int, quiet_vllm: bool) -> None:
    """Logging format, vLLM's log level, and on a CPU machine the torch thread count: the phases
    alternate and never run at the same time, so each actor may use every core."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if quiet_vllm:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch
    if not torch.cuda.is_available():
        torch.set_num_threads(num_threads)
