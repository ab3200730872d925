#!/usr/bin/env python
"""bench/lab/invariant_configs.py (H200, < 3 min): the batch-invariant K1/K2 schedules (knob batch_invariant,
rlfp8/kernels/gemm_configs.py) against the tuned per-token-count configs, for the Qwen3-8B projections (qkv
4096->6144, o 4096->4096, gate_up 4096->24576, down 12288->4096; rank 64) at M = 1, 8, 64, 256, 1024, 4096.

Per projection and M, both arms (knob off = tuned, on = invariant):
  * time: the engine's projection (fp8_lora_linear: K1 + K2, vLLM-style metadata, 4 stacked slots, every
    token on slot 0), CUDA graphs replayed in turn with L2 flushed (bench/kernels.py Timer), median of --reps;
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

import kernels as kb  # noqa: E402  (bench/kernels.py: Timer, PROJ)
from rlfp8.kernels import build_lora_meta, dispatch, fp8_lora_linear  # noqa: E402
from rlfp8.kernels.fp8_triton import quantize_weight_triton  # noqa: E402
from rlfp8.kernels.gemm_configs import gemm_config, invariant_gemm_config  # noqa: E402
from rlfp8.kernels.knobs import restore_knobs, set_knobs  # noqa: E402
from rlfp8.kernels.linear import lora_linear  # noqa: E402

DEV = "cuda"
MS = (1, 8, 64, 256, 1024, 4096)
RANK, SLOTS, T_MAX = 64, 4, 4096
ARMS = {"tuned": "off", "invariant": "on"}


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


def _with_knob(setting, fn):
    def run():
        saved = set_knobs(batch_invariant=setting)
        try:
            return fn()
        finally:
            restore_knobs(saved)
    return run


def _bits(p, setting) -> dict:
    """{M: (rows differing from the 4096-row batch, trainer-slot rows differing from the trainer's forward)}."""
    with torch.no_grad():
        y = {m: _with_knob(setting, lambda m=m: fp8_lora_linear(p["x"][:m], p["q"], p["sw"], p["A"], p["B"],
                                                                build_lora_meta(_mixed_slots(m), SLOTS)))()
             for m in MS}
        y_tr = _with_knob(setting, lambda: _trainer(p, T_MAX))()
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
    engine = [_with_knob(s, lambda: fp8_lora_linear(x, p["q"], p["sw"], p["A"], p["B"], meta)) for s in ARMS.values()]
    res = dict(zip((f"engine_{a}_us" for a in ARMS), timer.paired_us(engine)))
    if m >= 1024:
        trainer = [_with_knob(s, lambda: _trainer(p, m)) for s in ARMS.values()]
        res.update(zip((f"trainer_{a}_us" for a in ARMS), timer.paired_us(trainer)))
    return {k: round(v, 2) for k, v in res.items()}


def _configs(p, m) -> dict:
    K, N = p["x"].shape[1], p["q"].shape[0]
    c_t, c_i = gemm_config("w8a16", m, N, K, DEV), invariant_gemm_config("w8a16", m, N, K, DEV)
    return {"tuned": [c_t.split_k, c_t.block_k, c_t.swap_ab], "invariant": [c_i.split_k, c_i.block_k, c_i.swap_ab]}


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
        bits = {arm: _bits(p, s) for arm, s in ARMS.items()}
        for m in MS:
            row = dict(proj=name, M=m, schedule_split_bk_swap=_configs(p, m), **_times(p, m, timer),
                       **{f"{arm}_rows_differing_across_M": bits[arm][m][0] for arm in ARMS},
                       **{f"{arm}_engine_vs_trainer_rows_differing": bits[arm][m][1] for arm in ARMS})
            row["invariant_over_tuned"] = round(row["engine_invariant_us"] / row["engine_tuned_us"], 3)
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
