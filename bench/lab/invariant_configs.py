#!/usr/bin/env python
"""bench/lab/invariant_configs.py (H200, < 3 min): the batch-invariant K1/K2 schedules (knob batch_invariant,
rlfp8/kernels/gemm_configs.py) against the tuned per-token-count configs, for the Qwen3-8B projections (qkv
4096->6144, o 4096->4096, gate_up 4096->24576, down 12288->4096; rank 64) at M = 1, 8, 64, 256, 1024, 4096.

Per projection and M, three arms (knob off = tuned, on = invariant; free_bk = invariant with each bucket's
fastest measured BLOCK_K, a probe of whether BLOCK_K must be pinned: _free_bk_config):
  * time: the engine's projection (fp8_lora_linear: K1 + K2, vLLM-style metadata, 4 stacked slots, every
    token on slot 0), CUDA graphs replayed in turn with L2 flushed (bench/kernel_bench.py Timer), median of --reps;
    at M >= 1024 also the trainer's forward (lora_linear: meta=None, one adapter; > 512 tokens may take the
    Gluon main loop);
  * bits: row r of the first M rows of one 4096-token x, computed inside a batch of M rows (two tenants and
    tokens without adapter, assigned by position), against the same row inside the 4096-row batch
    ("rows_differing_across_M"), and the trainer's rows (slot 0) against the trainer's forward on all 4096
    rows ("engine_vs_trainer_rows_differing"). The invariant arm must report 0 everywhere.
    python bench/lab/invariant_configs.py --out bench/results/invariant_configs_h200.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import kernel_bench as kb  # noqa: E402  (Timer, PROJ)
from rlfp8.kernels import build_lora_meta, dispatch, fp8_lora_linear  # noqa: E402
from rlfp8.kernels.fp8_triton import quantize_weight_triton  # noqa: E402
from rlfp8.kernels import gemm_triton  # noqa: E402
from rlfp8.kernels.gemm_configs import (GemmConfig, config_key, gemm_config, invariant_gemm_config,  # noqa: E402
                                        reduction_schedule, tuned_table_path)
from rlfp8.kernels.knobs import restore_knobs, set_knobs  # noqa: E402
from rlfp8.kernels.linear import lora_linear  # noqa: E402

DEV = "cuda"
MS = (1, 8, 64, 256, 1024, 4096)
RANK, SLOTS, T_MAX = 64, 4, 4096
ARMS = {"tuned": "off", "invariant": "on", "free_bk": "on"}


def _free_bk_config(mode, M, N, K, device=None):
    """Arm free_bk, a probe of one assumption: the invariant schedule's SPLIT_K and swap-AB, but each bucket's
    fastest measured BLOCK_K (the tuner's candidates). If its rows never change with M, BLOCK_K only regroups
    the k16 MMA steps (k_per stays a multiple of it) and need not be pinned."""
    sched, path, best = reduction_schedule(mode, N, K), tuned_table_path(device), None
    table = json.loads(path.read_text()) if path.exists() else {}
    for cand in table.get("candidates", {}).get(config_key(mode, M, N, K), []):
        cfg = GemmConfig(*cand["config"])
        if "us" in cand and cfg.split_k == sched.split_k and cfg.swap_ab and (best is None or cand["us"] < best[0]):
            best = (cand["us"], cfg)
    return best[1] if best else invariant_gemm_config(mode, M, N, K, device)


def _layer(name, g):
    K, widths = kb.PROJ[name]
    w = torch.randn(sum(widths), K, device=DEV, dtype=torch.bfloat16, generator=g) * 0.02
    q, sw = quantize_weight_triton(w)
    A = tuple(torch.randn(SLOTS, 1, RANK, K, device=DEV, generator=g).to(torch.bfloat16) * 0.05 for _ in widths)
    B = tuple(torch.randn(SLOTS, 1, n, RANK, device=DEV, generator=g).to(torch.bfloat16) * 0.02 for n in widths)
    x = torch.randn(T_MAX, K, device=DEV, dtype=torch.bfloat16, generator=g)
    return dict(q=q, sw=sw, A=A, B=B, x=x, widths=widths)


def _mixed_slots(m):
    pos = torch.arange(m, device=DEV)
    slots = torch.zeros(m, dtype=torch.int32, device=DEV)
    slots[pos % 3 == 1] = 1
    slots[pos % 5 == 2] = -1
    return slots


def _trainer(p, m):
    """The FP8 trainer's forward of slot 0's adapter, per output slice (the trainer's q/k/v, gate/up modules)."""
    outs, lo = [], 0
    with torch.no_grad():
        for a, b, n in zip(p["A"], p["B"], p["widths"]):
            outs.append(lora_linear(p["x"][:m], p["q"][lo:lo + n], p["sw"][lo:lo + n], a[0, 0], b[0, 0], 1.0))
            lo += n
    return torch.cat(outs, dim=1)


def _with_knob(arm, fn):
    """fn run with the arm's knob (and, for free_bk, its config chooser in place of the invariant one)."""
    def run():
        saved = set_knobs(batch_invariant=ARMS[arm])
        if arm == "free_bk":
            gemm_triton.invariant_gemm_config = _free_bk_config
        try:
            return fn()
        finally:
            restore_knobs(saved)
            gemm_triton.invariant_gemm_config = invariant_gemm_config
    return run


def _bits(p, arm) -> dict:
    """{M: (rows differing from the 4096-row batch, trainer-slot rows differing from the trainer's forward)}."""
    with torch.no_grad():
        y = {m: _with_knob(arm, lambda m=m: fp8_lora_linear(p["x"][:m], p["q"], p["sw"], p["A"], p["B"],
                                                                build_lora_meta(_mixed_slots(m), SLOTS)))()
             for m in MS}
        y_tr = _with_knob(arm, lambda: _trainer(p, T_MAX))()
    full, out = y[T_MAX], {}
    for m in MS:
        mine = _mixed_slots(m) == 0
        out[m] = (int((y[m] != full[:m]).any(dim=1).sum()),
                  int((y[m][mine] != y_tr[:m][mine]).any(dim=1).sum()))
    return out


def _times(p, m, timer) -> dict:
    """{arm: µs} of the engine's projection (and the trainer's forward at >= 1024 tokens), arms paired."""
    meta = build_lora_meta(torch.zeros(m, dtype=torch.int32, device=DEV), SLOTS)
    x = p["x"][:m]
    engine = [_with_knob(a, lambda: fp8_lora_linear(x, p["q"], p["sw"], p["A"], p["B"], meta)) for a in ARMS]
    res = dict(zip((f"engine_{a}_us" for a in ARMS), timer.paired_us(engine)))
    if m >= 1024:
        trainer = [_with_knob(a, lambda: _trainer(p, m)) for a in ARMS]
        res.update(zip((f"trainer_{a}_us" for a in ARMS), timer.paired_us(trainer)))
    return {k: round(v, 2) for k, v in res.items()}


def _configs(p, m) -> dict:
    K, N = p["x"].shape[1], p["q"].shape[0]
    cfgs = {"tuned": gemm_config("w8a16", m, N, K, DEV), "invariant": invariant_gemm_config("w8a16", m, N, K, DEV),
            "free_bk": _free_bk_config("w8a16", m, N, K, DEV)}
    return {arm: [c.split_k, c.block_k, c.swap_ab] for arm, c in cfgs.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--proj", nargs="*", default=list(kb.PROJ))
    args = ap.parse_args()
    t0, g, timer = time.time(), torch.Generator(device=DEV).manual_seed(0), kb.Timer(args.reps)
    dispatch.reset_report()
    rows = []
    for name in args.proj:
        p = _layer(name, g)
        bits = {arm: _bits(p, arm) for arm in ARMS}
        for m in MS:
            row = dict(proj=name, M=m, schedule_split_bk_swap=_configs(p, m), **_times(p, m, timer),
                       **{f"{arm}_rows_differing_across_M": bits[arm][m][0] for arm in ARMS},
                       **{f"{arm}_engine_vs_trainer_rows_differing": bits[arm][m][1] for arm in ARMS})
            for arm in ("invariant", "free_bk"):
                row[f"{arm}_over_tuned"] = round(row[f"engine_{arm}_us"] / row[f"engine_tuned_us"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    ok = all(r["invariant_rows_differing_across_M"] == 0 and r["invariant_engine_vs_trainer_rows_differing"] == 0
             for r in rows)
    args.out.write_text(json.dumps({
        "command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": __import__("triton").__version__, "seconds": round(time.time() - t0, 1),
        "invariant_bit_identical": ok, "rows": rows, "dispatch": dispatch.report()}, indent=1) + "\n")
    print("invariant arm bit-identical across M and with the trainer:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
