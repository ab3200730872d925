#!/usr/bin/env python
"""A/B of a kernel knob on the engine's projection (rlfp8.kernels.fp8_lora_linear: K1 + K2, or K2 alone without an
adapter), the way the engine calls it: Qwen3-8B projections, decode token counts, no adapter and one rank-64
adapter through metadata (PDL where the GPU has it), each arm a CUDA graph captured with its knob setting, the
two graphs replayed in turn with L2 flushed before each replay (bench/kernel_bench.Timer). Per row: both arms'
median us, the ratio b / a, whether the outputs are bit-identical, and the dispatch paths each arm took; per
(mode, M, adapters) the layer's sum over the four projections.

    python bench/lab/projection_knob_ab.py --a k2_quant_x_tokens=0 --b k2_quant_x_tokens=16 \
        --out bench/results/quant_x_ab_h200.json                                              # H200, ~1 min
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import kernel_bench as kb  # noqa: E402  (Timer)

from rlfp8.kernels import dispatch  # noqa: E402
from rlfp8.kernels.knobs import restore_knobs, set_knobs  # noqa: E402

PROJ = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (12288, 12288)),
        "down": (12288, (4096,))}                                     # K, output slices
RANK = 64
PATH_KEYS = ("lora_gemm.x_quant", "lora_gemm.launch", "lora_gemm.pdl_wait", "lora_gemm.config",
             "lora_gemm.prefetch_epilogue")
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def parse_setting(text: str) -> dict:
    """"name=value,name=value" -> knob settings (ints, true/false, null, else strings)."""
    out = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        low = value.lower()
        out[name.strip()] = (True if low == "true" else False if low == "false" else None if low in ("null", "none")
                             else int(value) if value.lstrip("-").isdigit() else value)
    return out


def with_knobs(setting: dict, fn):
    """fn run with the knobs set (a CUDA graph captures the launches the knobs chose)."""
    def run():
        saved = set_knobs(**setting)
        try:
            return fn()
        finally:
            restore_knobs(saved)
    return run


class Inputs:
    def __init__(self, ms):
        from rlfp8.kernels.fp8_triton import quantize_weight_triton
        from rlfp8.kernels.metadata import build_lora_meta
        g = torch.Generator(device="cuda").manual_seed(0)
        self.w, self.ad, self.x, self.meta = {}, {}, {}, {}
        for name, (K, widths) in PROJ.items():
            w = torch.randn(sum(widths), K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
            self.w[name] = quantize_weight_triton(w)
            del w
            self.ad[name] = (tuple(torch.randn(1, RANK, K, device="cuda", generator=g).mul_(0.02).to(torch.bfloat16)
                                   for _ in widths),
                             tuple(torch.randn(1, n, RANK, device="cuda", generator=g).mul_(0.02).to(torch.bfloat16)
                                   for n in widths))
        for M in ms:
            for K in {k for k, _ in PROJ.values()}:
                self.x[(M, K)] = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
            self.meta[M] = build_lora_meta(torch.zeros(M, dtype=torch.long, device="cuda"), 1)

    def fn(self, mode, name, M, adapters):
        from rlfp8.kernels.projection import fp8_lora_linear
        K, _ = PROJ[name]
        q, sw = self.w[name]
        x = self.x[(M, K)]
        if not adapters:
            return lambda: fp8_lora_linear(x, q, sw, mode=mode)
        A, B = self.ad[name]
        meta = self.meta[M]
        return lambda: fp8_lora_linear(x, q, sw, A, B, meta, mode=mode)


def paths_of(fn) -> dict:
    dispatch.reset_report()
    fn()
    rep = dispatch.report()
    return {k: sorted(rep[k]) for k in PATH_KEYS if k in rep}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="arm a's knobs, e.g. k2_quant_x_tokens=0")
    ap.add_argument("--b", required=True, help="arm b's knobs")
    ap.add_argument("--modes", default="w8a8")
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import triton
    arms = {"a": parse_setting(a.a), "b": parse_setting(a.b)}
    saved = set_knobs(**arms["a"])      # validates both settings before any GPU work
    set_knobs(**arms["b"])
    restore_knobs(saved)
    ms = [int(t) for t in a.tokens.split(",")]
    inp = Inputs(ms)
    timer = kb.Timer(a.reps)
    rows = []
    for mode in a.modes.split(","):
        for adapters in (0, 1):
            for M in ms:
                for name in PROJ:
                    fns = {arm: with_knobs(s, inp.fn(mode, name, M, adapters)) for arm, s in arms.items()}
                    outs = {arm: f().clone() for arm, f in fns.items()}
                    paths = {arm: paths_of(f) for arm, f in fns.items()}
                    ua, ub = timer.paired_us([fns["a"], fns["b"]])
                    row = {"mode": mode, "proj": name, "M": M, "adapters": adapters, "a_us": round(ua, 2),
                           "b_us": round(ub, 2), "ratio": round(ub / ua, 3),
                           "same_bits": bool(torch.equal(outs["a"], outs["b"])), "paths": paths}
                    log(f"{mode} {name:7s} M={M:2d} adapters={adapters}: {ua:6.2f} -> {ub:6.2f} us "
                        f"({row['ratio']:.3f}x) same bits {row['same_bits']} {paths['b']}")
                    rows.append(row)
    layers = []
    for mode in a.modes.split(","):
        for adapters in (0, 1):
            for M in ms:
                sel = [r for r in rows if (r["mode"], r["adapters"], r["M"]) == (mode, adapters, M)]
                sa, sb = sum(r["a_us"] for r in sel), sum(r["b_us"] for r in sel)
                layers.append({"mode": mode, "adapters": adapters, "M": M, "a_us": round(sa, 2), "b_us": round(sb, 2),
                               "ratio": round(sb / sa, 3), "same_bits": all(r["same_bits"] for r in sel)})
                log(f"layer {layers[-1]}")
    result = {"command": " ".join([Path(sys.executable).name] + sys.argv), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__,
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "reps": a.reps, "arms": arms,
              "layer_sums": layers, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
