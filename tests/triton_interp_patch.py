"""Test-only fixes for the Triton CPU interpreter (TRITON_INTERPRET=1); adapted from
docs/examples/interp_patch.py (see docs/triton-and-cpu-facts.md §1 for the measured bugs).

Without it the interpreter (triton 3.6/3.7) casts fp32 -> e4m3 wrongly (ties away from zero, mantissa
carry into the exponent, no saturation), truncates fp32 -> bf16 (RTZ instead of RNE), and multiplies the
uint16 bit patterns of bf16 operands in tl.dot. The patch routes those conversions through torch (RNE,
saturating e4m3fn like PTX cvt.rn.satfinite) and widens bf16/fp8 dot operands to fp32 before np.matmul.
Only the interpreter is touched; compiled GPU code never sees this module.
"""
from __future__ import annotations

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter as _I

_TL2TORCH = {
    tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2,
    tl.bfloat16: torch.bfloat16, tl.float16: torch.float16,
    tl.float32: torch.float32, tl.float64: torch.float64,
}
_applied = False


def _to_torch(data, tdt):
    t = torch.from_numpy(np.ascontiguousarray(data))
    return t.view(tdt) if t.dtype != tdt else t


def _from_torch(t):
    # The interpreter stores fp8 as uint8 and bf16 as uint16 bit patterns.
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t = t.view(torch.uint8)
    elif t.dtype == torch.bfloat16:
        t = t.view(torch.uint16)
    return t.numpy()


def _torch_convert(src, dst_type):
    ts, td = _TL2TORCH.get(src.dtype.scalar), _TL2TORCH.get(dst_type.scalar)
    if ts is None or td is None:
        return None
    out = _to_torch(src.data, ts).to(td)
    return _I.TensorHandle(_from_torch(out).reshape(src.data.shape), dst_type.scalar)


_orig_fp_to_fp = _I.InterpreterBuilder.create_fp_to_fp
_orig_cast_impl = _I.InterpreterBuilder.cast_impl
_orig_dot = _I.InterpreterBuilder.create_dot


def _create_fp_to_fp(self, src, dst_type, rounding_mode):
    if rounding_mode in (None, _I._ir.ROUNDING_MODE.RTNE):
        r = _torch_convert(src, dst_type)
        if r is not None:
            return r
    return _orig_fp_to_fp(self, src, dst_type, rounding_mode)


def _cast_impl(self, src, dst_type):
    s, d = src.dtype.scalar, dst_type.scalar
    if tl.bfloat16 in (s, d) and s.is_floating() and d.is_floating():
        r = _torch_convert(src, dst_type)
        if r is not None:
            return r
    return _orig_cast_impl(self, src, dst_type)


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    def f32(h):
        sc = h.dtype.scalar
        if sc == tl.bfloat16 or (sc.is_floating() and sc.primitive_bitwidth == 8):
            return _I.TensorHandle(_from_torch(_to_torch(h.data, _TL2TORCH[sc]).float()), tl.float32)
        return h
    return _orig_dot(self, f32(a), f32(b), d, input_precision, max_num_imprecise_acc)


def apply() -> None:
    """Idempotent; call before the first interpreted launch."""
    global _applied
    if _applied:
        return
    _I.InterpreterBuilder.create_fp_to_fp = _create_fp_to_fp
    _I.InterpreterBuilder.cast_impl = _cast_impl
    _I.InterpreterBuilder.create_dot = _create_dot
    _applied = True
