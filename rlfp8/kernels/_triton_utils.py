"""Small helpers shared by the Triton kernel modules: launching (with a collector that lets the sm_90a
compile test capture every launch the host code would make, without a GPU), shape/dtype checks that name
the offending tensor, and the JIT-identical ahead-of-time compile used by that test and by the benchmark's
parallel pre-compilation."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Sequence

import torch

from . import dispatch

_collector: list | None = None
_launch_sink: list | None = None          # launch_plan.capture: the launches of the call it watches


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs), or record the call while `collect_launches()` is active.

    launch_pdl is dropped unless it is True: the interpreter ignores it and on GPU it is only needed on."""
    if kwargs.get("launch_pdl") is False:
        kwargs.pop("launch_pdl")
    if _launch_sink is not None:
        _launch_sink.append((kernel, tuple(grid), args, dict(kwargs)))
        if _collector is None:
            # the launch itself is what a replay repeats: launch_plan's op watch must not see its internals
            # (the interpreter's argument copies)
            from torch.utils._python_dispatch import _disable_current_modes
            with _disable_current_modes():
                return kernel[tuple(grid)](*args, **kwargs)
    if _collector is not None:
        _collector.append((kernel, tuple(grid), args, dict(kwargs)))
        return None
    return kernel[tuple(grid)](*args, **kwargs)


@contextmanager
def collect_launches():
    """Capture launches instead of running them (the compile test calls the launchers with CPU tensors)."""
    global _collector
    old, _collector = _collector, []
    try:
        yield _collector
    finally:
        _collector = old


def jit_spec(fn, args: Sequence[Any], kwargs: dict, target=None) -> dict:
    """What the JIT would compile for `fn[grid](*args, **kwargs)` on `target` (default sm_90a): its own
    argument specialization (pointer alignment, ints divisible by 16 or equal to 1), as a picklable dict."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = target or GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    kwargs = dict(kwargs)
    kwargs.pop("launch_pdl", None) if kwargs.get("launch_pdl") is False else None
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return dict(module=fn.fn.__module__, name=fn.fn.__name__, signature=signature, constexprs=constexprs,
                attrs=attrs, options=dict(options.__dict__), target=(target.backend, target.arch, target.warp_size))


def compile_spec(spec: dict):
    """triton.compile of a jit_spec (in any process; no GPU needed). Fills Triton's on-disk cache, so a
    later launch with the same arguments on a GPU of that target loads the binary instead of compiling."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(spec["module"]), spec["name"])
    source = ASTSource
    if type(fn).__name__ == "GluonJITFunction":                 # a Gluon kernel (lora_gemm_rs)
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn, spec["signature"], spec["constexprs"], spec["attrs"])
    return triton.compile(src, target=GPUTarget(*spec["target"]), options=spec["options"])


def compile_like_jit(fn, args: Sequence[Any], kwargs: dict, target=None):
    """Compile `fn` as `fn[grid](*args, **kwargs)` would on `target` (default sm_90a), without a GPU.
    Returns the CompiledKernel (asm["ptx"], asm["cubin"], metadata)."""
    return compile_spec(jit_spec(fn, args, kwargs, target))


def check_tensor(op: str, name: str, t, *, ndim: int | None = None, shape: Sequence[int | None] | None = None,
                 dtypes: Sequence[torch.dtype] | None = None, device: torch.device | None = None) -> None:
    """Raise a ValueError/TypeError naming the op, the tensor and its shape when `t` does not fit."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"rlfp8.kernels.{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"rlfp8.kernels.{op}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        if len(shape) != t.dim() or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"rlfp8.kernels.{op}: {name} must have shape {want}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"rlfp8.kernels.{op}: {name} must have dtype in {[str(d) for d in dtypes]}, "
                        f"got {t.dtype} (shape {tuple(t.shape)})")
    if device is not None and t.device != device:
        raise ValueError(f"rlfp8.kernels.{op}: {name} is on {t.device} but the other operands are on {device}")


def check_pdl(op: str, use_pdl: bool) -> None:
    """Programmatic dependent launch (gdc_*) exists only on sm_90+ GPUs; the interpreter cannot run it."""
    if use_pdl and dispatch.triton_interpreting() and _collector is None:
        raise ValueError(f"rlfp8.kernels.{op}: use_pdl=True needs a GPU (sm_90+); the Triton interpreter cannot "
                         "run griddepcontrol")


def require_triton_device(op: str, *tensors) -> None:
    """A Triton launch needs CUDA tensors, or CPU tensors under TRITON_INTERPRET=1; never run silently."""
    on_cuda = any(t is not None and t.is_cuda for t in tensors)
    if not on_cuda and not dispatch.triton_interpreting() and _collector is None:
        raise RuntimeError(f"rlfp8.kernels.{op}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 "
                           "for the CPU interpreter); use backend 'torch' on the CPU")


_DEVICE_PROPERTIES: dict[tuple[int, str], int] = {}
SMEM_PER_BLOCK_RESERVED = 1024     # sm_80+: shared memory the driver reserves per resident block


def _driver_property(device, name: str, cpu_stand_in: int) -> int:
    """One of Triton's driver properties of a CUDA device (cached per device); `cpu_stand_in` for CPU tensors
    (the interpreter, the sm_90a compile test)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return cpu_stand_in
    key = (dev.index if dev.index is not None else torch.cuda.current_device(), name)
    if key not in _DEVICE_PROPERTIES:
        from triton.runtime import driver
        _DEVICE_PROPERTIES[key] = int(driver.active.utils.get_device_properties(key[0])[name])
    return _DEVICE_PROPERTIES[key]


def max_shared_mem(device, cpu_stand_in: int) -> int:
    """The per-block shared-memory limit (bytes) of a CUDA device, as Triton's driver reports it (the number it
    checks launches against)."""
    return _driver_property(device, "max_shared_mem", cpu_stand_in)


def device_sms(device, cpu_stand_in: int) -> int:
    """The multiprocessor count of a CUDA device."""
    return _driver_property(device, "multiprocessor_count", cpu_stand_in)


def programs_per_sm(smem: int, num_warps: int, max_shared: int, regs_per_thread: int) -> int:
    """How many programs of one launch an SM holds (sm_90): by shared memory (the SM's is the per-block limit
    plus one block's reservation), by threads (2048) and by registers (64K, allocated per warp in units of 256)."""
    per_sm = max_shared + SMEM_PER_BLOCK_RESERVED
    per_warp = -(-regs_per_thread * 32 // 256) * 256
    return max(0, min(per_sm // (smem + SMEM_PER_BLOCK_RESERVED), 2048 // (32 * num_warps),
                      65536 // (per_warp * num_warps), 32))


_counter_cache: dict[tuple[str, torch.device], torch.Tensor] = {}


def split_counters(tag: str, n: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 tile counters for the split-K "last program reduces" protocol. The kernels reset every
    counter they use back to 0, so one buffer per (op, device) serves all later launches and CUDA-graph
    replays. Call the op once before graph capture (as vLLM's warm-up does); a buffer first needed during
    capture is allocated inside the graph (its memset is captured) and not cached. A larger request replaces
    the cached buffer; the replaced one is kept alive for graphs captured with it."""
    key = (tag, torch.device(device))
    buf = _counter_cache.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    capturing = torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()
    buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    if not capturing:
        _retire(_counter_cache.get(key))
        _counter_cache[key] = buf
    return buf


_retired: list[torch.Tensor] = []


def _retire(buf: torch.Tensor | None) -> None:
    """Keep a replaced buffer alive: CUDA graphs captured earlier still address it."""
    if buf is not None:
        _retired.append(buf)


def stacked_view(op: str, name: str, t: torch.Tensor, inner: int) -> torch.Tensor:
    """[S, a, b] or vLLM's [S, 1, a, b] -> a 3-D view [S, a, b] (no copy); `inner` = expected size of dim -1
    (None to skip)."""
    if t.dim() == 4:
        if t.shape[1] != 1:
            raise ValueError(f"rlfp8.kernels.{op}: {name} must be [S, 1, a, b] (vLLM layout) or [S, a, b], "
                             f"got {tuple(t.shape)}")
        t = t[:, 0]
    if t.dim() != 3:
        raise ValueError(f"rlfp8.kernels.{op}: {name} must be 3-D [slots, a, b] (or vLLM's [slots, 1, a, b]), "
                         f"got {tuple(t.shape)}")
    if inner is not None and t.shape[-1] != inner:
        raise ValueError(f"rlfp8.kernels.{op}: {name} has last dim {t.shape[-1]}, expected {inner} "
                         f"(shape {tuple(t.shape)})")
    return t


def _compile_spec_quiet(spec: dict) -> str | None:
    try:
        compile_spec(spec)
        return None
    except Exception as e:  # reported by precompile's caller; the real launch will raise it again
        return f"{spec['name']}: {type(e).__name__}: {str(e)[:300]}"


def precompile(records: list, jobs: int = 8, target=None, initializer=None, initargs=()) -> dict:
    """Compile the launches captured by collect_launches() in `jobs` worker processes (spawned: they never
    touch CUDA; `initializer(*initargs)` runs first in each, e.g. rlfp8.kernels.timeline.enable), filling
    Triton's on-disk cache so that the real launches load binaries instead of compiling one by one.
    Returns {"kernels": n, "errors": [...], "seconds": s}."""
    import multiprocessing as mp
    import time
    from concurrent.futures import ProcessPoolExecutor

    if target is None and torch.cuda.is_available():
        from triton.backends.compiler import GPUTarget
        cap = torch.cuda.get_device_capability()
        target = GPUTarget("cuda", cap[0] * 10 + cap[1], 32)
    t0 = time.time()
    specs, seen = [], set()
    for kern, _grid, args, kw in records:
        spec = jit_spec(kern, args, kw, target)
        key = repr((spec["name"], sorted(spec["signature"].items()), sorted(spec["constexprs"].items()),
                    sorted(spec["attrs"].items()), sorted(spec["options"].items())))
        if key not in seen:
            seen.add(key)
            specs.append(spec)
    errors = []
    if specs:
        with ProcessPoolExecutor(max_workers=max(1, min(jobs, len(specs))), mp_context=mp.get_context("spawn"),
                                 initializer=initializer, initargs=initargs) as ex:
            errors = [e for e in ex.map(_compile_spec_quiet, specs) if e]
    return {"kernels": len(specs), "errors": errors, "seconds": round(time.time() - t0, 1)}


def alloc_trace(fn):
    """Run fn() once on CUDA: (its result, peak bytes allocated above the start, sizes of all allocations it
    made or None), from the caching allocator's counters and its allocation history (no tracebacks recorded,
    so cheap to record and snapshot). Used by the GPU tests and bench/kernel_bench.py to show no weight copy."""
    import inspect
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        kw = dict(context=None, max_entries=100_000)
        if "clear_history" in inspect.signature(torch.cuda.memory._record_memory_history).parameters:
            kw["clear_history"] = True
        torch.cuda.memory._record_memory_history(**kw)
        recording = True
    except Exception:                                   # no allocation history in this build: peaks only
        recording = False
    sizes = None
    try:
        out = fn()
        torch.cuda.synchronize()
        if recording:
            snap = torch.cuda.memory._snapshot()
            sizes = [e["size"] for tr in snap.get("device_traces", []) for e in tr if e.get("action") == "alloc"]
    finally:
        if recording:
            torch.cuda.memory._record_memory_history(enabled=None)
    return out, torch.cuda.max_memory_allocated() - base, sizes
