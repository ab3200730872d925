"""DoRA's shared pieces below both of its paths (dora.py dispatches; dora_triton.py and the torch references
use these): op names, the base-tensor checks, g = m / n, and dm from the column dot."""
from __future__ import annotations

import torch

OP_NORM = "dora_norm_pieces"
OP_COLDOT = "dora_col_dot"
CHUNK_ELEMS = 1 << 22          # reference paths widen at most this many codes / products at a time (16 MiB fp32)
NORM_PRECISIONS = ("bf16x2", "ieee")



def _check_base(q, scale, A=None):
    if q.dim() != 2 or q.dtype != torch.float8_e4m3fn:
        raise TypeError(f"rlfp8.kernels.dora: q must be float8_e4m3fn [N, K], got {q.dtype} {tuple(q.shape)}")
    if scale is None or scale.shape != (q.shape[0],) or scale.dtype != torch.float32:
        raise ValueError(f"rlfp8.kernels.dora: scale must be fp32 [N={q.shape[0]}], got "
                         f"{None if scale is None else (scale.dtype, tuple(scale.shape))}")
    if A is not None and (A.dim() != 2 or A.shape[1] != q.shape[1]):
        raise ValueError(f"rlfp8.kernels.dora: A must be [r, K={q.shape[1]}], got {tuple(A.shape)}")


def column_scale_from_norm(m: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """g = m / n in fp32 (differentiable in m, n detached), 0 where n = 0."""
    n = n.detach()
    return torch.where(n > 0, m.float() / torch.where(n > 0, n, torch.ones_like(n)), torch.zeros_like(n))


def dm_from_col_dot(dm_raw: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """dm = colsum(dy ⊙ (y − bias)) / m, 0 where m = 0 (module docstring of dora.py)."""
    nz = m != 0
    return torch.where(nz, dm_raw / torch.where(nz, m.float(), torch.ones_like(dm_raw)), torch.zeros_like(dm_raw))
