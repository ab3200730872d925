"""Which implementation of each kernel op runs, and a record of what actually ran.

Every op in rlfp8.kernels has a Triton kernel and a plain-torch reference. `choose(op, *tensors)`
picks one and records it; nothing falls back silently:
  - backend "auto" (default): Triton for CUDA tensors, the torch reference for CPU tensors;
  - backend "triton": Triton always; CPU tensors are allowed only under TRITON_INTERPRET=1
    (the interpreter), otherwise it raises;
  - backend "torch": the reference always (the baseline arm, and the CPU path).
Set it with `set_backend(...)`, the env var RLFP8_KERNELS, or the config key `trainer.kernels`
(it is the knob `backend` of rlfp8.kernels.knobs).
`report()` returns {op: {path: calls}}; the trainer logs it, and the first call of each
(op, path) pair is logged at INFO.
"""
from __future__ import annotations

import logging
import os
from collections import defaultdict
from contextlib import contextmanager

import torch

log = logging.getLogger("rlfp8.kernels")

from .knobs import BACKENDS, knobs, set_knobs

_ran: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def set_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend {backend!r}: allowed values are {BACKENDS}")
    set_knobs(backend=backend)


def get_backend() -> str:
    return knobs().backend


@contextmanager
def use_backend(backend: str):
    old = get_backend()
    set_backend(backend)
    try:
        yield
    finally:
        set_backend(old)


def choose(op: str, *tensors: torch.Tensor | None) -> str:
    """Return "triton" or "torch" for this call of `op` and record the choice."""
    path = would_choose(op, *tensors)
    record(op, path)
    return path


def would_choose(op: str, *tensors: torch.Tensor | None) -> str:
    """What `choose` would return, without recording it (a caller planning several ops)."""
    on_cuda = any(t is not None and t.is_cuda for t in tensors)
    backend = knobs().backend
    if backend == "torch":
        path = "torch"
    elif backend == "triton":
        if not on_cuda and not triton_interpreting():
            raise RuntimeError(
                f"rlfp8.kernels.{op}: backend 'triton' was forced but the tensors are on the CPU "
                "and TRITON_INTERPRET=1 is not set; use backend 'auto' or 'torch' on the CPU")
        path = "triton"
    else:
        path = "triton" if on_cuda else "torch"
    return path


def pdl_unavailable(device: torch.device) -> str | None:
    """None when a programmatic dependent launch can run on `device`, else why not (sm_90+ GPU and a Triton
    with tl.extra.cuda.gdc_*; never under the interpreter, which cannot run griddepcontrol)."""
    if triton_interpreting():
        return "the Triton interpreter (TRITON_INTERPRET=1) cannot run griddepcontrol"
    if device.type != "cuda":
        return f"tensors on {device}, not a CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}; PDL needs sm_90+"
    try:
        from triton.language.extra import cuda as tl_cuda
    except ImportError as e:
        return f"triton.language.extra.cuda unavailable ({e})"
    if not (hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents")):
        return "this Triton build has no tl.extra.cuda.gdc_wait / gdc_launch_dependents"
    return None


def choose_launch(op: str, device: torch.device) -> bool:
    """Whether `op`'s dependent kernel is launched by PDL (True) or in plain stream order (False), from the
    knob `pdl` (kernels.pdl / RLFP8_PDL); records "<op>.launch" = pdl | stream. pdl=on where PDL cannot run
    raises, naming the knob and the reason."""
    mode = knobs().pdl
    why = None if mode == "off" else _pdl_unavailable_once(device)
    if mode == "on" and why is not None:
        raise RuntimeError(f"rlfp8.kernels.{op}: kernel knob pdl=on (kernels.pdl / RLFP8_PDL) but {why}; "
                           "use pdl=auto or off")
    use = mode != "off" and why is None
    record(f"{op}.launch", "pdl" if use else "stream")
    return use


# (device, interpreter on) -> pdl_unavailable's answer: a device's capability and this Triton build do not change
# within a process, and the GPU answer cost a device-properties query and an import per projection call
_pdl_why: dict[tuple[torch.device, bool], str | None] = {}


def _pdl_unavailable_once(device) -> str | None:
    key = (device if isinstance(device, torch.device) else torch.device(device), triton_interpreting())
    try:
        return _pdl_why[key]
    except KeyError:
        why = _pdl_why[key] = pdl_unavailable(key[0])
        return why


def reset_pdl_cache() -> None:
    """Forget the per-device PDL answers (tests that fake a GPU or patch pdl_unavailable)."""
    _pdl_why.clear()


_record_sink: list | None = None           # launch_plan.capture: the records of the call it watches


def record(op: str, path: str) -> None:
    if _ran[op][path] == 0:
        log.info("rlfp8.kernels: %s runs on %s", op, path)
    _ran[op][path] += 1
    if _record_sink is not None:
        _record_sink.append((op, path))


def replay_records(pairs) -> None:
    """The records of a replayed launch plan (rlfp8.kernels.launch_plan): the same counts as its call made."""
    for op, path in pairs:
        _ran[op][path] += 1


def report() -> dict[str, dict[str, int]]:
    return {op: dict(paths) for op, paths in _ran.items()}


def reset_report() -> None:
    _ran.clear()
