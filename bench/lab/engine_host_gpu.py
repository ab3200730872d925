"""The engine projection's host cost per call on a GPU, eager (no CUDA graphs), no vLLM: run_projection on stand-ins
of vLLM's LoRA layers (engine_host_overhead.FakeLoRALayer, random FP8 codes) and of its LoRAKernelMeta, at one
Qwen3-8B decoder layer's shapes (qkv, o, gate_up, down), T = 64 decode tokens, rank 64, the kernels really run.

    python bench/lab/engine_host_gpu.py [--tokens 64] [--iters 200] [--arms plans,direct] [--out X.json]

Per arm (knob host_fast: on = launch plans replayed, off = the direct path) x mode (w8a16, w8a8) x adapter
(on: every token slot 0; off: vLLM's no_lora flag): the host's wall time per projection call, from a loop of
--iters passes that never waits for the GPU, and the GPU time per pass from CUDA events around the same loop.
When the host time per pass is above the GPU's, the loop is host bound and the host time is what eager decoding
pays per projection; below, the GPU hides it. Run the same script in an older tree (copy bench/lab/engine_host_*.py
and host_overhead.py there) for the before numbers; bench/README.md, lab/host_overhead.py section.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch


def time_arm(layers, xs, iters: int) -> dict:
    from rlfp8.rollout.lora_layers import run_projection

    def one_pass():
        for layer, x in zip(layers, xs):
            run_projection(layer, x)
    for _ in range(5):                                   # warm: compile / load kernels, capture plans
        one_pass()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        one_pass()
    host_s = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    n = len(layers) * iters
    return {"host_us_per_call": 1e6 * host_s / n, "gpu_us_per_call": 1e3 * start.elapsed_time(end) / n}


def precompile_all(eho, tokens: int) -> None:
    """Compile every kernel the arms launch in parallel first (collect_launches + precompile, as the engine's
    warm-up does), so the timed loops load binaries."""
    from rlfp8.kernels._triton_utils import collect_launches, precompile
    from rlfp8.rollout.lora_layers import run_projection
    records = []
    for mode in ("w8a16", "w8a8"):
        for active in (True, False):
            layers = eho.make_layers(mode, active, tokens, 7, device="cuda")
            with collect_launches() as rec:
                for layer, (_, _, K) in zip(layers, eho.QWEN3_8B_LAYER):
                    run_projection(layer, torch.randn(tokens, K, device="cuda").bfloat16())
            records += rec
            del layers
    print("precompile:", precompile(records, jobs=16), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--arms", default="plans,direct", help="plans = knob host_fast on, direct = off")
    ap.add_argument("--out", default=None, help="write the numbers as json here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("engine_host_gpu.py needs a CUDA GPU (the CPU proxy: host_overhead.py --engine)")
    import engine_host_overhead as eho
    from rlfp8.kernels import dispatch
    from rlfp8.kernels.knobs import set_knobs
    results = {}
    precompile_all(eho, args.tokens)
    for mode in ("w8a16", "w8a8"):
        for active in (True, False):
            layers = eho.make_layers(mode, active, args.tokens, 7, device="cuda")
            xs = [torch.randn(args.tokens, K, device="cuda").bfloat16() for _, _, K in eho.QWEN3_8B_LAYER]
            for arm in args.arms.split(","):
                set_knobs(host_fast=arm == "plans")
                r = results[f"{mode} adapter={'on' if active else 'off'} {arm}"] = time_arm(layers, xs, args.iters)
                print(f"{mode} adapter={'on ' if active else 'off'} {arm:6s}: host {r['host_us_per_call']:7.1f} us, "
                      f"GPU {r['gpu_us_per_call']:7.1f} us per projection call", flush=True)
            del layers, xs
            torch.cuda.empty_cache()
    print("dispatch:", {k: v for k, v in dispatch.report().items() if k.startswith(("engine", "lora_gemm.launch"))})
    if args.out:
        Path(args.out).write_text(json.dumps({"tokens": args.tokens, "iters": args.iters, "results": results},
                                             indent=1))


if __name__ == "__main__":
    main()
