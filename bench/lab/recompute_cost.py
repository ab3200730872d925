"""What trainer.gradient_checkpointing=auto buys: one PolicyTrainer (no Ray, no engine) on a real-shape random
model, the same synthetic batch trained with every layer checkpointed (verl's recipes) and with auto, in turn.

    python bench/lab/recompute_cost.py --arch qwen3_32b --layers 16 --rows 8 --length 4096 --out /tmp/rc.json
    python bench/lab/recompute_cost.py --arch qwen3_8b --layers 4 --rows 2 --length 256 --micro-batch 1024 \
        --dtype float32 --steps 2 --modes true,auto,false      # CPU: ~5 min (bf16 matmuls on a CPU are far slower)

--layers keeps the architecture's widths and cuts its depth (a 64-layer 32B trainer with 4k rows needs the GPU
to itself; the cost per layer is what scales). Per arm: train_step seconds (warm-up steps first, CUDA
synchronised), trained tokens/s, the layers auto checkpointed, its measured saved bytes per token and layer, the
peak of this process's allocations over the step (GPU) and the largest gradient difference from the first arm
(the update must not change). `--free-gib` caps what auto may plan with (default: what the device has free),
to show the arm at the memory a placement leaves. Results: JSON with the command, GPU and versions.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def synthetic_batch(*args, **kwargs):
    """trainer_trace.synthetic_batch, loaded by path (this folder is not put on sys.path by an importer)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_lab_trainer_trace", Path(__file__).with_name("trainer_trace.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.synthetic_batch(*args, **kwargs)


def train_steps(trainer, mode, args, sync):
    """--warmup + --steps train_steps on the synthetic batch: the timed seconds, the last metrics, the gradients
    of the last step (taken before its optimizer step)."""
    import torch
    batch = synthetic_batch(args.rows, 32, args.length, trainer.model.config.vocab_size, seed=0)
    seconds, metrics, grads = [], {}, None
    orig_step = trainer.optimizer.step

    def grab(*a, **k):
        nonlocal grads
        grads = [p.grad.detach().float().clone() for p in trainer.params]
        return orig_step(*a, **k)
    trainer.optimizer.step = grab
    for i in range(args.warmup + args.steps):
        if trainer.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        metrics = trainer.train_step(batch)
        sync()
        if i >= args.warmup:
            seconds.append(time.perf_counter() - t0)
        print(f"  {mode}: step {i} {time.perf_counter() - t0:.2f} s, {int(metrics['train/checkpointed_layers'])} "
              f"layers checkpointed", flush=True)
    return seconds, metrics, grads


def run_arm(arch_json: Path, mode, args, sync) -> tuple[dict, list]:
    import gc

    import torch

    from rlfp8.config import compose_dict
    from rlfp8.trainer import checkpointing
    from rlfp8.trainer.core import PolicyTrainer
    from rlfp8.trainer.hf_models import resolve_model
    cfg = compose_dict([f"model.path=random:{arch_json}", f"model.dtype={args.dtype}", f"adapter.rank={args.rank}",
                        f"trainer.gradient_checkpointing={mode}", f"trainer.micro_batch_tokens={args.micro_batch}",
                        f"algo.max_response_len={args.length}", f"engine.max_model_len={args.length + 64}",
                        ])
    trainer = PolicyTrainer(str(resolve_model(cfg["model"]["path"], Path(args.cache))), cfg)
    measured_free = checkpointing.free_bytes
    if args.free_gib is not None:
        checkpointing.free_bytes = lambda device: args.free_gib * 2**30
    try:
        seconds, metrics, grads = train_steps(trainer, mode, args, sync)
    finally:
        checkpointing.free_bytes = measured_free
    out = {"mode": mode, "step_s": seconds, "step_s_median": sorted(seconds)[len(seconds) // 2],
           "tokens": metrics["train/tokens"], "checkpointed_layers": metrics["train/checkpointed_layers"],
           "saved_kib_per_token_layer": metrics.get("train/saved_kib_per_token_layer"),
           "activations_gib": metrics.get("memory/trainer_activations_gib"),
           "peak_gib": metrics.get("memory/trainer_peak_gib")}
    out["tokens_per_s"] = out["tokens"] / out["step_s_median"]
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()          # the next arm plans with what this one held
    return out, grads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3_8b", help="rlfp8/models/<arch>.json, or a .json path")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers kept (default: all)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024, help="response tokens per row (rows are 32 + up to this)")
    ap.add_argument("--micro-batch", type=int, default=8192, help="trainer.micro_batch_tokens")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", help="model.dtype (float32 on a CPU without native bf16)")
    ap.add_argument("--modes", default="true,auto", help="arms in order; the first is the gradient reference")
    ap.add_argument("--free-gib", type=float, default=None, help="what auto may plan with (default: measured)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "rlfp8-recompute-cost"))
    ap.add_argument("--out", help="result JSON")
    args = ap.parse_args(argv)

    import torch

    from rlfp8.models import architecture_config
    from rlfp8.provenance import command, versions
    arch = architecture_config(args.arch)
    if args.layers is not None:
        arch = {**arch, "num_hidden_layers": args.layers}
    Path(args.cache).mkdir(parents=True, exist_ok=True)
    arch_json = Path(args.cache) / f"{Path(args.arch).stem}-{arch['num_hidden_layers']}l.json"
    arch_json.write_text(json.dumps(arch, indent=1))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    arms, ref = [], None
    for mode in args.modes.split(","):
        print(f"arm gradient_checkpointing={mode}", flush=True)
        arm, grads = run_arm(arch_json, mode, args, sync)
        if ref is None:
            ref = grads
        arm["max_rel_grad_diff_vs_first"] = max(float((a - b).norm() / b.norm().clamp(min=1e-30))
                                                for a, b in zip(grads, ref))
        arms.append(arm)
        print(json.dumps(arm), flush=True)
    base = arms[0]["step_s_median"]
    for arm in arms:
        arm["step_ratio_vs_first"] = arm["step_s_median"] / base
    result = {"command": command(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "environment": versions(),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
              "arch": args.arch, "layers": arch["num_hidden_layers"], "rows": args.rows, "length": args.length,
              "micro_batch_tokens": args.micro_batch, "rank": args.rank, "dtype": args.dtype, "free_gib": args.free_gib, "arms": arms}
    print(" | ".join(f"{a['mode']}: {a['step_s_median']:.2f} s ({a['step_ratio_vs_first']:.3f}x), "
                     f"{int(a['checkpointed_layers'])} checkpointed" for a in arms))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
