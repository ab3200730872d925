"""DoRA training linear on the H200 (issue 16): ours (FP8 base, factored norm, g in K2's epilogue) vs PEFT's
DoRA (bf16 base, fp32 adapters, its default) vs our own FP8 LoRA; forward+backward of one projection.

Per iteration (one optimizer step with one micro-batch): ours computes the row norm once (A and B changed),
then forward + backward; PEFT recomputes its dense norm inside every forward. Timing: CUDA events around each
arm, the arms interleaved per round (paired), median over rounds. Memory: peak allocated during one
iteration above the resident set before it, and the norm's transient memory alone (peak during the norm
minus the memory before it; for PEFT, the dense norm call get_weight_norm(W, B(A(eye))ᵀ, s) as its forward
runs it).

    python bench/dora.py                      # all shapes/ranks, JSON to bench/results/dora_h200.json
    python bench/dora.py --ranks 384 --rounds 10
Targets (issue 16): fwd+bwd <= 0.5x PEFT DoRA at r=384 on both shapes; ours DoRA <= 1.25x ours LoRA; the
norm's transient memory <= 0.1x PEFT's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlfp8.kernels import dispatch, fp8  # noqa: E402
from rlfp8.kernels import dora as kdora  # noqa: E402
from rlfp8.kernels.linear import lora_linear  # noqa: E402

DEV = "cuda"
SHAPES = {"8192x8192": (8192, 8192), "8192x28672": (8192, 28672)}     # (N out, K in): o_proj-like, down_proj


def _ours(N, K, r, T):
    """Our arms on one projection: DoRA (the norm once per iteration, as once per optimizer step) and LoRA."""
    torch.manual_seed(0)
    w = torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * 0.02
    q, sw = fp8.quantize_weight(w)
    s = 2.0
    A = (torch.randn(r, K, device=DEV) * 0.01).requires_grad_()
    B = (torch.randn(N, r, device=DEV) * 0.01).requires_grad_()
    w_sq = kdora.weight_sq_norm(q, sw)
    m = w_sq.sqrt().clone().requires_grad_()
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, N, device=DEV, dtype=torch.bfloat16)

    def ours_norm():
        return kdora.dora_row_norm(q, sw, A, B, s, w_sq)

    def ours_dora():
        y = kdora.dora_linear(x, q, sw, A, B, m, ours_norm(), s)
        y.backward(dy)

    def ours_lora():
        y = lora_linear(x, q, sw, A, B, s)
        y.backward(dy)

    return dict(w=w, A=A, B=B, x=x, dy=dy, s=s), {"ours_dora": ours_dora, "ours_lora": ours_lora}, ours_norm


def _arms(N, K, r, T):
    t, fns, ours_norm = _ours(N, K, r, T)
    w, A, B, x, dy, s = t["w"], t["A"], t["B"], t["x"], t["dy"], t["s"]
    import peft
    lin = torch.nn.Linear(K, N, bias=False, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    model = peft.get_peft_model(torch.nn.Sequential(lin), peft.LoraConfig(r=r, lora_alpha=s * r, target_modules=["0"],
                                                                         use_dora=True, lora_dropout=0.0))
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(A)
        layer.lora_B["default"].weight.copy_(B)
    model.train()

    def peft_dora():
        y = model(x)
        y.backward(dy)

    def peft_norm():
        with torch.no_grad():
            mag = layer.lora_magnitude_vector["default"]
            lw = mag.get_lora_weight(lora_A=layer.lora_A["default"], lora_B=layer.lora_B["default"])
            return mag.get_weight_norm(layer.weight.to(torch.float32), lw.detach(), s)

    return {"ours_dora": fns["ours_dora"], "peft_dora": peft_dora, "ours_lora": fns["ours_lora"]}, \
        {"ours_dora": ours_norm, "peft_dora": peft_norm}


def _precompile(cases, T) -> dict:
    """Compile every Triton kernel our arms launch, in parallel, before timing anything: launched one after
    another on a cold cache, the compilations alone took most of the 60 s that bench/gpu_session.sh allows."""
    from rlfp8.kernels import _triton_utils as tu
    with tu.collect_launches() as rec:
        for N, K, r in cases:
            _, fns, _ = _ours(N, K, r, T)
            for f in fns.values():
                f()
    torch.cuda.empty_cache()
    info = tu.precompile(rec, jobs=min(16, os.cpu_count() or 4))
    dispatch.reset_report()
    return info


def _time(fns: dict, rounds: int, warmup: int = 3) -> dict:
    for f in fns.values():
        for _ in range(warmup):
            f()
    torch.cuda.synchronize()
    ms = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():                      # paired: every arm once per round
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            f()
            b.record()
            torch.cuda.synchronize()
            ms[k].append(a.elapsed_time(b))
    return {k: statistics.median(v) for k, v in ms.items()}


def _peak_above_resident(f) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = f()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak


def run_case(N, K, r, T, rounds):
    fns, norms = _arms(N, K, r, T)
    times = _time(fns, rounds)
    mem = {k: _peak_above_resident(f) for k, f in fns.items()}
    norm_mem = {k: _peak_above_resident(f) for k, f in norms.items()}
    n_ours, n_peft = norms["ours_dora"](), norms["peft_dora"]()
    norm_rel_err = ((n_ours.double() - n_peft.double()).abs().max() / n_peft.double().abs().max()).item()
    return {"N": N, "K": K, "rank": r, "tokens": T, "ms": times, "peak_bytes_above_resident": mem,
            "norm_transient_bytes": norm_mem, "norm_rel_err_vs_peft": norm_rel_err,
            "ratio_ours_vs_peft": times["ours_dora"] / times["peft_dora"],
            "ratio_dora_vs_lora": times["ours_dora"] / times["ours_lora"],
            "norm_mem_ratio_vs_peft": norm_mem["ours_dora"] / max(norm_mem["peft_dora"], 1)}


def _versions() -> dict:
    import peft
    import triton
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    return {"torch": torch.__version__, "triton": triton.__version__, "peft": peft.__version__,
            "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(), "commit": commit}


def verdicts(rows) -> dict:
    at = [x for x in rows if x["rank"] == 384]
    return {"fwd_bwd_le_0.5x_peft_r384": all(x["ratio_ours_vs_peft"] <= 0.5 for x in at),
            "dora_le_1.25x_lora_r384": all(x["ratio_dora_vs_lora"] <= 1.25 for x in at),
            "norm_mem_le_0.1x_peft": all(x["norm_mem_ratio_vs_peft"] <= 0.1 for x in rows)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--ranks", nargs="+", type=int, default=[64, 384, 512])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "dora_h200.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/dora.py needs a CUDA GPU")
    info = _precompile([(*SHAPES[name], r) for name in args.shapes for r in args.ranks], args.tokens)
    print(json.dumps({"precompile": info}), flush=True)
    rows = []
    for name in args.shapes:
        for r in args.ranks:
            N, K = SHAPES[name]
            dispatch.reset_report()
            row = run_case(N, K, r, args.tokens, args.rounds)
            row["shape"], row["dispatch"] = name, dispatch.report()
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("shape", "rank", "ms", "ratio_ours_vs_peft", "ratio_dora_vs_lora",
                                                  "norm_transient_bytes", "norm_mem_ratio_vs_peft",
                                                  "peak_bytes_above_resident")}), flush=True)
            torch.cuda.empty_cache()
    out = {"command": " ".join(["python", "bench/dora.py", *(argv if argv is not None else sys.argv[1:])]),
           "versions": _versions(), "precompile": info, "rows": rows, "verdicts": verdicts(rows)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out["verdicts"]))


if __name__ == "__main__":
    main()
