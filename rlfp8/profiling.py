"""Phase timers of one process: where an RL step's time goes (bench/step_profile.py reads them).

Each process (the driver, the engine actor, the trainer actor) keeps one PhaseTimer. Code marks a phase with
`with phase("engine/generate"):`; a phase entered again in the same step adds up (micro-batches). Timing is
wall-clock; after `take_phase_times(synchronize=True)` (profiling runs only) a CUDA device is synchronised at each phase's ends
so GPU work is charged to the phase that launched it; the training loop never synchronises for it.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager


class PhaseTimer:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.sync_cuda = False

    def _sync(self) -> None:
        if self.sync_cuda:
            import torch
            if torch.cuda.is_available():
                torch.cuda.synchronize()

    @contextmanager
    def phase(self, name: str):
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] += time.perf_counter() - t0
            self.counts[name] += 1

    def take(self) -> dict[str, dict[str, float]]:
        """{phase: {"s": seconds, "n": times entered}} since the last take(), and start afresh."""
        out = {k: {"s": v, "n": self.counts[k]} for k, v in self.seconds.items()}
        self.seconds.clear()
        self.counts.clear()
        return out


TIMER = PhaseTimer()


def phase(name: str):
    """A context manager, or a decorator (the whole call is the phase)."""
    return TIMER.phase(name)


def take_phase_times(synchronize: bool | None = None) -> dict[str, dict[str, float]]:
    """This process's phase times since the last call; synchronize=True/False switches CUDA syncs from now on."""
    if synchronize is not None:
        TIMER.sync_cuda = bool(synchronize)
    return TIMER.take()
