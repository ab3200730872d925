"""Triton's argument binder + specializer (what JITFunction.run calls first) timed on recorded launches, for an
sm_90 target: the part of a launch's host cost the CPU proxies (host_overhead.py, engine_host_overhead.py) can
time without a GPU."""
from __future__ import annotations

import time


def binder_us(records, reps: int = 200) -> float:
    """Mean microseconds of Triton's argument binder+specializer (what JITFunction.run calls first) per
    recorded launch, for an sm_90 target."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    backend = make_backend(GPUTarget("cuda", 90, 32))
    total = 0.0
    for kern, _grid, args, kw in records:
        binder = create_function_from_signature(kern.signature, kern.params, backend)
        kw = {k: v for k, v in kw.items() if k != "launch_pdl"}
        t0 = time.perf_counter()
        for _ in range(reps):
            binder(*args, **kw)
        total += (time.perf_counter() - t0) / reps
    return 1e6 * total / max(1, len(records))
