"""K1's plain-torch reference, its output type and the argument checks both K1 paths share (no Triton):
h[l, rows of slot s] = x[rows] · A_l[s]ᵀ in fp32 (+ the W8A8 activation quantization); the contract and
shapes are in rlfp8/kernels/shrink_triton.py's docstring."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton_utils import check_tensor, stacked_view
from .fp8_ref import ACT_ROUNDING, quantize_activation_ref
from .metadata import LoRAMeta

OP = "lora_shrink"


@dataclass
class ShrinkOut:
    h: torch.Tensor                       # [L, T, r] fp32
    x_q: torch.Tensor | None = None       # [T, K] float8_e4m3fn (W8A8)
    x_scale: torch.Tensor | None = None   # [T, 1] fp32 (W8A8)
    workspace: torch.Tensor | None = None # K1's split-K partials (Triton); keep alive while K2 may run beside K1



def a_slices(A) -> list[torch.Tensor]:
    return list(A) if isinstance(A, (list, tuple)) else [A]


def check_lora_shrink_args(x, A_list, meta, quant, out):
    check_tensor(OP, "x", x, ndim=2, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    M, K = x.shape
    if not 1 <= len(A_list) <= 3:
        raise ValueError(f"rlfp8.kernels.{OP}: 1 to 3 A slices are supported, got {len(A_list)}")
    A3 = [stacked_view(OP, f"A[{i}]", a, K) for i, a in enumerate(A_list)]
    for i, a in enumerate(A3):
        check_tensor(OP, f"A[{i}]", a, dtypes=(x.dtype,), device=x.device)
        if a.shape != A3[0].shape:
            raise ValueError(f"rlfp8.kernels.{OP}: every A slice must have the shape of A[0] "
                             f"{tuple(A3[0].shape)}, A[{i}] has {tuple(a.shape)}")
    if quant is not None and quant not in ACT_ROUNDING:
        raise ValueError(f"rlfp8.kernels.{OP}: quant {quant!r}: allowed values are None, {ACT_ROUNDING}")
    if meta is not None:
        meta.validate(OP, M)
        if meta.max_loras > A3[0].shape[0]:
            raise ValueError(f"rlfp8.kernels.{OP}: metadata has {meta.max_loras} slots but A has "
                             f"{A3[0].shape[0]} (shape {tuple(A3[0].shape)})")
    r = A3[0].shape[1]
    if out is not None:
        check_tensor(OP, "out", out, shape=(len(A3), M, r), dtypes=(torch.float32,), device=x.device)
    return A3


def lora_shrink_ref(x: torch.Tensor, A, meta: LoRAMeta | None = None, quant: str | None = None,
                    out: torch.Tensor | None = None) -> ShrinkOut:
    """Plain torch: h[l, rows of slot s] = x[rows] @ A_l[s]ᵀ in fp32; other rows of `out` untouched."""
    A3 = check_lora_shrink_args(x, a_slices(A), meta, quant, out)
    M, K = x.shape
    r = A3[0].shape[1]
    h = out if out is not None else torch.zeros((len(A3), M, r), dtype=torch.float32, device=x.device)
    slots = torch.zeros(M, dtype=torch.long, device=x.device) if meta is None else meta.token_lora_mapping.long()
    xf = x.float()
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        rows = (slots == s).nonzero().squeeze(1)
        for l, a in enumerate(A3):
            h[l, rows] = xf[rows] @ a[s].float().t()
    xq = xs = None
    if quant is not None:
        xq, xs = quantize_activation_ref(x, quant)
    return ShrinkOut(h, xq, xs)
