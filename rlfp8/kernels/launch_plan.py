"""Host launch plans: one call of a launcher chain (e.g. the engine projection: K1 + K2) recorded once and replayed,
so that a repeated call with the same key skips its argument checks, config choice and argument building and
only allocates its buffers and issues the same launches (same kernels, grids, arguments, dispatch records).

`capture(inputs)` runs the chain once while watching it:
  * every aten op it runs (a TorchDispatchMode): only buffer allocations (torch.empty), views and CPU scalar reads
    are allowed; any other op (a fill, a copy, a computation: the torch reference path, a `contiguous()` copy,
    zeroed buffers) makes the call not replayable, since a replay would not redo it;
  * every Triton launch (`_triton_utils.launch`) and every dispatch record.
Each tensor argument of a launch is then, by identity, one of the per-call `inputs` (replaced by the replay's), a
buffer allocated in the call or a view of one (allocated anew per replay: same shape, dtype, strides), a TMA
descriptor over either of those (rebuilt), or a tensor that existed before the call (a layer's weights and
adapters, the cached split-K counters): kept as recorded. A tensor made in the call by anything else makes the
call not replayable. Which key makes two calls equivalent is the caller's (rlfp8.rollout.lora_layers): it must
name everything the chain reads besides the inputs' contents and the pre-existing tensors.
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import _triton_utils, dispatch

_aten = torch.ops.aten
_ALLOC_OPS = {_aten.empty.memory_format}
_VIEW_OPS = {_aten.view.default, _aten._unsafe_view.default, _aten.slice.Tensor, _aten.select.int,
             _aten.unsqueeze.default, _aten.squeeze.dim, _aten.t.default, _aten.transpose.int,
             _aten.permute.default, _aten.expand.default, _aten.as_strided.default, _aten.alias.default,
             _aten.detach.default, _aten._reshape_alias.default}
_READ_OPS = {_aten._local_scalar_dense.default, _aten.is_nonzero.default}
_INPUT, _ALLOC, _ALLOC_VIEW, _TMA = range(4)


class _Watch(TorchDispatchMode):
    """Records the tensors the watched call allocates and makes; notes the first op a replay could not redo."""

    def __init__(self, readable: tuple):
        super().__init__()
        self.readable = {id(t) for t in readable}
        self.allocs: list[torch.Tensor] = []
        self.made: dict[int, torch.Tensor] = {}
        self.why: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOC_OPS:
            self.allocs.append(out)
        elif func in _READ_OPS:
            if id(args[0]) not in self.readable and self.why is None:    # a value the caller's key does not name
                self.why = f"reads the value of a tensor {tuple(args[0].shape)}"
        elif func not in _VIEW_OPS and self.why is None:
            self.why = f"runs {func}"
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.made[id(t)] = t
        return out


class LaunchPlan:
    """The recorded launches of one call, replayable with new inputs (see the module docstring)."""

    def __init__(self, allocs, launches, records, result):
        self.allocs = allocs            # [(shape, dtype, device)] of the per-call buffers, contiguous
        self.launches = launches        # [(kernel, grid, template args, [(position, kind, ref)], kwargs)]
        self.records = records          # [(op, path)] dispatch records of the call
        self.result = result            # index of the buffer the call returned

    def replay(self, inputs: tuple) -> torch.Tensor:
        bufs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in self.allocs]
        for kernel, grid, template, subs, kwargs in self.launches:
            args = list(template)
            for pos, kind, ref in subs:
                args[pos] = _resolve(kind, ref, inputs, bufs)
            _triton_utils.launch(kernel, grid, *args, **kwargs)
        dispatch.replay_records(self.records)
        return bufs[self.result]


def _resolve(kind, ref, inputs, bufs):
    if kind == _INPUT:
        return inputs[ref]
    if kind == _ALLOC:
        return bufs[ref]
    if kind == _ALLOC_VIEW:
        i, shape, stride, offset = ref
        return bufs[i].as_strided(shape, stride, offset)
    desc_type, base_kind, base_ref, fields = ref
    return desc_type(base=_resolve(base_kind, base_ref, inputs, bufs), **fields)


class _Capture:
    def __init__(self, inputs: tuple, readable: tuple):
        self.inputs = inputs
        self.watch = _Watch(readable)
        self.launches: list = []
        self.records: list = []
        self.why: str | None = None

    def plan(self, result) -> LaunchPlan | None:
        """The plan of the captured call that returned `result`, or None (self.why says why)."""
        w = self.watch
        if w.why is None and not self.launches:
            w.why = "no Triton launch"
        if w.why is None and len({id(t) for t in self.inputs}) != len(self.inputs):
            w.why = "an input passed twice (a replay could not tell which position it fills)"
        if w.why is not None:
            self.why = w.why
            return None
        allocs = {t.untyped_storage().data_ptr(): i for i, t in enumerate(w.allocs)}
        if len(allocs) != len(w.allocs) or 0 in allocs or any(not t.is_contiguous() for t in w.allocs):
            self.why = "an empty or non-contiguous buffer"
            return None
        try:
            launches = [self._launch(rec, allocs) for rec in self.launches]
            result_spec = self._tensor(result, allocs)
        except _NotReplayable as e:
            self.why = str(e)
            return None
        if result_spec[0] != _ALLOC:
            self.why = "the result is not a buffer of the call"
            return None
        return LaunchPlan([(tuple(t.shape), t.dtype, t.device) for t in w.allocs], launches, self.records,
                          result_spec[1])

    def _launch(self, rec, allocs):
        kernel, grid, args, kwargs = rec
        if any(isinstance(v, torch.Tensor) or hasattr(v, "block_shape") for v in kwargs.values()):
            raise _NotReplayable("a tensor keyword argument")
        template, subs = list(args), []
        for pos, a in enumerate(args):
            spec = self._arg(a, allocs)
            if spec is not None:
                subs.append((pos, *spec))
                template[pos] = None
        return kernel, grid, tuple(template), subs, dict(kwargs)

    def _arg(self, a, allocs):
        """(kind, ref) for an argument the replay replaces, None for one kept as recorded."""
        if isinstance(a, torch.Tensor):
            spec = self._tensor(a, allocs)
            return None if spec[0] is None else spec
        if hasattr(a, "block_shape") and hasattr(a, "base"):        # a TensorDescriptor (Triton's or Gluon's)
            kind, ref = self._tensor(a.base, allocs)
            if kind is None:
                return None
            if not dataclasses.is_dataclass(a):
                raise _NotReplayable(f"a tensor descriptor {type(a).__name__} that is not a dataclass")
            fields = {f.name: getattr(a, f.name) for f in dataclasses.fields(a) if f.name != "base"}
            return _TMA, (type(a), kind, ref, fields)       # every field: Gluon's also has its smem layout
        return None

    def _tensor(self, t, allocs):
        for i, inp in enumerate(self.inputs):
            if t is inp:
                return _INPUT, i
        if id(t) not in self.watch.made or self.watch.made[id(t)] is not t:
            return None, None                                   # existed before the call: kept
        i = allocs.get(t.untyped_storage().data_ptr())
        if i is None:
            raise _NotReplayable(f"a tensor {tuple(t.shape)} {t.dtype} made in the call from no buffer of it")
        buf = self.watch.allocs[i]
        if t is buf or (t.shape == buf.shape and t.stride() == buf.stride() and t.storage_offset() == 0
                        and t.dtype == buf.dtype):                  # an alias of the whole buffer is the buffer
            return _ALLOC, i
        return _ALLOC_VIEW, (i, tuple(t.shape), tuple(t.stride()), t.storage_offset())


class _NotReplayable(Exception):
    pass


@contextmanager
def capture(inputs: tuple, readable: tuple = ()):
    """Watch one call (module docstring); then `.plan(result)` gives its LaunchPlan or None (`.why`). `readable`:
    the CPU tensors whose values the call may read (.item()): the caller's key holds them; reading any other makes
    the call not replayable."""
    cap = _Capture(inputs, readable)
    if _triton_utils._launch_sink is not None or dispatch._record_sink is not None:
        raise RuntimeError("rlfp8.kernels.launch_plan.capture: captures do not nest")
    _triton_utils._launch_sink, dispatch._record_sink = cap.launches, cap.records
    try:
        with cap.watch:
            yield cap
    finally:
        _triton_utils._launch_sink = dispatch._record_sink = None
