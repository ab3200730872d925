#!/usr/bin/env python
"""Benchmark of rlfp8.kernels against vLLM 0.26's LoRA path on one Qwen3-8B decoder layer (issue 3 item 6).

Measured (CUDA graphs; before every replay a 512 MiB buffer is zeroed to flush L2; median of --reps >= 50;
ours and its baseline are captured as two graphs replayed in turn, so both see the same clocks/temperature):
  layer  : the four projections qkv 4096->6144 (3 slices), o 4096->4096, gate_up 4096->24576 (2 slices),
           down 12288->4096, captured together in one graph, at M in {1, 4, 16, 64, 256, 2048} tokens,
           with 0, 1 and 32 rank-64 adapters (1: every token on slot 0; 32: tokens round-robin over 32 slots,
           decode-like interleaving):
             ours W8A8   = K1 (per-token quant + shrink) + K2 (FP8 GEMM + LoRA epilogue), per projection
             vLLM W8A8   = dynamic_per_token_scaled_fp8_quant + cutlass_scaled_mm + lora_shrink + lora_expand
                           (vLLM's own ops, its LoRAKernelMeta, its stacked buffers; ours reads the same buffers)
             ours W8A16  = K1 (shrink) + K2 (W8A16), baseline: ours W8A8
  gemm   : the base GEMM alone per projection: ours K2 W8A8 on x_q vs cutlass_scaled_mm; ours W8A16 vs ours W8A8
  train  : the training linear forward+backward (x, A, B trainable) at 8x1024 tokens on each projection:
           ours (FP8 codes, Triton) vs PEFT-style bf16 LoRA (F.linear on a bf16 weight + LoRA autograd, bf16
           adapters), with torch.cuda memory counters (no bf16 weight copy on our side).
Without an importable vLLM the W8A8 baselines are torch._scaled_mm (row-wise scales) and plain torch LoRA
matmuls (1 adapter only), and the JSON says so.

--tune first times a few GemmConfigs per (mode, token bucket, K, N class) on the base GEMM, keeps the
fastest whose output matches the default config's, and writes rlfp8/kernels/tuned/<gpu>.json, which the
kernels load from then on. All Triton kernels are compiled up front in parallel worker processes.

    python bench/kernel_bench.py --tune          # < 8 min on an H200; writes bench/results/kernels_h200.json
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import json
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from rlfp8.kernels import _triton_utils as tu  # noqa: E402
from rlfp8.kernels import dispatch, gemm_configs as lg  # noqa: E402
from rlfp8.kernels.fp8_triton import quantize_activation_triton, quantize_weight_triton  # noqa: E402
from rlfp8.kernels.linear_triton import dy_prep_triton, lora_linear_triton  # noqa: E402
from rlfp8.kernels.projection import fp8_lora_linear  # noqa: E402
from rlfp8.kernels.gemm_configs import GemmConfig  # noqa: E402
from rlfp8.kernels.gemm_triton import lora_gemm_triton  # noqa: E402
from rlfp8.kernels.metadata import build_lora_meta  # noqa: E402
from rlfp8.rollout.vllm_lora_meta import lora_meta_from_vllm  # noqa: E402

PROJ = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (12288, 12288)),
        "down": (12288, (4096,))}        # Qwen3-8B; --shape rebinds it (projection_shapes)
MS = (1, 4, 16, 64, 256, 2048)
RANK = 64
TRAIN_TOKENS = 8 * 1024
DEV = "cuda"
T0 = time.time()


def projection_shapes(arch: str) -> dict:
    """(K, output widths) of one decoder layer's four projections from the architecture's HF config
    (rlfp8/models/<arch>.json, the shapes model.path=random:<arch> builds)."""
    from rlfp8.models import architecture_config
    c = architecture_config(arch)
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    return {"qkv": (hidden, (q, kv, kv)), "o": (q, (hidden,)), "gate_up": (hidden, (inter, inter)),
            "down": (inter, (hidden,))}


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------ timing
class Timer:
    def __init__(self, reps: int):
        self.reps = reps
        self.flush = torch.empty(512 * 2**20, dtype=torch.uint8, device=DEV)

    def graph_us(self, fn, reps: int | None = None, before_capture=None) -> float:
        """Median µs of one replay of a CUDA graph of fn(), L2 flushed before each replay."""
        return self.paired_us([fn], reps, [before_capture])[0]

    def paired_us(self, fns, reps: int | None = None, before_captures=None) -> list[float]:
        """Median µs per replay of a CUDA graph of each fn, the graphs replayed in turn (a, b, a, b, ...;
        L2 flushed before each replay), so that arms compared with each other see the same clocks and
        temperature (measured one after the other, the first arm of a pair ran on a cooler GPU)."""
        reps = reps or self.reps
        before_captures = before_captures or [None] * len(fns)
        graphs = [self._capture(fn, bc) for fn, bc in zip(fns, before_captures)]
        times = [[] for _ in fns]
        for i in range(reps + 3):
            for g, t in zip(graphs, times):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                self.flush.zero_()
                a.record()
                g.replay()
                b.record()
                t.append((a, b, i >= 3))
        torch.cuda.synchronize()
        out = [statistics.median(a.elapsed_time(b) * 1e3 for a, b, keep in t if keep) for t in times]
        del graphs
        return out

    def _capture(self, fn, before_capture=None) -> torch.cuda.CUDAGraph:
        fn()                                               # compile / allocate workspaces outside capture
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            if before_capture:
                before_capture()
            fn()
        torch.cuda.current_stream().wait_stream(s)
        if before_capture:
            before_capture()                               # e.g. grads to None: no accumulation captured
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g


# ------------------------------------------------------------------------------------------------ vLLM
class VLLM:
    def __init__(self):
        self.ok, self.reason, self.version = False, "", None
        try:
            import vllm
            import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
            from vllm.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink
            self.version = vllm.__version__
            self.quant = torch.ops._C.dynamic_per_token_scaled_fp8_quant
            self.cutlass = torch.ops._C.cutlass_scaled_mm
            self.shrink, self.expand, self.Meta = lora_shrink, lora_expand, LoRAKernelMeta
            self.ok = True
        except Exception as e:
            self.reason = f"{type(e).__name__}: {e}"

    def meta(self, slots: torch.Tensor, max_loras: int):
        params = inspect.signature(self.Meta.make).parameters
        kw = {"captured_lora_counts": None} if "captured_lora_counts" in params else {}
        m = self.Meta.make(max_loras, max(MS + (TRAIN_TOKENS,)), DEV, **kw)
        m.prepare_tensors(slots)
        return m

    def meta_args(self, m, T: int):
        # specialize_active_lora=True: the grid covers only the active adapters (vLLM's cheaper setting)
        return m.meta_args(T, True) if len(inspect.signature(m.meta_args).parameters) >= 2 else m.meta_args(T)


# ------------------------------------------------------------------------------------------------ problem
class Layer:
    def __init__(self, vl: VLLM):
        g = torch.Generator(device=DEV).manual_seed(0)
        self.w = {}
        for name, (K, widths) in PROJ.items():
            w = torch.randn(sum(widths), K, device=DEV, dtype=torch.bfloat16, generator=g) * 0.02
            q, sw = quantize_weight_triton(w)
            self.w[name] = (q, sw, sw[:, None].contiguous())
            del w
        self.ad = {}
        for S in (1, 32):                     # vLLM's stacked LoRA buffers [S, 1, r, K] / [S, 1, N_l, r]
            self.ad[S] = {name: (tuple(torch.randn(S, 1, RANK, K, device=DEV, generator=g).mul_(0.02)
                                       .to(torch.bfloat16) for _ in widths),
                                 tuple(torch.randn(S, 1, n, RANK, device=DEV, generator=g).mul_(0.02)
                                       .to(torch.bfloat16) for n in widths))
                          for name, (K, widths) in PROJ.items()}
        Ks = sorted({K for K, _ in PROJ.values()})
        extra = [M for M in tune_ms().values() if M not in (*MS, TRAIN_TOKENS)]     # drawn last: MS's inputs kept
        self.x = {M: {K: torch.randn(M, K, device=DEV, dtype=torch.bfloat16, generator=g) for K in Ks}
                  for M in (*MS, TRAIN_TOKENS, *extra)}
        self.xq = {M: {K: quantize_activation_triton(self.x[M][K]) for K in Ks} for M in self.x}
        self.vmeta, self.meta = {}, {}
        for M in MS:
            for S in (1, 32):
                slots = torch.zeros(M, dtype=torch.long, device=DEV) if S == 1 else \
                    torch.arange(M, device=DEV) % 32
                if vl.ok:
                    vm = vl.meta(slots, S)
                    self.vmeta[(M, S)] = vm
                    self.meta[(M, S)] = lora_meta_from_vllm(vm, M)           # zero-copy views of vLLM's tensors
                else:
                    self.meta[(M, S)] = build_lora_meta(slots, S)

    # ours -----------------------------------------------------------------------------------------------
    def ours_proj(self, name, M, S, mode):
        K = PROJ[name][0]
        q, sw, _ = self.w[name]
        x = self.x[M][K]
        if S == 0:
            return lambda: fp8_lora_linear(x, q, sw, mode=mode)
        A, B = self.ad[S][name]
        meta = self.meta[(M, S)]
        return lambda: fp8_lora_linear(x, q, sw, A, B, meta, mode=mode)

    def ours_gemm(self, name, M, mode, config=None):
        K = PROJ[name][0]
        q, sw, _ = self.w[name]
        if mode == "w8a8":
            xq, xs = self.xq[M][K]
            return lambda: lora_gemm_triton(xq, q, sw, x_scale=xs, config=config)
        x = self.x[M][K]
        return lambda: lora_gemm_triton(x, q, sw, config=config)

    # vLLM -------------------------------------------------------------------------------------------------
    def vllm_proj(self, vl: VLLM, name, M, S):
        K, widths = PROJ[name]
        q, _, sw2 = self.w[name]
        x = self.x[M][K]
        N = q.shape[0]
        A, B = self.ad[S][name] if S else (None, None)
        margs = vl.meta_args(self.vmeta[(M, S)], M) if S else None

        def run():
            xq = torch.empty(M, K, device=DEV, dtype=torch.float8_e4m3fn)
            xs = torch.empty(M, 1, device=DEV, dtype=torch.float32)
            vl.quant(xq, x, xs, None)
            y = torch.empty(M, N, device=DEV, dtype=torch.bfloat16)
            vl.cutlass(y, xq, q.t(), xs, sw2, None)
            if S:
                buf = torch.empty(len(widths), M, RANK, device=DEV, dtype=torch.float32)
                vl.shrink(x, A, buf, *margs, 1.0)
                vl.expand(buf, B, y, *margs, offset_start=0, add_inputs=True)
            return y
        return run

    def vllm_gemm(self, vl: VLLM, name, M):
        K = PROJ[name][0]
        q, _, sw2 = self.w[name]
        xq, xs = self.xq[M][K]
        N = q.shape[0]

        def run():
            y = torch.empty(M, N, device=DEV, dtype=torch.bfloat16)
            vl.cutlass(y, xq, q.t(), xs, sw2, None)
            return y
        return run

    # no-vLLM fallbacks ------------------------------------------------------------------------------------
    def torch_proj(self, name, M, S):
        K = PROJ[name][0]
        q, _, sw2 = self.w[name]
        x = self.x[M][K]
        A, B = self.ad[1][name] if S else (None, None)

        def run():
            xq, xs = quantize_activation_triton(x)
            y = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=sw2.t(), out_dtype=torch.bfloat16)
            if S:                            # one adapter: plain bf16 matmuls per slice
                h = torch.cat([x @ a[0, 0].t() for a in A], dim=1)
                y = y + torch.cat([h[:, i * RANK:(i + 1) * RANK] @ b[0, 0].t() for i, b in enumerate(B)], dim=1)
            return y
        return run

    def torch_gemm(self, name, M):
        K = PROJ[name][0]
        q, _, sw2 = self.w[name]
        xq, xs = self.xq[M][K]
        return lambda: torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=sw2.t(), out_dtype=torch.bfloat16)


def seq(fns):
    def run():
        for f in fns:
            f()
    return run


# ------------------------------------------------------------------------------------------------ tuning
def candidates(mode: str, bucket: int, N: int, K: int) -> list[GemmConfig]:
    """The heuristic config first, then the nearest tuned K's entry (the fallback), then a few tile shapes per
    bucket in both main-loop orientations (swap_ab: weight rows on the MMA's M side, the widened W8A16 tile as
    wgmma's register operand; or tokens on the M side, the weight tile through shared memory with 16-byte loads
    and the four-codes-per-register widening "prmt"), each with the split-K of the heuristic rule, twice it and
    (decode sizes) half of it, and with TMA weight loads. Configs that do not compile (too much shared memory) or
    produce a different output are skipped by the tuner."""
    fp8 = mode.startswith("w8a8")
    bk_big = 128 if fp8 else 64
    base = lg._heuristic(mode, bucket, N, K)
    raw = [base]
    table = lg.tuned_table_path()
    near = lg.nearest_tuned_config(json.loads(table.read_text()).get("gemm", {}), mode, bucket, N, K) \
        if table.exists() else None
    if near is not None:      # the table's entry (a tuned key) or the knob tuned_nearest's fallback (an untuned one)
        raw.append(near)
    # (block_n, block_m, block_k, warps, stages[, swap_ab]); block_n = weight rows, block_m = tokens
    if bucket <= 16:
        raw += [(64, 16, 256, 4, 6), (128, 16, 128, 4, 5), (64, 16, 128, 4, 6), (64, 16, 128, 4, 8),
                (128, 16, 128, 4, 4, False), (256, 16, 128, 4, 3, False), (128, 16, 256, 4, 3, False),
                (64, 16, 256, 4, 4, False),
                # decode tiles: tokens on M (mma.sync), 16-32 weight rows read in 512-1024-byte row chunks, so a
                # 4096-wide weight gets 128-256 programs without split-K; none won on the H200 in session 15
                # (bench/lab/explore_decode_tiles.py), kept so that a retune on another GPU times them
                (16, 16, 512, 4, 4, False), (16, 16, 1024, 4, 3, False), (32, 16, 256, 4, 6, False),
                (32, 16, 512, 4, 4, False), (32, 16, 1024, 4, 3, False), (64, 16, 512, 4, 4, False),
                (64, 16, 512, 4, 4)]
    elif bucket <= 32:
        raw += [(64, 32, 128, 4, 5), (128, 32, 128, 4, 4), (64, 32, 128, 4, 6), (128, 32, 128, 4, 4, False)]
    elif bucket <= 64:
        raw += [(64, 64, 128, 4, 4), (128, 64, 64, 4, 5), (128, 32, 128, 4, 4), (64, 64, 128, 4, 6),
                (64, 32, 128, 4, 6), (128, 64, 128, 4, 4, False), (256, 64, 64, 4, 4, False),
                (128, 64, 64, 4, 6, False), (64, 64, 128, 4, 6, False), (64, 64, 256, 4, 3), (64, 64, 128, 4, 3),
                (64, 64, 64, 4, 8), (128, 32, 128, 4, 4, False), (256, 32, 64, 4, 4, False),
                (128, 16, 128, 4, 4, False), (64, 16, 256, 4, 4, False),
                # two warpgroups, each widening its own 64 weight rows (more warps in flight per SM)
                (128, 64, 128, 8, 3), (128, 64, 64, 8, 4), (128, 32, 128, 8, 4), (256, 64, 64, 8, 3),
                (128, 64, 128, 8, 4)]
    elif bucket <= 256:
        raw += [(128, 128, bk_big, 4, 4), (64, 128, 128, 4, 4), (128, 256, bk_big, 8, 3), (64, 64, 128, 4, 4),
                (64, 128, bk_big, 4, 6), (128, 128, bk_big, 8, 4, False), (256, 64, bk_big, 4, 4, False),
                (128, 128, 128, 8, 3, False), (256, 128, 64, 8, 4, False), (128, 64, 128, 4, 4, False),
                (64, 256, bk_big, 4, 4), (64, 256, bk_big, 4, 3), (64, 128, bk_big, 4, 3), (128, 256, 64, 8, 4),
                (64, 128, 128, 4, 2), (64, 128, 64, 4, 4), (64, 128, 64, 4, 6), (128, 64, 128, 4, 3),
                (64, 128, 256, 4, 2), (64, 256, 64, 4, 3), (64, 256, 64, 4, 4), (128, 128, 64, 8, 3),
                (128, 128, 64, 4, 3), (64, 128, 64, 4, 3), (128, 256, 64, 8, 2),
                # the fastest plain TMA kernel of bench/lab/explore_w8a8.py (tokens on M, 5 stages)
                (128, 128, 128, 8, 5, False), (128, 128, 128, 8, 6, False)]
    else:
        raw += [(128, 128, bk_big, 8, 4), (256, 128, 64, 8, 3), (256, 128, 128, 8, 3) if fp8 else (128, 256, 64, 8, 4),
                (128, 128, 64, 8, 5), (256, 128, 64, 8, 4), (128, 256, bk_big, 8, 3, False),
                (256, 128, bk_big, 8, 3, False), (128, 128, 64, 8, 4, False), (256, 128, 64, 8, 4, False),
                (128, 256, 64, 8, 5), (128, 128, 128, 8, 3), (64, 256, 64, 4, 4), (128, 256, 128, 8, 2),
                # two programs per SM (<= ~110 KB of shared memory each): one widens while the other's MMAs run
                (64, 256, 64, 4, 3), (128, 128, 64, 4, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
                (64, 256, 64, 4, 2), (128, 128, 128, 4, 2)]
    out, seen = [], set()
    for c in raw:
        if isinstance(c, tuple):
            bn, bm, bk, nw, ns = c[:5]
            swap = c[5] if len(c) > 5 else True
            c = GemmConfig(bn, bm, bk, lg._split(bucket, N, K, bn, bm, bk), 8, nw, ns, swap_ab=swap,
                           widen="bits" if swap else "prmt")
        variants = [c]
        if bucket <= 256:                                  # other splits at decode / small-prefill sizes
            variants.append(dataclasses.replace(c, split_k=min(16, c.split_k * 2)))
            if bucket <= 64 and c.split_k > 1:
                variants.append(dataclasses.replace(c, split_k=max(1, c.split_k // 2)))
            if bucket <= 64:
                variants.append(dataclasses.replace(c, split_k=3))
        variants += [dataclasses.replace(v, w_tma=True) for v in variants]   # and each with TMA weight loads
        for cc in variants:
            if cc.key() not in seen:
                seen.add(cc.key())
                out.append(cc)
    return out


def invariant_candidates(mode: str, bucket: int, N: int, K: int) -> list[GemmConfig]:
    """The forward candidates of a key that batch-invariant calls may take (knob batch_invariant; by default
    every W8A16 call: the matched engine and the trainer's forward): each tile shape of `candidates` with >= 64
    weight rows recast to the weight shape's split with swap_ab, at the schedule's BLOCK_K, at the tile's own and
    (decode buckets) at 512 where that keeps the schedule's sums (gemm_configs.same_sums: W8A16's k16 steps run in
    k order whatever the chunking; long row chunks stream the weights faster at decode), at the stages that fit,
    and at more where BLOCK_K shrank, with both exact widenings at decode. Tiles, stages, warps, loads and the
    chunking do not change a row's sums, so every one of them gives the invariant bits; invariant_gemm_config picks
    the fastest one the table records. Without them a key whose candidates all use another schedule falls back to
    heuristic tiles (H200: 67 against 39 us for gate_up at 16 tokens)."""
    if not (mode == "w8a16" or lg.batch_invariant(mode)):   # W8A16 always: the runtime default is auto
        return []
    sched = lg.reduction_schedule(mode, N, K)
    out, seen = [], set()
    for c in candidates(mode, bucket, N, K):
        if c.block_n < lg.WGMMA_ROWS:           # decode tiles of 16-32 rows: mma.sync, not the invariant wgmma sums
            continue
        decode = bucket <= 64
        for bk in sorted({sched.block_k, c.block_k} | ({512} if decode else set())):
            cc = dataclasses.replace(c, split_k=sched.split_k, block_k=bk, swap_ab=True, widen="bits", x_tma=False)
            if not lg.invariant_tile(cc, sched, K, mode):
                continue
            fit = max(2, min(12, lg.stages_that_fit(c, mode, bk)))
            for ns in sorted({min(fit, c.num_stages * max(1, c.block_k // bk)), min(fit, c.num_stages)}):
                for widen in ("bits", "prmt") if decode and mode == "w8a16" else ("bits",):
                    cs = dataclasses.replace(cc, num_stages=ns, widen=widen)
                    if cs.key() not in seen and lg.smem_bytes(cs, mode, 0) <= lg.SM90_MAX_SMEM:
                        seen.add(cs.key())
                        out.append(cs)
    return out


def _forward_candidates(mode: str, bucket: int, N: int, K: int) -> list[GemmConfig]:
    own = candidates(mode, bucket, N, K)
    known = {c.key() for c in own}
    return own + [c for c in invariant_candidates(mode, bucket, N, K) if c.key() not in known]


def _try_variant(c: GemmConfig, best: tuple, layer: Layer, timer: Timer, names, M: int, mode: str, reps: int,
                 report: list) -> tuple:
    """Time config c (a variant of the current winner with the same MMAs: tile order, x loads, widening; its
    output must have the winner's bits) summed over the group's projections, record it in report; the better
    of (time, config)."""
    try:
        for name in names:
            if not torch.equal(layer.ours_gemm(name, M, mode, c)(), layer.ours_gemm(name, M, mode, best[1])()):
                raise RuntimeError(f"bits differ from {best[1].key()} on {name} (same MMAs expected)")
        tot = sum(timer.graph_us(layer.ours_gemm(name, m, mode, c), reps) for name in names for m in timed_ms(M))
    except Exception as e:
        report.append({"config": c.key(), "error": f"{type(e).__name__}: {str(e)[:200]}"})
        return best
    report.append({"config": c.key(), "us": round(tot, 2)})
    return (tot, c) if tot < best[0] else best


def timed_ms(M: int) -> tuple[int, ...]:
    """The token counts a key's candidates are timed at, their times summed: the bucket's M, and in the decode
    bucket also M = 1, the batch-1 decode step (H200: the same configs took 54 us on gate_up in W8A16 at M = 1 and
    40 at M = 16, so a choice made at 16 alone did not see what batch 1 pays; bench/lab/explore_decode_tiles.py)."""
    return (1, M) if lg.m_bucket(M) == lg.M_BUCKETS[0] and M != 1 else (M,)


def tune_ms() -> dict[int, int]:
    """{token bucket: the M tuned for it}: every bucket of the table (the engine's decode batches fall in all of
    them as sequences finish), at the benchmark's largest M in the bucket, else the bucket's bound."""
    return {b: max((m for m in MS if lg.m_bucket(m) == b), default=b) for b in lg.M_BUCKETS}


def _tune_jobs(layer: Layer, keys: str | None):
    """(forward jobs (mode, M, K, projection names sharing the key), dx-GEMM projection names) to tune."""
    groups: dict[tuple, list] = {}
    for name, (K, widths) in PROJ.items():
        groups.setdefault((K, lg.n_class(sum(widths))), []).append(name)
    jobs = []
    for mode in ("w8a8", "w8a16"):
        for b, M in tune_ms().items():
            if mode == "w8a16" and b == lg.M_BUCKETS[-1]:
                M = TRAIN_TOKENS                # W8A16 at the largest sizes: the trainer's forward (8x1024)
            for (K, ncls), names in groups.items():
                key = lg.config_key(mode, M, layer.w[names[0]][0].shape[0], K)
                if keys is None or re.search(keys, key):
                    jobs.append((mode, M, K, names))
    dx_names = [n for n in PROJ if keys is None or re.search(
        keys, lg.config_key("w8a16", TRAIN_TOKENS, PROJ[n][0], sum(PROJ[n][1]), transposed=True))]
    return jobs, dx_names


def _precompile_candidates(layer: Layer, jobs, dx_names) -> None:
    """Compile every candidate first, in parallel."""
    with tu.collect_launches() as rec:
        for mode, M, K, names in jobs:
            for name in names:
                N = layer.w[name][0].shape[0]
                for c in _forward_candidates(mode, lg.m_bucket(M), N, K):
                    layer.ours_gemm(name, M, mode, c)()
        for name in dx_names:
            x, q, sw, A, B = train_inputs(layer, name)
            N, K = q.shape
            for c in candidates("w8a16", lg.m_bucket(TRAIN_TOKENS), K, N):
                dx_gemm(x, q, sw, A, c)()
    info = tu.precompile(rec, jobs=os.cpu_count() or 8)
    log(f"tune: precompiled {info['kernels']} kernels in {info['seconds']} s ({len(info['errors'])} failed)")


def _tune_forward_key(layer: Layer, timer: Timer, mode, M, K, names, reps, report):
    """(key, (µs, best config) or None) for one forward key: candidates, then variants of the winner."""
    N0 = layer.w[names[0]][0].shape[0]
    key = lg.config_key(mode, M, N0, K)
    best = None
    for c in _forward_candidates(mode, lg.m_bucket(M), N0, K):
        try:
            tot = 0.0
            for name in names:
                ref = layer.ours_gemm(name, M, mode, None)()
                out = layer.ours_gemm(name, M, mode, c)()
                if (out.float() - ref.float()).abs().max() > 1e-2 * ref.float().abs().max():
                    raise RuntimeError("output differs from the default config's")
                tot += sum(timer.graph_us(layer.ours_gemm(name, m, mode, c), reps) for m in timed_ms(M))
        except Exception as e:
            report.setdefault(key, []).append({"config": c.key(), "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        report.setdefault(key, []).append({"config": c.key(), "us": round(tot, 2)})
        if best is None or tot < best[0]:
            best = (tot, c)
    if best is not None:
        # the tile sweep order over the winner: how many token tiles share a weight tile's L2 lines
        for gm in (2, 4, 16):
            best = _try_variant(dataclasses.replace(best[1], group_m=gm), best, layer, timer, names, M, mode,
                                reps, report[key])
        # x tiles through TMA too (calls without gathered rows: trainer, base GEMM)
        best = _try_variant(dataclasses.replace(best[1], x_tma=True), best, layer, timer, names, M, mode,
                            reps, report[key])
        if mode == "w8a16":
            # the exact widenings of W8A16 give the same bits; each is timed on the winner's tiles
            for wd in [w for w in lg.WIDENINGS if w != best[1].widen]:
                best = _try_variant(dataclasses.replace(best[1], widen=wd), best, layer, timer, names, M, mode,
                                    reps, report[key])
    return key, best


def _tune_dx_key(layer: Layer, timer: Timer, name, reps, report):
    """(key, (µs, best config) or None) for one projection's backward dx GEMM."""
    x, q, sw, A, B = train_inputs(layer, name)
    N, K = q.shape
    key = lg.config_key("w8a16", TRAIN_TOKENS, K, N, transposed=True)
    best = None
    ref = dx_gemm(x, q, sw, A, None)()

    def time_dx(c, same_bits_as=None):
        try:
            out = dx_gemm(x, q, sw, A, c)()
            if (out.float() - ref.float()).abs().max() > 1e-2 * ref.float().abs().max():
                raise RuntimeError("output differs from the default config's")
            if same_bits_as is not None and not torch.equal(out, dx_gemm(x, q, sw, A, same_bits_as)()):
                raise RuntimeError(f"bits differ from {same_bits_as.key()} (same MMAs expected)")
            t = timer.graph_us(dx_gemm(x, q, sw, A, c), min(reps, 10))
        except Exception as e:
            report.setdefault(key, []).append({"config": c.key(), "error": f"{type(e).__name__}: {str(e)[:200]}"})
            return None
        report.setdefault(key, []).append({"config": c.key(), "us": round(t, 2)})
        return t

    for c in candidates("w8a16", lg.m_bucket(TRAIN_TOKENS), K, N):
        t = time_dx(c)
        if t is not None and (best is None or t < best[0]):
            best = (t, c)
    if best is not None:          # tile order, x through TMA and the widenings, each on the current winner
        for change in [dict(group_m=gm) for gm in (2, 4, 16)] + [dict(x_tma=True)] + [
                dict(widen=w) for w in lg.WIDENINGS]:
            v = dataclasses.replace(best[1], **change)
            t = None if v == best[1] else time_dx(v, same_bits_as=best[1])
            if t is not None and t < best[0]:
                best = (t, v)
    return key, best


def tune(layer: Layer, timer: Timer, deadline: float, reps: int, keys: str | None = None) -> dict:
    """Groups share a config (see gemm_configs.config_key): (K=4096, narrow) = qkv + o, (4096, wide) = gate_up,
    (12288, narrow) = down; tuned at one M per token bucket (tune_ms); the training dx GEMMs at 8192 tokens."""
    jobs, dx_names = _tune_jobs(layer, keys)
    _precompile_candidates(layer, jobs, dx_names)
    table, report = {}, {}
    for mode, M, K, names in jobs:
        if time.time() > deadline:
            log("tune: time budget reached, remaining keys keep their current entry (tuned or heuristic)")
            break
        key, best = _tune_forward_key(layer, timer, mode, M, K, names, reps, report)
        if best is not None:
            table[key] = dataclasses.asdict(best[1])
            log(f"tune {key}: {best[1]} {best[0]:.1f} us (heuristic "
                f"{report[key][0].get('us', 'failed')} us)")
        else:
            log(f"tune {key}: every candidate failed: {report.get(key)}")
    for name in dx_names:                                    # backward dx GEMM of the training linear
        if time.time() > deadline:
            break
        key, best = _tune_dx_key(layer, timer, name, reps, report)
        if best is not None:
            table[key] = dataclasses.asdict(best[1])
            log(f"tune {key}: {best[1]} {best[0]:.1f} us")
        else:
            log(f"tune {key}: every candidate failed: {report.get(key)}")
    return {"gemm": table, "candidates": report}


# ------------------------------------------------------------------------------------------------ training
def train_inputs(layer: Layer, name: str):
    K, widths = PROJ[name]
    q, sw, _ = layer.w[name]
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(TRAIN_TOKENS, K, device=DEV, dtype=torch.bfloat16, generator=g)
    A = torch.randn(RANK, K, device=DEV, generator=g) * 0.02
    B = torch.randn(q.shape[0], RANK, device=DEV, generator=g) * 0.02
    return x, q, sw, A, B


_DX_INPUTS: dict = {}


def dx_gemm(x, q, sw, A, config):
    """The backward dx GEMM of the training linear alone (for tuning): gy·q + dh·A_c on the transposed codes,
    no scale (gy = dy ⊙ s_w, made by dy_prep); fixed gy, dh per shape."""
    T, N = x.shape[0], q.shape[0]
    if (T, N) not in _DX_INPUTS:
        _DX_INPUTS[(T, N)] = (torch.randn(T, N, device=DEV, dtype=torch.bfloat16), torch.randn(1, T, RANK, device=DEV))
    gy, dh = _DX_INPUTS[(T, N)]
    Ac = A.to(torch.bfloat16)
    return lambda: lora_gemm_triton(gy, q.t(), None, h=dh, B=Ac.t()[None], out_dtype=torch.bfloat16,
                                    config=config)


def _train_arms(x0, q, sw, A0, B0, s, dy, w16) -> dict:
    """{arm: (step, clear_grads, extra bytes of one step)} for ours and PEFT's bf16 LoRA, each warmed up."""
    arms = {}
    for arm in ("ours", "peft"):
        x = x0.clone().requires_grad_()
        if arm == "ours":
            A, B = A0.clone().requires_grad_(), B0.clone().requires_grad_()

            def step(x=x, A=A, B=B):
                lora_linear_triton(x, q, sw, A, B, s).backward(dy)
        else:
            A, B = A0.to(torch.bfloat16).requires_grad_(), B0.to(torch.bfloat16).requires_grad_()

            def step(x=x, A=A, B=B):
                y = F.linear(x, w16) + F.linear(F.linear(x, A), B) * s
                y.backward(dy)

        def clear_grads(ts=(x, A, B)):
            for t in ts:
                t.grad = None
        step()                                                          # warm-up (compile, probe)
        clear_grads()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        arms[arm] = (step, clear_grads, torch.cuda.max_memory_allocated() - base)
        clear_grads()
    return arms


def _time_train_arms(timer: Timer, arms: dict, reps: int) -> dict:
    """{arm: (µs, extra bytes, in a CUDA graph)}: both graphs replayed in turn, or eager in turn."""
    res = {}
    try:                                                # both graphs, replayed in turn (same GPU state)
        us = timer.paired_us([arms[a][0] for a in arms], reps, [arms[a][1] for a in arms])
        res = {a: (u, arms[a][2], True) for a, u in zip(arms, us)}
    except Exception:                                   # autograd not capturable here: eager, in turn
        torch.cuda.synchronize()
        ev = {a: [] for a in arms}
        for _ in range(reps):
            for a in arms:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                timer.flush.zero_()
                e0.record()
                arms[a][0]()
                e1.record()
                ev[a].append((e0, e1))
                arms[a][1]()
        torch.cuda.synchronize()
        res = {a: (statistics.median(e0.elapsed_time(e1) * 1e3 for e0, e1 in ev[a]), arms[a][2], False)
               for a in arms}
    return res


def _train_gemm_part_rows(timer: Timer, name, x0, q, sw, A0, B0, s, dy, w16, reps) -> list[dict]:
    """Where the time goes: the two big GEMMs and dy_prep alone against cuBLAS on the bf16 weight."""
    rows = []
    Bc = (B0 * s).to(torch.bfloat16)
    h = torch.randn(1, TRAIN_TOKENS, RANK, device=DEV)
    parts = {
        "fwd": (lambda: lora_gemm_triton(x0, q, sw, h=h, B=Bc[None]), lambda: F.linear(x0, w16)),
        "fwd_base": (lambda: lora_gemm_triton(x0, q, sw), lambda: F.linear(x0, w16)),   # what the epilogue costs
        "dx": (dx_gemm(x0, q, sw, A0, None), lambda: F.linear(dy, w16.t())),
        # the backward's one pass over dy (gy = dy ⊙ s_w and dh = dy·B_c) vs cuBLAS's dh alone
        "dy_prep": (lambda: dy_prep_triton(dy, sw, Bc), lambda: torch.mm(dy, Bc, out_dtype=torch.float32)),
    }
    for part, (ours_fn, base_fn) in parts.items():
        o, b = timer.paired_us([ours_fn, base_fn], reps)
        rows.append(dict(op=f"train_{'gemm_' if part != 'dy_prep' else ''}{part}:{name}", mode="w8a16",
                         M=TRAIN_TOKENS, adapters=1, rank=RANK, ours_us=round(o, 2),
                         baseline="cublas_bf16" if part != "dy_prep" else "cublas_dh_only", baseline_us=round(b, 2),
                         ratio=round(o / b, 3)))
    return rows


def train_rows(layer: Layer, timer: Timer, reps: int) -> list[dict]:
    rows = []
    for name in PROJ:
        x0, q, sw, A0, B0 = train_inputs(layer, name)
        N, K = q.shape
        s = 2.0
        dy = torch.randn(TRAIN_TOKENS, N, device=DEV, dtype=torch.bfloat16)
        w16 = (q.float() * sw[:, None]).to(torch.bfloat16)               # the PEFT arm's bf16 weight
        res = _time_train_arms(timer, _train_arms(x0, q, sw, A0, B0, s, dy, w16), reps)
        rows += _train_gemm_part_rows(timer, name, x0, q, sw, A0, B0, s, dy, w16, reps)
        w16 = None                                                      # free the bf16 weight (the lambdas are done)
        mem = train_memory(layer, name, res["ours"][1])
        mib = 2 ** 20
        rows.append(dict(op=f"train_fwd_bwd:{name}", mode="w8a16", M=TRAIN_TOKENS, adapters=1, rank=RANK,
                         ours_us=round(res["ours"][0], 2), baseline="peft_bf16", baseline_us=round(res["peft"][0], 2),
                         ratio=round(res["ours"][0] / res["peft"][0], 3),
                         ours_extra_mib=round(res["ours"][1] / mib, 1),
                         peft_extra_mib=round(res["peft"][1] / mib, 1),
                         weight_fp8_mib=round(q.numel() / mib, 1), weight_bf16_mib=round(q.numel() * 2 / mib, 1),
                         cuda_graph=res["ours"][2] and res["peft"][2], **mem))
        log(f"train {name}: ours {res['ours'][0]:.0f} us vs peft {res['peft'][0]:.0f} us; extra memory at "
            f"{TRAIN_TOKENS} tokens: ours {res['ours'][1] / mib:.0f} MiB (of which the step's own tensors "
            f"{mem['ours_required_mib']:.0f} MiB, residual {mem['ours_residual_mib']:.1f} MiB), peft "
            f"{res['peft'][1] / mib:.0f} MiB; at {MEM_TOKENS} tokens the largest allocation is "
            f"{mem['ours_max_alloc_mib']} MiB (FP8 codes {q.numel() / mib:.0f} MiB, bf16 copy "
            f"{q.numel() * 2 / mib:.0f} MiB)")
    return rows


MEM_TOKENS = 256      # token count of the allocation-size check: y and dx are far smaller than the weight there


def train_memory(layer: Layer, name: str, peak_8k: int) -> dict:
    """What "no bf16 copy of the weight" means, measured two ways (a whole step's peak at 8k tokens is
    dominated by y and dx, which are larger than the weight, so comparing that peak with the weight's size
    says nothing):
      * at 8k tokens: the peak minus the tensors a forward+backward step of this linear must hold (y, dx,
        gy = dy ⊙ s_w, h, dh and their bf16 casts, A_c, B_c, dA, dB): the residual must stay below half the FP8 codes (a
        transposed FP8 copy would add N·K bytes, a bf16 copy 2·N·K);
      * at MEM_TOKENS tokens, after a warm-up step (library workspaces are allocated once per stream): the
        size of every allocation the step makes; none may reach N·K bytes."""
    q, sw, _ = layer.w[name]
    N, K = q.shape
    T, r = TRAIN_TOKENS, RANK
    required = (2 * T * N * 2 + T * K * 2 + 2 * T * r * 4 + 2 * T * r * 2 + r * K * 2 + N * r * 2 + r * K * 4
                + 2 * N * r * 4)
    g = torch.Generator(device=DEV).manual_seed(2)
    x = torch.randn(MEM_TOKENS, K, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_()
    A = (torch.randn(r, K, device=DEV, generator=g) * 0.02).requires_grad_()
    B = (torch.randn(N, r, device=DEV, generator=g) * 0.02).requires_grad_()
    dy = torch.randn(MEM_TOKENS, N, device=DEV, dtype=torch.bfloat16, generator=g)

    def step():
        lora_linear_triton(x, q, sw, A, B, 2.0).backward(dy)
        x.grad = A.grad = B.grad = None

    step()
    _, peak, sizes = tu.alloc_trace(step)
    biggest = max(sizes) if sizes else None
    mib = 2 ** 20
    return dict(ours_required_mib=round(required / mib, 1), ours_residual_mib=round((peak_8k - required) / mib, 1),
                mem_tokens=MEM_TOKENS, ours_peak_mib_at_mem_tokens=round(peak / mib, 1),
                ours_max_alloc_mib=None if biggest is None else round(biggest / mib, 2),
                ours_allocs_at_mem_tokens=None if sizes is None else len(sizes))


# ------------------------------------------------------------------------------------------------ main
def row(op, mode, M, S, ours, base_name, base):
    r = dict(op=op, mode=mode, M=M, adapters=S, rank=RANK if S else 0, ours_us=round(ours, 2),
             baseline=base_name, baseline_us=round(base, 2) if base else None,
             ratio=round(ours / base, 3) if base else None)
    if op.startswith("gemm:"):
        K, widths = PROJ[op.split(":")[1]]
        r["config"] = lg.gemm_config(mode, M, sum(widths), K, DEV).key()
    return r


def acceptance(rows) -> list[tuple[str, bool | None, str]]:
    """Issue 3's targets and issue 15's base line, evaluated on this run's rows (None: not measurable here)."""
    def pick(**kw):
        return [r for r in rows if all(r.get(k) == v for k, v in kw.items()) and r.get("ratio")]
    out = []
    r1 = [r for M in (64, 256) for r in pick(op="layer", mode="w8a8", M=M, adapters=1, baseline="vllm_w8a8")]
    out.append(("1 adapter, M in {64,256}: layer <= 0.85x vLLM", all(r["ratio"] <= 0.85 for r in r1) if r1 else None,
                ", ".join(f"M={r['M']}: {r['ratio']}" for r in r1)))
    r32 = pick(op="layer", mode="w8a8", M=256, adapters=32, baseline="vllm_w8a8")
    out.append(("32 adapters, M=256: layer <= 1.0x vLLM", all(r["ratio"] <= 1.0 for r in r32) if r32 else None,
                ", ".join(str(r["ratio"]) for r in r32)))
    rg = [r for r in rows if r["op"].startswith("gemm:") and r["mode"] == "w8a8" and r.get("ratio")
          and r["baseline"] == "vllm_cutlass"]
    out.append(("base GEMM W8A8 <= 1.15x CUTLASS at every M", all(r["ratio"] <= 1.15 for r in rg) if rg else None,
                f"worst {max((r['ratio'], r['op'], r['M']) for r in rg)}" if rg else ""))
    # issue 15: the decode path's base line, the W8A8 layer without an adapter (quantizer + GEMM per projection on
    # both sides) at M <= 16 against vLLM's (dynamic_per_token_scaled_fp8_quant + cutlass_scaled_mm)
    rd = [r for r in pick(op="layer", mode="w8a8", adapters=0, baseline="vllm_w8a8") if r["M"] <= 16]
    out.append(("issue 15: W8A8 layer without LoRA at M <= 16 <= 1.00x vLLM (CUTLASS)",
                all(r["ratio"] <= 1.0 for r in rd) if rd else None,
                ", ".join(f"M={r['M']}: {r['ratio']}" for r in rd)))
    rw = [r for r in rows if r["op"].startswith("gemm:") and r["mode"] == "w8a16" and r["M"] <= 64 and r.get("ratio")]
    out.append(("W8A16 <= 1.15x our W8A8 at M <= 64", all(r["ratio"] <= 1.15 for r in rw) if rw else None,
                f"worst {max((r['ratio'], r['op'], r['M']) for r in rw)}" if rw else ""))
    rt = [r for r in rows if r["op"].startswith("train_fwd_bwd") and r.get("ratio")]
    out.append(("training fwd+bwd <= 1.1x PEFT bf16 LoRA", all(r["ratio"] <= 1.1 for r in rt) if rt else None,
                ", ".join(f"{r['op'].split(':')[1]}: {r['ratio']}" for r in rt)))
    bad = [r for r in rt if r["ours_residual_mib"] >= 0.5 * r["weight_fp8_mib"]
           or (r["ours_max_alloc_mib"] is not None and r["ours_max_alloc_mib"] >= r["weight_fp8_mib"])]
    out.append(("no copy of any weight (8k-token step: peak - own tensors < 1/2 FP8 codes; "
                f"{MEM_TOKENS}-token step: no allocation >= FP8 codes)", not bad if rt else None,
                ", ".join(f"{r['op'].split(':')[1]}: residual {r['ours_residual_mib']} MiB, largest alloc "
                          f"{r['ours_max_alloc_mib']} MiB, FP8 codes {r['weight_fp8_mib']} MiB" for r in rt)))
    return out


def print_table(rows):
    hdr = f"{'op':<22}{'mode':<7}{'M':>6}{'ad':>4}{'ours_us':>11}  {'baseline':<16}{'base_us':>10}{'ratio':>8}"
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in rows:
        b = f"{r['baseline_us']:>10.1f}" if r.get("baseline_us") else f"{'-':>10}"
        ra = f"{r['ratio']:>8.3f}" if r.get("ratio") else f"{'-':>8}"
        print(f"{r['op']:<22}{r['mode']:<7}{r['M']:>6}{r['adapters']:>4}{r['ours_us']:>11.1f}  "
              f"{r['baseline']:<16}{b}{ra}")


def markdown(rows, meta) -> str:
    lines = [f"Measured {meta['date']} on {meta['gpu']} (torch {meta['torch']}, triton {meta['triton']}, vLLM "
             f"{meta['vllm'] or 'not importable: ' + meta['vllm_note']}); `{meta['command']}`", "",
             "| op | mode | M | adapters | ours µs | baseline | baseline µs | ratio |",
             "|---|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['mode']} | {r['M']} | {r['adapters']} | {r['ours_us']:.1f} | {r['baseline']} | "
                     f"{r['baseline_us'] if r['baseline_us'] is not None else '-'} | "
                     f"{r['ratio'] if r['ratio'] else '-'} |")
    return "\n".join(lines)


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tune", action="store_true", help="tune GEMM configs first and write the tuned table")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tune-reps", type=int, default=15)
    ap.add_argument("--budget-s", type=float, default=420, help="stop tuning after this many seconds")
    ap.add_argument("--tune-keys", default=None, help="retune only the table keys matching this regex (e.g. "
                    "'w8a16\\|(16|64)\\|'); the other entries of the existing table are kept")
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--only-train", action="store_true", help="only the training rows (no layer/gemm rows)")
    ap.add_argument("--shape", default="qwen3_8b", help="the decoder layer's shapes: an architecture of rlfp8/models "
                    "(qwen3_8b, qwen3_32b, ...); the acceptance lines are Qwen3-8B's")
    ap.add_argument("--out", help="result JSON (default bench/results/kernels_h200.json; kernels_<shape>_h200.json "
                    "for another --shape)")
    ap.add_argument("--update-readme", action="store_true", help="replace the results table in bench/README.md")
    ap.add_argument("--batch-invariant", choices=("auto", "on", "off"), default="auto",
                    help="kernels.batch_invariant for every row (auto: on for W8A16, the matched engine's schedules; "
                         "off: the tuned configs, which the W8A8 engine and a trainer without a w8a16 engine use)")
    a = ap.parse_args(argv)
    if a.out is None:
        stem = "kernels" if a.shape == "qwen3_8b" else f"kernels_{a.shape}"
        a.out = str(ROOT / f"bench/results/{stem}_h200.json")
    if a.update_readme and a.shape != "qwen3_8b":
        ap.error("--update-readme: the README's table is Qwen3-8B's (--shape qwen3_8b)")
    return a


def kept_entries(old: dict, new_keys: set[str]) -> dict:
    """Entries of the existing table that survive a tuning run: every one the run did not redo (other shapes',
    other --tune-keys', and those a run cut by its --budget-s never reached: a partial run must not send them back
    to the heuristic)."""
    return {k: v for k, v in old.items() if k not in new_keys}


def in_table_order(old: dict, redone: dict) -> dict:
    """The existing entries in their order, each redone one replaced in place, then the new keys: a retune of a few
    keys rewrites a few entries of the committed file (kept_entries says which survive)."""
    merged = {k: redone.get(k, v) for k, v in old.items()}
    return {**merged, **{k: v for k, v in redone.items() if k not in merged}}


def _tune_and_write_table(layer, timer, a) -> dict:
    """Tune, merge with the entries of an existing table the run did not redo, write it, reload it."""
    table = tune(layer, timer, T0 + a.budget_s, a.tune_reps, a.tune_keys)
    path = lg.tuned_table_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():             # keep every entry this run did not redo (kept_entries)
        old = json.loads(path.read_text())
        keep = lambda part: kept_entries(old.get(part, {}), set(table[part]))
        table = {"gemm": in_table_order(old.get("gemm", {}), table["gemm"]),
                 "candidates": in_table_order(old.get("candidates", {}), table["candidates"]),
                 # hand edits (with their measurements) of entries the tuner did not redo
                 "edits": [e for e in old.get("edits", []) if e["key"] in keep("gemm")]}
    tuned_info = {"path": str(path), "keys": len(table["gemm"])}
    path.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "triton": triton.__version__,
                                "date": datetime.date.today().isoformat(), **table}, indent=1))
    lg.reload_tuned_table()
    log(f"tuned table written: {path} ({len(table['gemm'])} keys)")
    return tuned_info


def _precompile(layer, a, ms) -> dict:
    """Compile everything the measurements launch, in parallel."""
    with tu.collect_launches() as rec:
        for M in ms:
            for mode in ("w8a8", "w8a16"):
                for S in (0, 1, 32):
                    for name in PROJ:
                        layer.ours_proj(name, M, S, mode)()
                for name in PROJ:
                    layer.ours_gemm(name, M, mode)()
        if not a.no_train:
            for name in PROJ:
                x, q, sw, A, B = train_inputs(layer, name)
                for xx in (x, x[:MEM_TOKENS]):                 # the timed step and the memory check's step
                    lora_linear_triton(xx, q, sw, A, B, 2.0)
                    dx_gemm(xx, q, sw, A, None)()
    info = tu.precompile(rec, jobs=os.cpu_count() or 8)
    log(f"precompiled {info['kernels']} kernels in {info['seconds']} s; errors: {info['errors']}")
    return info


def _measure(rows, timer, op, mode, M, S, ours_fn, base_name, base_fn):
    if base_fn is not None:
        try:                                       # ours and the baseline replayed in turn
            o, b = timer.paired_us([ours_fn, base_fn])
            rows.append(row(op, mode, M, S, o, base_name, b))
            return
        except Exception:                          # find out which side fails, below
            torch.cuda.synchronize()
    try:
        o = timer.graph_us(ours_fn)
    except Exception as e:
        log(f"FAILED ours {op} {mode} M={M} S={S}: {type(e).__name__}: {e}")
        traceback.print_exc()
        return
    b = None
    if base_fn is not None:
        try:
            b = timer.graph_us(base_fn)
        except Exception as e:
            log(f"FAILED baseline {base_name} {op} M={M} S={S}: {type(e).__name__}: {e}")
    rows.append(row(op, mode, M, S, o, base_name, b))


def _measure_layers_and_gemms(layer, vl, timer, ms) -> list[dict]:
    rows = []

    def measure(*args):
        _measure(rows, timer, *args)

    for M in ms:
        for S in (0, 1, 32):
            ours8 = seq([layer.ours_proj(n, M, S, "w8a8") for n in PROJ])
            ours16 = seq([layer.ours_proj(n, M, S, "w8a16") for n in PROJ])
            if vl.ok:
                measure("layer", "w8a8", M, S, ours8, "vllm_w8a8", seq([layer.vllm_proj(vl, n, M, S) for n in PROJ]))
            elif S <= 1:
                measure("layer", "w8a8", M, S, ours8, "torch_scaled_mm", seq([layer.torch_proj(n, M, S) for n in PROJ]))
            else:
                measure("layer", "w8a8", M, S, ours8, "none", None)
            measure("layer", "w8a16", M, S, ours16, "ours_w8a8", ours8)
        for name in PROJ:
            base = layer.vllm_gemm(vl, name, M) if vl.ok else layer.torch_gemm(name, M)
            measure(f"gemm:{name}", "w8a8", M, 0, layer.ours_gemm(name, M, "w8a8"),
                    "vllm_cutlass" if vl.ok else "torch_scaled_mm", base)
            measure(f"gemm:{name}", "w8a16", M, 0, layer.ours_gemm(name, M, "w8a16"), "ours_w8a8",
                    layer.ours_gemm(name, M, "w8a8"))
        log(f"M={M} done")
    return rows


def _write_results(rows, a, vl, timer, tuned_info, info):
    acc = acceptance(rows)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                vllm=vl.version if vl.ok else None,
                vllm_note="" if vl.ok else f"vLLM not importable ({vl.reason}); baselines are torch._scaled_mm and "
                "torch bf16 LoRA matmuls, 32-adapter W8A8 rows have no baseline",
                command=" ".join([Path(sys.executable).name] + sys.argv),
                date=datetime.datetime.now().isoformat(timespec="seconds"), shape=a.shape,
                projections={n: [K, list(w)] for n, (K, w) in PROJ.items()}, reps=a.reps,
                l2_flush_bytes=timer.flush.numel(), cuda_graphs=True, tuned=tuned_info,
                precompile=info, seconds=round(time.time() - T0, 1), dispatch=dispatch.report(),
                acceptance=[dict(target=t, ok=ok, detail=d) for t, ok, d in acc])
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    print_table(rows)
    print("\nacceptance (issue 3):")
    for t, ok, d in acc:
        print(f"  [{'PASS' if ok else 'FAIL' if ok is False else 'n/a '}] {t}   {d}")
    if a.update_readme:
        readme = ROOT / "bench/README.md"
        txt = readme.read_text()
        s, e = "<!-- results:start -->", "<!-- results:end -->"
        if s in txt and e in txt:
            txt = txt[:txt.index(s) + len(s)] + "\n" + markdown(rows, meta) + "\n" + txt[txt.index(e):]
            readme.write_text(txt)
    log(f"wrote {out} ({len(rows)} rows)")


def main(argv=None):
    a = _args(argv)
    global PROJ
    PROJ = projection_shapes(a.shape)
    log(f"shape {a.shape}: " + ", ".join(f"{n} {K}->{sum(w)}" for n, (K, w) in PROJ.items()))
    if a.reps < 50:
        log(f"note: --reps {a.reps} < 50 (the issue asks for a median of >= 50)")
    assert torch.cuda.is_available(), "bench/kernel_bench.py needs a CUDA GPU"
    dispatch.set_backend("triton")
    from rlfp8.kernels.knobs import set_knobs
    set_knobs(batch_invariant=a.batch_invariant)
    log(f"kernels.batch_invariant={a.batch_invariant}")
    torch.backends.cuda.matmul.allow_tf32 = False
    vl = VLLM()
    log(f"GPU {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}, "
        f"vLLM {vl.version if vl.ok else 'not importable (' + vl.reason + ')'}")
    timer = Timer(a.reps)
    layer = Layer(vl)
    log("inputs ready")
    tuned_info = _tune_and_write_table(layer, timer, a) if a.tune else None
    ms = () if a.only_train else MS
    info = _precompile(layer, a, ms)
    rows = _measure_layers_and_gemms(layer, vl, timer, ms)
    if not a.no_train:
        rows += train_rows(layer, timer, a.reps)
    _write_results(rows, a, vl, timer, tuned_info, info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
