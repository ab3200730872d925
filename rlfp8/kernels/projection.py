"""The engine's projection (and the trainer's forward with meta=None and one adapter): K1 then K2."""
from __future__ import annotations

import torch

from . import dispatch
from .knobs import knobs
from .fp8 import ACT_ROUNDING, quantize_activation
from .gemm import lora_gemm
from .shrink import lora_shrink
from .shrink_ref import ShrinkOut
from .metadata import LoRAMeta


def fp8_lora_linear(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor, A=None, B=None,
                    meta: LoRAMeta | None = None, *, mode: str = "w8a16", rounding: str = "div", g=None,
                    bias=None, out_dtype=None, shrink_out: torch.Tensor | None = None,
                    x_quant: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One projection of the engine (or, with meta=None and one adapter, of the trainer's forward):
    x [T, K] bf16; q [N, K] e4m3 + w_scale [N]; A, B stacked slots (one tensor or per-slice tuples, vLLM
    layouts accepted; None = base only); meta from build_lora_meta or the engine's view of vLLM's metadata
    (None = slot 0 for every token). mode "w8a16" (x stays 16-bit) or "w8a8" (x quantized per token with `rounding`).
    shrink_out: a preallocated h buffer [L, T, r] fp32 (vLLM's); by default an uninitialised one, since K2
    never reads the rows of tokens without adapter (no memset launch).
    With Triton kernels K2 is launched as K1's programmatic dependent where the knob `pdl` allows it (same
    bits); dispatch records "lora_gemm.launch" = pdl | stream. With the knob k1_in_k2 (default: calls of <=
    k1_in_k2_tokens tokens, W8A16 <= k1_in_k2_w8a16_tokens) K1's shrink programs run instead as the first
    programs of K2's grid, K2 waiting on their counter before its epilogue (same bits; dispatch "lora_gemm.k1" =
    in_k2; W8A8 then quantizes x in its own kernel, K2 being its programmatic dependent with pdl_quant_k2, or takes
    the caller's codes).
    W8A8: where x is quantized (same codes everywhere; dispatch records "lora_gemm.x_quant"): "k2" = inside K2
    at <= k2_quant_x_tokens tokens (no quantizer launch; the knob is 0 by default, since the H200 measured it
    slower), "k1" = beside K1's shrink, "kernel" = by its own kernel before K1 (or before K2 without an adapter:
    with the knob pdl_quant_k2, K2 is then the quantizer's programmatic dependent), "graph" = by the caller, who
    passes x_quant = (codes [T, K] e4m3, scales [T, 1] fp32) beside x (the engine's compiled graph, where Inductor
    fuses the quantization into the kernel that produced x; K1 then reads x only for its shrink, and K2's main loop
    needs nothing of K1's)."""
    if mode not in ("w8a16", "w8a8"):
        raise ValueError(f"rlfp8.kernels.fp8_lora_linear: mode {mode!r}: allowed 'w8a16', 'w8a8'")
    if (A is None) != (B is None):
        raise ValueError("rlfp8.kernels.fp8_lora_linear: pass both A and B, or neither")
    quant = rounding if mode == "w8a8" else None
    if quant is not None and quant not in ACT_ROUNDING:
        raise ValueError(f"rlfp8.kernels.fp8_lora_linear: rounding {rounding!r}: allowed {ACT_ROUNDING}")
    if x_quant is not None:
        _check_x_quant(x, x_quant, mode)
    h = None
    x_in, x_scale = x, None
    adapter_tokens = A is not None and not (meta is not None and meta.no_lora)
    quant_here = quant is not None and x_quant is None       # W8A8 codes still to make (not the caller's)
    kn = knobs()
    quant_in_k2 = quant_here and x.shape[0] <= kn.k2_quant_x_tokens
    out_dtype = out_dtype or (x.dtype if x.dtype != torch.float32 else torch.bfloat16)
    # knob k1_in_k2: K1's shrink programs run first in K2's grid (one launch; K2 waits on their counter before its
    # epilogue)
    k1_in_k2_limit = min(kn.k1_in_k2_tokens, kn.k1_in_k2_w8a16_tokens) if mode == "w8a16" else kn.k1_in_k2_tokens
    k1_in_k2 = (adapter_tokens and not quant_in_k2 and x.shape[0] <= k1_in_k2_limit
                and (kn.k1_in_k2 == "on" or (kn.k1_in_k2 == "w8a8" and mode == "w8a8"))
                and dispatch.would_choose("lora_shrink", x) == "triton"
                and dispatch.would_choose("lora_gemm", x, q) == "triton")
    # no K1 launch to overlap (no adapter token, or K1 inside K2's grid; knob pdl_quant_k2): K2 is the quantizer's
    # programmatic dependent instead, its launch and the L2 prefetch of its weight rows overlapping the quantizer
    chain_quant = (not adapter_tokens or k1_in_k2) and quant_here and not quant_in_k2 and kn.pdl_quant_k2
    use_pdl = _use_pdl(x, q, (adapter_tokens and not k1_in_k2) or chain_quant)
    # K1 quantizes x beside its shrink, except under PDL with pdl_w8a8_quant=separate: then the quantizer runs
    # first, in stream order (the same codes), and K2's main loop needs nothing of K1's (it waits only before the
    # epilogue reads h); without an adapter there is no K1, and K1 inside K2's grid only shrinks
    quant_in_k1 = (quant_here and A is not None and not quant_in_k2 and not chain_quant and not k1_in_k2
                   and not (use_pdl and kn.pdl_w8a8_quant == "separate"))
    x_from_primary = quant_in_k1 or chain_quant       # K2 then waits before its main loop reads x_q
    if quant is not None:
        dispatch.record("lora_gemm.x_quant", "graph" if not quant_here else "k2" if quant_in_k2
                        else "k1" if quant_in_k1 else "kernel")
    if x_quant is not None:
        x_in, x_scale = x_quant
    elif quant_here and not quant_in_k1 and not quant_in_k2:
        x_in, x_scale = quantize_activation(x, quant, use_pdl=use_pdl and chain_quant)
    if use_pdl:
        dispatch.record("lora_gemm.pdl_wait", "main_loop" if x_from_primary else "epilogue")
    if A is not None and shrink_out is None:
        L = len(A) if isinstance(A, (list, tuple)) else 1
        r = (A[0] if isinstance(A, (list, tuple)) else A).shape[-2]
        shrink_out = torch.empty((L, x.shape[0], r), dtype=torch.float32, device=x.device)
    gemm_kw = {"x_from_primary": x_from_primary} if use_pdl else {}
    if k1_in_k2:
        from .shrink_triton import shrink_programs
        dispatch.choose("lora_shrink", x)                     # records the Triton path: its programs run in K2
        gemm_kw["shrink"] = shrink_programs(x, A, meta, out=shrink_out, mode=mode)
        h = shrink_out
    elif A is not None:
        # `so` stays referenced until K2 is enqueued: with PDL, K2 runs beside K1, so K1's split-K workspace
        # must not go back to the allocator (and become K2's buffers) before then
        so: ShrinkOut = lora_shrink(x, A, meta, quant=quant if quant_in_k1 else None, out=shrink_out,
                                    use_pdl=use_pdl and adapter_tokens, mode=mode)
        h = so.h
        if quant_in_k1:
            x_in, x_scale = so.x_q, so.x_scale
    if quant_in_k2:
        gemm_kw["quantize_x"] = quant
    y = lora_gemm(x_in, q, w_scale, x_scale=x_scale, h=h, B=B, meta=meta, g=g, bias=bias, use_pdl=use_pdl,
                  out_dtype=out_dtype, **gemm_kw)
    return y


def _check_x_quant(x: torch.Tensor, x_quant, mode: str) -> None:
    x_q, x_s = x_quant
    if mode != "w8a8":
        raise ValueError(f"rlfp8.kernels.fp8_lora_linear: x_quant is for mode 'w8a8', got mode {mode!r}")
    if x_q.shape != x.shape or x_q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"rlfp8.kernels.fp8_lora_linear: x_quant codes must be float8_e4m3fn of x's shape "
                         f"{tuple(x.shape)}, got {x_q.dtype} {tuple(x_q.shape)}")
    if x_s.shape != (x.shape[0], 1) or x_s.dtype != torch.float32:
        raise ValueError(f"rlfp8.kernels.fp8_lora_linear: x_quant scales must be float32 [{x.shape[0]}, 1], "
                         f"got {x_s.dtype} {tuple(x_s.shape)}")


def _use_pdl(x, q, primary: bool) -> bool:
    """K2 as a programmatic dependent: only on the Triton path, and only where a primary kernel (K1's shrink, or
    the quantizer) triggers the launch; otherwise K2 follows in stream order (recorded either way)."""
    if dispatch.would_choose("lora_gemm", x, q) != "triton":
        return False
    if not primary:
        dispatch.record("lora_gemm.launch", "stream")
        return False
    return dispatch.choose_launch("lora_gemm", x.device)
