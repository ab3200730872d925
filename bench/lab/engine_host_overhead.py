"""CPU proxy of the ENGINE projection's host cost per call (rlfp8.rollout.lora_layers.run_projection, the eager body
of the engine's custom op), no GPU and no vLLM needed.

    python bench/lab/host_overhead.py --engine [--tokens 64] [--iters 50] [--meta-args 7|6] [--pdl gpu|off]
                                               [--configs h200|heuristic] [--baseline] [--top N] [--dump-launches F]

One pass = one decoder layer of Qwen3-8B (qkv N=6144, o 4096x4096, gate_up N=24576, down K=12288; LoRA rank 64,
one slot as the engine's max_loras=1), T = 64 decode tokens, for each of w8a16 / w8a8 x adapter active (every
token slot 0) / no adapter (every token -1: vLLM's no_lora flag, the base GEMM alone). The layer is a stand-in
of vLLM's LoRA layer (nn.Modules holding the codes as Parameters, vLLM's [S, 1, r, K] / [S, 1, N_l, r] slices),
its metadata a stand-in of vLLM's LoRAKernelMeta whose meta_args slices its max-token buffers as vLLM's does
(7-tuple meta_args(T, specialize) as vLLM 0.28 has it, or --meta-args 6: meta_args(T) -> 6-tuple).
Launches are recorded by `collect_launches()`, not run; kernel knobs as the engine runs them (batch_invariant
auto); K2's configs from the H200's tuned table (--configs h200: what the GPU launches, TMA descriptors
included). --pdl gpu makes the PDL choice resolve as on an H200 (K2 launched as K1's dependent, W8A8 quantizing
x apart under pdl_w8a8_quant=separate): the CPU answer ("not a CUDA GPU") is replaced, see `_pdl_as_on_gpu`.
Not seen: JITFunction.run beyond its binder (timed apart, per launch), CUDA API calls (allocator, launches),
vLLM's custom-op dispatch. Numbers: bench/README.md, lab/host_overhead.py section.
"""
from __future__ import annotations

import cProfile
import pstats
import time

import torch

RANK = 64
HIDDEN = 4096
# (name, output slices N_l, K) of one Qwen3-8B decoder layer (32 q heads / 8 kv heads of 128, MLP 12288)
QWEN3_8B_LAYER = (("qkv", (4096, 1024, 1024), HIDDEN), ("o", (HIDDEN,), HIDDEN),
                  ("gate_up", (12288, 12288), HIDDEN), ("down", (HIDDEN,), 12288))
ENGINE_PARTS = ("run_projection", "_lora_meta", "lora_meta_from_vllm", "signature", "_planned", "_call_key", "replay",
                "capture", "project",
                "fp8_lora_linear", "_use_pdl", "choose_launch", "pdl_unavailable", "quantize_rows_triton",
                "lora_shrink_triton", "check_lora_shrink_args", "_pick_shrink_config", "lora_gemm_triton",
                "check_lora_gemm_args", "_pick_config", "_fit_to_device", "_split_k_buffers", "_lora_args",
                "_w_operand", "_x_operand", "from_tensor", "_variant_flags", "launch", "record")


class FakeKernelMeta:
    """vLLM's LoRAKernelMeta as the engine sees it: buffers for `max_tokens` tokens, meta_args(T, specialize)
    returning views of their first T entries and the CPU flags (vllm/lora/ops/triton_ops/lora_kernel_metadata.py)."""

    def __init__(self, slots: torch.Tensor, max_loras: int, max_tokens: int = 8192, device="cpu"):
        from rlfp8.kernels import build_lora_meta
        m = build_lora_meta(slots, max_loras)
        T = slots.shape[0]
        self.token_lora_mapping = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.token_indices_sorted_by_lora_ids = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.token_lora_mapping[:T] = m.token_lora_mapping.to(device)
        self.token_indices_sorted_by_lora_ids[:T] = m.token_indices_sorted_by_lora_ids.to(device)
        self.active_lora_ids, self.num_tokens_per_lora = m.active_lora_ids.to(device), m.num_tokens_per_lora.to(device)
        self.lora_token_start_loc, self.no_lora_flag_cpu = m.lora_token_start_loc.to(device), m.no_lora_flag_cpu
        self.num_active_loras_cpu = m.num_active_loras_cpu
        self.default_num_active_loras_cpu = torch.tensor([max_loras + 1], dtype=torch.int32)

    def meta_args(self, token_nums: int, specialize_active_lora: bool):
        n_active = self.num_active_loras_cpu if specialize_active_lora else self.default_num_active_loras_cpu
        return (self.token_lora_mapping[:token_nums], self.token_indices_sorted_by_lora_ids[:token_nums],
                self.num_tokens_per_lora, self.lora_token_start_loc, self.active_lora_ids, self.no_lora_flag_cpu,
                n_active)


class FakeKernelMeta6(FakeKernelMeta):
    """The 6-tuple form, meta_args(T) without num_active_loras."""

    def meta_args(self, token_nums: int):         # noqa: the narrower signature is the point
        return super().meta_args(token_nums, True)[:6]


class FakeLoRALayer(torch.nn.Module):
    """The attributes run_projection reads of vLLM's *WithLoRA layer, as nn.Modules and Parameters (so their
    attribute lookups cost what vLLM's do). On the CPU codes and adapters are uninitialised (nothing is computed
    from them); on a GPU (engine_host_gpu.py) random codes, small adapters: finite outputs."""

    def __init__(self, mode: str, widths: tuple, K: int, meta, slots: int = 1, device="cpu"):
        import types
        super().__init__()
        N = sum(widths)
        self.base_layer = torch.nn.Module()
        codes = torch.empty(N, K, dtype=torch.float8_e4m3fn, device=device)
        if codes.is_cuda:
            codes.copy_(torch.randn(N, K, device=device))
        self.base_layer.weight = torch.nn.Parameter(codes, requires_grad=False)
        self.base_layer.weight_scale = torch.nn.Parameter(torch.full((N,), 1e-3, device=device), requires_grad=False)
        self.base_layer.bias = None
        self.base_layer.skip_bias_add = False
        self.base_layer.quant_method = types.SimpleNamespace(mode=mode)
        self.punica_wrapper = types.SimpleNamespace(token_mapping_meta=meta)
        self.lora_config = types.SimpleNamespace(specialize_active_lora=True)
        self.lora_a_stacked = tuple(torch.full((slots, 1, RANK, K), 0.01, dtype=torch.bfloat16, device=device)
                                    for _ in widths)
        self.lora_b_stacked = tuple(torch.full((slots, 1, n, RANK), 0.01, dtype=torch.bfloat16, device=device)
                                    for n in widths)
        self.output_slices = widths
        self.rlfp8_dora_g = torch.ones(slots, N, device=device)
        self.rlfp8_dora_active = False


def _pdl_as_on_gpu(dispatch) -> None:
    """PDL resolves as on an H200. The GPU's answer is put in place of the CPU's ("not a CUDA GPU"), not its cost:
    pdl_unavailable's GPU body (a device-properties query, the gdc_* lookup) is not run, which undercounts trees
    that run it per call (before dispatch cached it per device)."""
    if hasattr(dispatch, "_pdl_why"):
        dispatch._pdl_why[(torch.device("cpu"), dispatch.triton_interpreting())] = None
    else:                                            # trees before the per-device answer (--before arms)
        dispatch.pdl_unavailable = lambda device: None


def _h200_configs() -> None:
    """K2's config lookups read the H200's tuned table for CPU tensors (the table is read only for CUDA devices)."""
    from rlfp8.kernels import gemm_configs
    from rlfp8.kernels.knobs import set_knobs
    set_knobs(tuned_gpu="NVIDIA H200")
    for name in ("gemm_config", "_measured_candidate"):
        setattr(gemm_configs, name, _as_cuda(getattr(gemm_configs, name)))


def _as_cuda(fn):
    """fn with its `device` argument read as a CUDA device (called only on a config cache miss)."""
    def call(*args, **kw):
        import inspect
        bound = inspect.signature(fn).bind(*args, **kw)
        if bound.arguments.get("device") is not None:
            bound.arguments["device"] = torch.device("cuda")
        return fn(*bound.args, **bound.kwargs)
    return call


def make_layers(mode: str, active: bool, tokens: int, meta_args: int, device="cpu") -> list:
    slots = torch.zeros(tokens, dtype=torch.long) if active else torch.full((tokens,), -1)
    meta_cls = FakeKernelMeta if meta_args == 7 else FakeKernelMeta6
    return [FakeLoRALayer(mode, widths, K, meta_cls(slots, 1, device=device), device=device)
            for _, widths, K in QWEN3_8B_LAYER]


def time_arm(layers, xs, iters: int):
    """(per-pass thread CPU times, launches per pass, the last pass's launches, cProfile) over `iters` passes."""
    from rlfp8.kernels._triton_utils import collect_launches
    from rlfp8.rollout.lora_layers import run_projection

    def one_pass():
        for layer, x in zip(layers, xs):
            run_projection(layer, x)

    with collect_launches() as rec:
        one_pass()                                   # warm: config tables and caches
        n_launch = len(rec)
        times = []
        for _ in range(iters):
            t0 = time.thread_time()
            one_pass()
            times.append(time.thread_time() - t0)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(iters):
            one_pass()
        prof.disable()
    return sorted(times), n_launch, list(rec[-n_launch:]), prof         # the last pass: caches warm


def print_parts(prof, n_calls: int, indent: str = "    ") -> None:
    rows = {}
    for (file, _line, func), (_cc, nc, _tt, ct, _callers) in pstats.Stats(prof).stats.items():
        if func in ENGINE_PARTS:
            tot = rows.get(func, (0, 0.0))
            rows[func] = (tot[0] + nc, tot[1] + ct)
    for name in ENGINE_PARTS:
        if name in rows:
            nc, ct = rows[name]
            print(f"{indent}{name:24s} {1e6 * ct / n_calls:8.1f} us   ({nc / n_calls:.1f} calls per projection)")


def launch_signature(records) -> list:
    """The recorded launches as comparable values (kernel, grid, per argument: tensor dtype/shape/strides/alignment
    or the value; a TMA descriptor's block and its tensor's), to show that two trees launch the same."""
    def arg(a):
        if isinstance(a, torch.Tensor):
            return ["tensor", str(a.dtype), list(a.shape), list(a.stride()), a.data_ptr() % 16]
        if type(a).__name__ == "TensorDescriptor":
            return ["tma", arg(a.base), list(a.shape), list(a.strides), list(a.block_shape)]
        return repr(a)
    return [[kern.fn.__name__, list(grid), [arg(a) for a in args], {k: arg(v) for k, v in sorted(kw.items())}]
            for kern, grid, args, kw in records]


def main(args) -> None:
    """The --engine mode of bench/lab/host_overhead.py (its arguments)."""
    from triton_binder import binder_us
    from rlfp8.kernels import dispatch
    from rlfp8.kernels.knobs import set_knobs
    torch.set_num_threads(1)
    set_knobs(backend="triton", pdl="auto" if args.pdl == "gpu" else "off", batch_invariant="auto",
              host_fast=not args.baseline)             # --baseline: no launch plans (the direct path)
    dispatch.triton_interpreting = lambda: True      # CPU tensors allowed to reach the Triton launchers
    if args.pdl == "gpu":
        _pdl_as_on_gpu(dispatch)
    if args.configs == "h200":
        _h200_configs()
    print(f"engine projection, Qwen3-8B layer (qkv, o, gate_up, down), T={args.tokens} r={RANK}, pdl={args.pdl}, "
          f"host_fast={not args.baseline}, "
          f"configs={args.configs}, meta_args {args.meta_args}-tuple, {args.iters} passes; us per projection call")
    dumped = {}
    for mode in ("w8a16", "w8a8"):
        for active in (True, False):
            layers = make_layers(mode, active, args.tokens, args.meta_args)
            xs = [torch.randn(args.tokens, K).bfloat16() for _, _, K in QWEN3_8B_LAYER]
            times, n_launch, rec, prof = time_arm(layers, xs, args.iters)
            n = len(layers)
            print(f"  {mode} adapter={'on ' if active else 'off'}: CPU time median {1e6 * times[len(times) // 2] / n:7.1f}"
                  f"  min {1e6 * times[0] / n:7.1f} us;  {n_launch / n:.1f} launches, binder "
                  f"{binder_us(rec):.1f} us each (sm_90)")
            print_parts(prof, n * args.iters)
            dumped[f"{mode} adapter={active}"] = launch_signature(rec)
            if args.top:
                pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    if args.dump_launches:
        import json
        from pathlib import Path
        Path(args.dump_launches).write_text(json.dumps(dumped, indent=1))
