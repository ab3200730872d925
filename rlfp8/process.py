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


def empty_host_cache() -> bool:
    """Return the pinned host memory torch keeps cached after its tensors are gone (CUDA's caching host
    allocator) to the OS; False where this torch has no such call. Two processes each caching a 16-bit copy of
    a large base would need both copies' worth of host memory (engine.release_weights with placement=offloaded)."""
    import torch
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            fn()
            return True
    return False
