"""CPU proxy of the FP8 training linear's host (Python + aten dispatch) cost per projection call, no GPU needed.

    python bench/lab/host_overhead.py [--tokens 64] [--iters 20] [--device cpu|meta] [--baseline] [--top N]
    python bench/lab/host_overhead.py --engine [...]     the engine's projection instead (engine_host_overhead.py)

Runs lora_linear_triton forward + backward over the quickstart's 7 projection shapes (SmolLM2-135M, LoRA r16)
with `collect_launches()` active: the Triton launches are recorded, not run, so what is timed is the host code
around them (argument checks, config choice, casts, torch.empty/mm, autograd). The default device "cpu" runs
the aten ops for real at a small token count (64: the compute is then small beside the dispatch); "meta"
computes nothing but runs some ops' Python meta functions, which CUDA does not. Not covered: CUDA
streams/events (the side stream of the backward) and Triton's JITFunction.run, which need a GPU; the binder (Triton's argument specialization, the largest Python part of
jit.run) is timed separately on the recorded launches, as jit.run would call it for sm_90.
--baseline sets the kernel knob host_fast=false (the plain path; rlfp8/kernels/knobs.py lists what it switches).
Prints microseconds per call: the thread's CPU time per pass (median and min over --iters; steadier than wall
time on a loaded machine), then a per-part split from cProfile (which inflates everything it times).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from triton_binder import binder_us

# (name, N, K) of SmolLM2-135M's projections (hidden 576, 9 heads / 3 KV heads of 64, MLP 1536)
QUICKSTART_SHAPES = (("q", 576, 576), ("k", 192, 576), ("v", 192, 576), ("o", 576, 576),
                     ("gate", 1536, 576), ("up", 1536, 576), ("down", 576, 1536))
PARTS = ("linear_triton.py:forward", "linear_triton.py:backward", "lora_shrink_triton", "lora_gemm_triton",
         "dy_prep_triton", "_mm_f32", "check_lora_gemm_args", "_pick_config", "launch", "adapter_operands")


class Projection(torch.nn.Module):
    """One FP8LoRALinear-like projection on `device` (codes not quantized: nothing is computed from them)."""

    def __init__(self, N: int, K: int, r: int, device: str):
        from rlfp8.trainer.fp8_lora import FP8LoRALinear
        super().__init__()
        self.mod = FP8LoRALinear(K, N, r, alpha=2 * r).to(device)
        self.mod.qweight = torch.zeros(N, K, device=device).to(torch.float8_e4m3fn)
        self.mod.weight_scale = torch.ones(N, device=device)


def make_projections(r: int, device: str) -> list:
    return [Projection(N, K, r, device).mod for _, N, K in QUICKSTART_SHAPES]


def one_pass(mods, xs) -> None:
    """Forward every projection, then one backward through all of them (as a layer's would)."""
    outs = [m(x) for m, x in zip(mods, xs)]
    torch.autograd.backward(outs, [torch.ones_like(y) for y in outs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64, help="few: the cpu device computes the aten ops")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cpu", choices=("cpu", "meta"),
                    help="meta: nothing computed, but elementwise ops run Python meta functions (slower than CUDA's)")
    ap.add_argument("--baseline", action="store_true", help="kernel knob host_fast=false")
    ap.add_argument("--top", type=int, default=0, help="also print cProfile's top N functions by own time")
    ap.add_argument("--engine", action="store_true",
                    help="the engine projection (run_projection) at Qwen3-8B shapes: engine_host_overhead.py")
    ap.add_argument("--meta-args", type=int, default=7, choices=(6, 7), help="--engine: vLLM meta_args tuple form")
    ap.add_argument("--pdl", default="gpu", choices=("gpu", "off"), help="--engine: PDL resolved as on an H200, or off")
    ap.add_argument("--configs", default="h200", choices=("h200", "heuristic"), help="--engine: K2's config table")
    ap.add_argument("--dump-launches", default=None, help="--engine: write the recorded launches (json) here, to "
                    "compare two trees")
    args = ap.parse_args()
    if args.engine:
        import engine_host_overhead
        return engine_host_overhead.main(args)
    torch.set_num_threads(1)                         # CPU time of one thread = the host cost (a shared machine)
    from rlfp8.kernels import dispatch
    from rlfp8.kernels._triton_utils import collect_launches
    from rlfp8.kernels.knobs import set_knobs
    import dataclasses

    from rlfp8.kernels.knobs import KernelKnobs
    set_knobs(backend="triton")
    if "host_fast" in {f.name for f in dataclasses.fields(KernelKnobs)}:     # absent in trees before it (--before)
        set_knobs(host_fast=not args.baseline)
    dispatch.triton_interpreting = lambda: True      # CPU tensors allowed to reach the Triton launchers
    mods = make_projections(args.rank, args.device)
    xs = [torch.randn(args.tokens, K, device=args.device).bfloat16().requires_grad_() for _, _, K in
          QUICKSTART_SHAPES]
    n_calls = len(mods) * args.iters
    with collect_launches() as rec:
        one_pass(mods, xs)                            # warm: config tables, first-call checks
        launches_per_pass = len(rec)
        per_pass = []
        for _ in range(args.iters):
            t0 = time.thread_time()
            one_pass(mods, xs)
            per_pass.append(time.thread_time() - t0)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.iters):
            one_pass(mods, xs)
        prof.disable()
    print(f"host_fast={not args.baseline} device={args.device} T={args.tokens} r={args.rank}: "
          f"{len(mods)} projections x {args.iters} iters, {launches_per_pass} launches per pass")
    per_pass.sort()
    print(f"  forward+backward, this thread's CPU time (no profiler): median {1e6 * per_pass[len(per_pass) // 2] / len(mods):.1f}"
          f" us, min {1e6 * per_pass[0] / len(mods):.1f} us per projection call")
    stats = pstats.Stats(prof)
    rows = {}
    for (file, _line, func), (_cc, nc, _tt, ct, _callers) in stats.stats.items():
        for name in (func, f"{Path(file).name}:{func}"):
            if name in PARTS:
                tot = rows.get(name, (0, 0.0))
                rows[name] = (tot[0] + nc, tot[1] + ct)
    print("  per part under cProfile (cumulative us per projection call; parts nest):")
    for name in PARTS:
        if name in rows:
            nc, ct = rows[name]
            print(f"    {name:24s} {1e6 * ct / n_calls:8.1f} us   ({nc / n_calls:.1f} calls per projection)")
    print(f"  Triton binder (jit.run's specialization, sm_90), per launch: {binder_us(rec[:launches_per_pass]):.1f} us"
          f"  x {launches_per_pass / len(mods):.1f} launches per projection")
    if args.top:
        stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
