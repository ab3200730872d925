"""Where the trainer's time goes inside one RL update, without Ray: PolicyTrainer in this process on a
synthetic batch shaped like the quickstart's (96 sequences of ~40 prompt + 16 response tokens).

    python bench/lab/trainer_trace.py --out-dir /tmp/trace [--host-fast both|on|off] [config overrides ...]

For each trainer.micro_batch_tokens in --micro-batches: warm-up steps, then timed train_step and score_tokens
calls (CUDA synchronised), the number of Triton compilations during the timed calls (a shape that recompiles
every step shows here), then one profiled train_step: torch.profiler's tables (self CPU time, CUDA time)
and cProfile's top functions by own time, written as text files. --host-fast both (default) runs every
micro-batch size twice, with the kernel knob host_fast on (the training linear's host fast paths) and off
(the plain path), and prints the mean train_step of each arm: ours vs the baseline in one run.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def synthetic_batch(n: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    from rlfp8.trainer.interface import Rollouts
    rng = random.Random(seed)
    ids, plens, lps, adv = [], [], [], []
    for i in range(n):
        p = prompt_len + rng.randint(-4, 4)
        r = rng.randint(response_len // 2, response_len)
        ids.append([rng.randrange(100, vocab) for _ in range(p + r)])
        plens.append(p)
        lps.append([-rng.random() for _ in range(r)])
        adv.append(rng.gauss(0, 1))
    return Rollouts(ids, plens, lps, adv)


class CompileCounter:
    """Counts Triton kernel compilations (jit_post_compile_hook) while active."""

    def __init__(self):
        self.n = 0

    def __enter__(self):
        import triton
        self.old = triton.knobs.runtime.jit_post_compile_hook
        triton.knobs.runtime.jit_post_compile_hook = self._hook
        return self

    def _hook(self, *a, **k):
        self.n += 1

    def __exit__(self, *exc):
        import triton
        triton.knobs.runtime.jit_post_compile_hook = self.old


def timed(fn, sync):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def trace_one(overrides: list[str], mb: int, out_dir: Path, args, host_fast: str = "on") -> dict:
    import torch

    from rlfp8.config import compose_dict
    from rlfp8.kernels import dispatch
    from rlfp8.kernels.knobs import knobs
    from rlfp8.trainer.actor import apply_trainer_kernel_knobs
    from rlfp8.trainer.core import PolicyTrainer
    from rlfp8.trainer.hf_models import resolve_model
    cfg = compose_dict(["recipe=quickstart", f"trainer.micro_batch_tokens={mb}", *overrides,
                        f"kernels.host_fast={'true' if host_fast == 'on' else 'false'}"])
    apply_trainer_kernel_knobs(cfg)             # as the trainer actor does (knobs, batch_invariant rule)
    dispatch.reset_report()
    path = str(resolve_model(cfg["model"]["path"], cfg["cache_dir"], seed=cfg["seed"]))
    trainer = PolicyTrainer(path, cfg)
    vocab = trainer.model.config.vocab_size
    batch = synthetic_batch(args.rows, args.prompt_len, args.response_len, vocab)
    probe = synthetic_batch(8, args.prompt_len, args.response_len, vocab, seed=1)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(args.warmup):
        trainer.train_step(batch)
        trainer.score_tokens(probe.input_ids, probe.prompt_lens)
    row = {"micro_batch_tokens": mb, "host_fast": host_fast, "train_step_s": [], "score_tokens_s": []}
    with CompileCounter() as cc:
        for _ in range(args.steps):
            row["train_step_s"].append(timed(lambda: trainer.train_step(batch), sync)[0])
            row["score_tokens_s"].append(timed(lambda: trainer.score_tokens(probe.input_ids, probe.prompt_lens),
                                               sync)[0])
    row["triton_compiles_in_timed_steps"] = cc.n
    row["kernels"] = dispatch.report()
    row["kernel_knobs"] = dataclasses.asdict(knobs())          # what the arm really ran with
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        trainer.train_step(batch)
        sync()
    tag = f"mb{mb}" + ("" if host_fast == "on" else "_plain")
    (out_dir / f"{tag}_cpu_self.txt").write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    if torch.cuda.is_available():
        (out_dir / f"{tag}_cuda.txt").write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
    pr = cProfile.Profile()
    pr.enable()
    trainer.train_step(batch)
    sync()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(45)
    (out_dir / f"{tag}_cprofile.txt").write_text(s.getvalue())
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45)
    (out_dir / f"{tag}_cprofile_cum.txt").write_text(s.getvalue())
    del trainer
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--micro-batches", default="8192,2048")
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=42)
    ap.add_argument("--response-len", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--host-fast", default="both", choices=("both", "on", "off"),
                    help="kernel knob host_fast per arm (files of the off arm end in _plain)")
    args, overrides = ap.parse_known_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arms = ("on", "off") if args.host_fast == "both" else (args.host_fast,)
    rows = [trace_one(overrides, int(mb), out, args, arm) for mb in args.micro_batches.split(",") for arm in arms]
    for r in rows:
        mean = sum(r["train_step_s"]) / len(r["train_step_s"])
        print(f"mb {r['micro_batch_tokens']} host_fast={r['host_fast']}: train_step mean {mean:.3f} s "
              f"{[round(x, 3) for x in r['train_step_s']]}, "
              f"score_tokens {[round(x, 3) for x in r['score_tokens_s']]} s, "
              f"{r['triton_compiles_in_timed_steps']} Triton compiles in the timed calls")
    (out / "trainer_trace.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
