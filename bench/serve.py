"""Serving benchmark: rlfp8's engine (the vLLM plugin) against vLLM's own paths, on the same FP8 weights.

    python bench/serve.py --out bench/results/serve_h200.json --engines ours_w8a16,vllm_bf16,ours_w8a8,vllm_fp8

Model: random weights in the Qwen3-8B shape (rlfp8/models/qwen3_8b.json, load_format="dummy", no tokenizer),
rank-64 adapters on all seven projections, CUDA graphs (torch.compile + graph capture at the listed batch
sizes; --graphs decode: full graphs of decode steps without torch.compile; the same settings for every engine).
Engines:
  ours_w8a16  quantization="rlfp8"          matched engine: FP8 weights, bf16 activations, rlfp8 K1+K2
  ours_w8a8   quantization="rlfp8_w8a8"     FP8 activations per token, rlfp8 K1+K2
  vllm_fp8    quantization="fp8_per_channel" vLLM's CUTLASS FP8 GEMM + its Triton LoRA kernels (baseline)
  vllm_bf16   unquantized bf16               vLLM's bf16 engine + its LoRA kernels (the no-mismatch baseline)
Measured per engine, every engine LoRA-enabled (max_loras=32) so that "without LoRA" compares like with like:
  tpot_ms[base|lora1]: batch-1 time per output token, from two greedy runs of 16 and 272 new tokens (the
                       difference cancels prefill and per-request overhead), median of 3;
  tput[base|tenants32]: 256 requests of 512 random prompt tokens and 256 new tokens (ignore_eos), output
                        tokens per second; tenants32 spreads the requests over 32 adapters. Three runs after a
                        32-request warm-up: `tput_cold_tok_s` is the first (it also pays whatever one-time work
                        the engine does at batch shapes it has not seen: Triton JIT, launch plans), `tput_tok_s`
                        the median of the other two (the engine in steady state, as over an RL run's steps).
--profile adds, per engine, one more throughput run of each kind under the CUDA profiler: GPU time per kernel
group and per generated token, the busy fraction (kernel time / wall), the costliest kernels (`profile`).
Each engine runs in its own process (a clean GPU). Ratios (ours / baseline) are written next to the numbers, for
engines of the same invocation only (each entry records its `run`: command and date).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

ENGINES = {"ours_w8a16": "rlfp8", "ours_w8a8": "rlfp8_w8a8", "vllm_fp8": "fp8_per_channel", "vllm_bf16": None}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CAPTURE = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def make_adapter(folder: Path, cfg: dict, rank: int) -> Path:
    """A random rank-r PEFT adapter for every projection of every layer (bf16), written once."""
    import torch
    from safetensors.torch import save_file
    if (folder / "adapter_model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H), "gate_proj": (H, I),
              "up_proj": (H, I), "down_proj": (I, H)}
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, (K, N) in shapes.items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, K, generator=g) / K ** 0.5).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(N, rank, generator=g) * 0.01).to(torch.bfloat16)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(TARGETS), "lora_dropout": 0.0,
        "bias": "none", "task_type": "CAUSAL_LM", "use_rslora": False}))
    return folder


GRAPH_MODES = {   # the same for every engine of one run
    "compiled": {"cudagraph_capture_sizes": CAPTURE},                        # vLLM's default: torch.compile + graphs
    "decode": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",              # full graphs of decode steps, no
               "cudagraph_capture_sizes": CAPTURE},                          # torch.compile: seconds per start
}


KERNEL_GROUPS = (   # (group, name pattern), first match wins; each engine runs alone, so a name means one side's kernel
    ("gemm+lora epilogue (rlfp8 K2)", r"_lora_gemm(_rs)?_kernel"),
    ("lora shrink (K1 / vLLM's)", r"lora_shrink"),
    ("lora expand (vLLM's)", r"lora_expand"),
    ("activation quant", r"quant"),
    ("attention + KV cache", r"flash|fmha|attn|attention|paged|reshape_and_cache|kv_cache"),  # FA3 is cutlass::
    ("gemm (cuBLAS / CUTLASS)", r"gemm|cutlass|nvjet|xmma|cublas|sm90_"),
    ("norm / activation / rope", r"norm|silu|act_and_mul|rotary|rope"),
    ("sampling", r"sample|topk|top_k|argmax|softmax|gumbel|exponential"),
)


def kernel_summary(kernels: list[tuple[str, float, int]], wall_s: float, tokens: int) -> dict:
    """Where a profiled run's GPU time went: [(kernel name, total device µs, calls)] grouped by KERNEL_GROUPS
    (µs per generated token; "other" for the rest), the busy fraction (summed kernel time / wall: well below 1
    means the GPU waits on the host), and the 20 costliest kernels."""
    groups: dict[str, float] = {}
    for kname, us, _ in kernels:
        g = next((g for g, pat in KERNEL_GROUPS if re.search(pat, kname, re.IGNORECASE)), "other")
        groups[g] = groups.get(g, 0.0) + us
    busy_us = sum(us for _, us, _ in kernels)
    top = sorted(kernels, key=lambda k: -k[1])[:20]
    return {"wall_s": wall_s, "tokens": tokens, "gpu_busy_fraction": busy_us / (wall_s * 1e6) if wall_s else None,
            "us_per_token": {g: us / tokens for g, us in sorted(groups.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": n[:160], "us": round(us, 1), "calls": c} for n, us, c in top]}


def run_engine(name: str, model_dir: str, adapter_dir: str, rank: int, out: str, graphs: str = "compiled",
               profile: bool = False, tput_runs: int = 3) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    quant = ENGINES[name]
    if quant and quant.startswith("rlfp8"):
        from rlfp8.rollout.vllm_plugin import register
        register()
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    t0 = time.time()
    kw = dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024,
              max_num_seqs=256, enable_lora=True, max_loras=32, max_cpu_loras=32, max_lora_rank=rank,
              enable_prefix_caching=False, gpu_memory_utilization=0.85, seed=0,
              compilation_config=dict(GRAPH_MODES[graphs]))
    if quant:
        kw["quantization"] = quant
    llm = LLM(**kw)
    start_s = time.time() - t0
    loras = [LoRARequest(f"t{i}", i + 1, adapter_dir) for i in range(32)]
    g = torch.Generator().manual_seed(1)

    def prompt(n):
        return {"prompt_token_ids": torch.randint(100, 150000, (n,), generator=g).tolist()}

    def timed(prompts, sp, lora):
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, lora_request=lora, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)

    def tpot(lora):
        p = [prompt(32)]
        short = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0, ignore_eos=True, detokenize=False)
        long = SamplingParams(max_tokens=272, min_tokens=272, temperature=0.0, ignore_eos=True, detokenize=False)
        timed(p, long, lora)                                            # warm-up
        vals = []
        for _ in range(3):
            ts, _ = timed(p, short, lora)
            tl, _ = timed(p, long, lora)
            vals.append((tl - ts) / 256 * 1e3)
        return statistics.median(vals)

    def throughput(tenants):
        prompts = [prompt(512) for _ in range(256)]
        sp = SamplingParams(max_tokens=256, min_tokens=256, temperature=0.0, ignore_eos=True, detokenize=False)
        lora = [loras[i % tenants] for i in range(256)] if tenants else None
        timed(prompts[:32], sp, lora[:32] if lora else None)            # warm-up (graphs, adapters loaded)
        runs = []
        for _ in range(tput_runs):  # the first full run also pays one-time work (JIT, launch plans) at new shapes
            dt, n = timed(prompts, sp, lora)
            runs.append(n / dt)
        return runs[0], statistics.median(runs[1:])

    def profiled(tenants):
        """One more throughput run under the CUDA profiler (its own numbers: CUPTI adds overhead)."""
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile
        prompts = [prompt(512) for _ in range(256)]
        sp = SamplingParams(max_tokens=256, min_tokens=256, temperature=0.0, ignore_eos=True, detokenize=False)
        lora = [loras[i % tenants] for i in range(256)] if tenants else None
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            dt, n = timed(prompts, sp, lora)
        rows = [(e.key, getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0), e.count)
                for e in prof.key_averages()]
        return kernel_summary([r for r in rows if r[1] > 0], dt, n)

    res = {"engine": name, "quantization": quant, "graphs": graphs, "start_s": round(start_s, 1), "tput_runs": tput_runs,
           "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("RLFP8_")},   # knobs set for the run
           "tpot_ms": {"base": tpot(None), "lora1": tpot(loras[0])},
           "tput_tok_s": {}, "tput_cold_tok_s": {}}
    for label, tenants in (("base", 0), ("tenants32", 32)):
        res["tput_cold_tok_s"][label], res["tput_tok_s"][label] = throughput(tenants)
    from rlfp8.kernels import dispatch
    res["kernels"] = dispatch.report()                  # the measured runs' paths, before any profiled run
    if profile:                 # a diagnostic after the measurements: its failure is recorded, not fatal to them
        res["profile"] = {}
        for label, tenants in (("base", 0), ("tenants32", 32)):
            try:
                res["profile"][label] = profiled(tenants)
            except Exception as e:
                res["profile"][label] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    res["peak_memory_gib"] = torch.cuda.max_memory_reserved() / 2**30
    Path(out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=1), flush=True)


def ratios(r: dict) -> dict:
    """ours / baseline for the pairs the issues name, only where both engines ran in one invocation (each entry's
    `run`; entries written before `run` existed count as one run): a file can gather engines of several calls."""
    out = {}

    def ratio(a, b, path):
        try:
            x, y = r[a], r[b]
            if x.get("run") != y.get("run"):
                return None
            for k in path:
                x, y = x[k], y[k]
            return x / y
        except (KeyError, TypeError, ZeroDivisionError):
            return None
    out["ours_w8a8_lora1_tpot_vs_vllm_fp8_lora1"] = ratio("ours_w8a8", "vllm_fp8", ("tpot_ms", "lora1"))
    out["ours_w8a8_tenants32_tput_vs_vllm_fp8"] = ratio("ours_w8a8", "vllm_fp8", ("tput_tok_s", "tenants32"))
    out["ours_w8a8_base_tpot_vs_vllm_fp8"] = ratio("ours_w8a8", "vllm_fp8", ("tpot_ms", "base"))
    out["ours_w8a8_base_tput_vs_vllm_fp8"] = ratio("ours_w8a8", "vllm_fp8", ("tput_tok_s", "base"))
    out["ours_w8a8_tenants32_cold_tput_vs_vllm_fp8"] = ratio("ours_w8a8", "vllm_fp8", ("tput_cold_tok_s", "tenants32"))
    out["ours_w8a8_base_cold_tput_vs_vllm_fp8"] = ratio("ours_w8a8", "vllm_fp8", ("tput_cold_tok_s", "base"))
    out["ours_w8a16_lora1_tpot_vs_vllm_bf16_lora1"] = ratio("ours_w8a16", "vllm_bf16", ("tpot_ms", "lora1"))
    out["ours_w8a16_tenants32_tput_vs_vllm_bf16"] = ratio("ours_w8a16", "vllm_bf16", ("tput_tok_s", "tenants32"))
    out["ours_w8a16_tenants32_cold_tput_vs_vllm_bf16"] = ratio("ours_w8a16", "vllm_bf16",
                                                              ("tput_cold_tok_s", "tenants32"))
    out["ours_w8a16_lora1_tpot_vs_ours_w8a8"] = ratio("ours_w8a16", "ours_w8a8", ("tpot_ms", "lora1"))
    return {k: v for k, v in out.items() if v is not None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--work", default="/tmp/rlfp8-serve")
    ap.add_argument("--graphs", default="compiled", choices=list(GRAPH_MODES),
                    help="compiled: torch.compile + CUDA graphs (vLLM's default, minutes per start; the issue's "
                         "numbers); decode: full CUDA graphs of decode steps without torch.compile (seconds)")
    ap.add_argument("--profile", action="store_true",
                    help="after the measurements, one more throughput run per engine (no LoRA, 32 tenants) under "
                         "the CUDA profiler: GPU time per kernel group and per token, busy fraction, top kernels")
    ap.add_argument("--tput-runs", type=int, default=3,
                    help="full throughput runs per workload (>= 2): the first is reported as cold, the median of the "
                         "rest as steady state (2 fits a compiled pair, two ~3-minute starts, into one 10-minute call)")
    ap.add_argument("--one", help=argparse.SUPPRESS)           # internal: run one engine in this process
    args = ap.parse_args(argv)
    if args.tput_runs < 2:
        raise SystemExit(f"--tput-runs {args.tput_runs}: at least 2 (one cold run, then the steady-state ones)")
    work = Path(args.work)
    from rlfp8.models import architecture_config, random_model_folder
    model_dir = random_model_folder("qwen3_8b", work / "qwen3_8b")
    if args.one:
        run_engine(args.one, str(model_dir), str(work / "adapter"), args.rank, str(work / f"{args.one}.json"),
                   args.graphs, args.profile, args.tput_runs)
        return 0
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else {"engines": {}, "graphs": args.graphs}
    if result.get("graphs", "compiled") != args.graphs:
        raise SystemExit(f"--out {out} holds engines run with --graphs {result.get('graphs', 'compiled')}; ratios "
                         f"compare one mode: give another --out for --graphs {args.graphs}")
    unknown = [n for n in args.engines.split(",") if n not in ENGINES]
    if unknown:
        raise SystemExit(f"--engines: {unknown} not in {list(ENGINES)}")
    make_adapter(work / "adapter", architecture_config("qwen3_8b"), args.rank)
    run = {"command": " ".join([sys.executable] + sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    result.update({**run, "graphs": args.graphs})
    for name in args.engines.split(","):
        p = subprocess.run([sys.executable, __file__, "--out", args.out, "--one", name, "--rank", str(args.rank),
                            "--work", str(work), "--graphs", args.graphs, "--tput-runs", str(args.tput_runs)]
                           + ["--profile"] * args.profile,
                           capture_output=True, text=True)
        (work / f"{name}.log").write_text(p.stdout + "\n---- stderr ----\n" + p.stderr)
        part = work / f"{name}.json"
        result["engines"][name] = {**(json.loads(part.read_text()) if p.returncode == 0 and part.exists()
                                      else {"error": p.stderr[-3000:]}), "run": run}
        result["ratios"] = ratios(result["engines"])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(name, json.dumps(result["engines"][name])[:600], flush=True)
    import torch
    import triton
    import vllm
    result["versions"] = {"torch": torch.__version__, "triton": triton.__version__, "vllm": vllm.__version__,
                          "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["ratios"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
