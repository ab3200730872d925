"""The fp64 oracles of the kernel ops, shared by the CPU tests (tests/unit, tests/kernel) and the GPU tests
(tests/gpu): the math of docs/DESIGN.md's contracts written out in float64, independent of the package's
torch references (which the tests check against these, like the Triton kernels).

  quant_scale_fp64        max(amax_row / 448, MIN_SCALE) with an IEEE fp32 division
  quant_codes_fp64        the e4m3 codes of x / scale (div) within +-448
  shrink_fp64       (K1)  h[l, t] = x[t] · A_l[slot(t)]ᵀ
  gemm_fp64         (K2)  g[slot] ⊙ ((s_x ·) s_w ⊙ x·qᵀ + h·B_slotᵀ per slice) + bias (rows of slot -1: base only)
  lora_linear_fp64        the training linear's forward and its gradients (dx, dA, dB)
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0
MIN_SCALE = float(torch.tensor(1.0 / (448.0 * 512.0), dtype=torch.float32))


def quant_scale_fp64(x: torch.Tensor) -> torch.Tensor:
    """Per-row scale [rows] fp32: the fp64 quotient of two fp32 numbers rounded to fp32 is the IEEE fp32
    quotient (53 >= 2·24 + 2, no double-rounding error)."""
    amax = x.abs().amax(dim=-1).double()
    return torch.clamp((amax / FP8_MAX).float(), min=MIN_SCALE)


def quant_codes_fp64(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 codes [rows, K] of x / scale[:, None] (division in fp64, then one rounding), clamped to +-448."""
    y = torch.clamp(x.double() / scale.double().reshape(-1, 1), -FP8_MAX, FP8_MAX)
    return y.float().to(torch.float8_e4m3fn)


def _rows_of(slots: torch.Tensor | None, M: int, device) -> dict[int, torch.Tensor]:
    """{slot: row indices} for slots >= 0; slots=None means every row uses slot 0 (the trainer)."""
    if slots is None:
        return {0: torch.arange(M, device=device)}
    return {s: (slots == s).nonzero().squeeze(1) for s in torch.unique(slots).tolist() if s >= 0}


def shrink_fp64(x: torch.Tensor, A: list[torch.Tensor], slots: torch.Tensor | None) -> torch.Tensor:
    """h [L, T, r] fp64 for slices A_l [S, r, K]; rows of tokens without adapter are 0."""
    h = torch.zeros(len(A), x.shape[0], A[0].shape[-2], dtype=torch.float64, device=x.device)
    for s, rows in _rows_of(slots, x.shape[0], x.device).items():
        for i, a in enumerate(A):
            h[i, rows] = x[rows].double() @ a[s].double().t()
    return h


def gemm_fp64(x, q, w_scale, *, x_scale=None, h=None, B=None, slots=None, g=None, bias=None) -> torch.Tensor:
    """K2 [M, N] fp64. x: 16-bit or e4m3 codes (with x_scale [M, 1]); q [N, K] codes; w_scale [N] or None;
    h [L, M, r] and B: L slices [S, N_l, r] (s folded in), concatenated over N; g [S, N]; bias [N]."""
    acc = x.double() @ q.double().t()
    if w_scale is not None:
        acc = acc * w_scale.double()[None, :]
    if x_scale is not None:
        acc = acc * x_scale.double().reshape(-1, 1)
    if B is not None:
        offs = [0]
        for b in B:
            offs.append(offs[-1] + b.shape[1])
        for s, rows in _rows_of(slots, x.shape[0], x.device).items():
            for i, b in enumerate(B):
                acc[rows, offs[i]:offs[i + 1]] += h[i, rows].double() @ b[s].double().t()
            if g is not None:
                acc[rows] *= g[s].double()[None, :]
    if bias is not None:
        acc = acc + bias.double()[None, :]
    return acc


def lora_linear_fp64(x, q, w_scale, A, B, lora_scale: float, bias, dy):
    """(y, dx, dA, dB) in fp64 for y = x·(s_w ⊙ q)ᵀ + (x·A_cᵀ)·B_cᵀ + bias with the contract's operand
    roundings A_c = A.to(x.dtype), B_c = (s·B).to(x.dtype) (their gradients flow as through A and s·B)."""
    W64 = q.double() * w_scale.double()[:, None]
    x64 = x.detach().double().requires_grad_()
    A64 = A.detach().double().requires_grad_()
    B64 = B.detach().double().requires_grad_()
    s = lora_scale
    Ac = A64 + (A.detach().to(x.dtype).double() - A64).detach()
    Bc = s * B64 + ((B.detach() * s).to(x.dtype).double() - s * B64).detach()
    y64 = x64 @ W64.t() + (x64 @ Ac.t()) @ Bc.t() + (0 if bias is None else bias.double())
    y64.backward(dy.double())
    return y64.detach(), x64.grad, A64.grad, B64.grad
