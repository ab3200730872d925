#!/usr/bin/env python
"""Determinism stress for the W8A16 GEMMs on a GPU: each call is repeated and compared bit for bit with its
first output; any difference is a race (the inputs do not change). K2 (the Triton kernel, its tuned config
for the token count, forced with `config=`) at 64 / 256 / 1024 tokens, base GEMM with and without bias and
with one adapter through metadata; lora_gemm_rs (the Gluon main loop) at 1024 tokens; median µs of each call.

    python bench/lab/stress_determinism.py --out bench/results/stress_determinism_h200.json
    RLFP8_K2_SYNC_A=0 python bench/lab/stress_determinism.py ...   # without the SYNC_A wait: reproduces the race

Finding (H200, see the JSON): without SYNC_A, K2's 8192-token config with a bias returned garbage tiles in
8-30 of 30 calls; with it, 0 mismatches everywhere, at +0% (64 tokens), ~+10% (256), ~+30% (1024) time.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.kernels import Timer  # noqa: E402
from rlfp8.kernels.fp8 import quantize_weight  # noqa: E402
from rlfp8.kernels.gemm_configs import gemm_config  # noqa: E402
from rlfp8.kernels.gemm_triton import lora_gemm_triton  # noqa: E402
from rlfp8.kernels.knobs import knobs  # noqa: E402
from rlfp8.kernels.metadata import build_lora_meta  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="/tmp/stress_determinism.json")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    timer = Timer(50)
    rows = []
    for N, K in ((6144, 4096), (4096, 4096)):
        q, sw = quantize_weight(torch.randn(N, K, device="cuda") * 0.02)
        bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        for M in (64, 256, 1024):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            meta = build_lora_meta(torch.zeros(M, dtype=torch.long, device="cuda"), 1)
            h = torch.randn(1, M, 64, device="cuda")
            B = (torch.randn(1, N, 64, device="cuda") * 0.02).to(torch.bfloat16)
            cfg = gemm_config("w8a16", M, N, K, "cuda")
            cases = [("k2 base+bias", lambda: lora_gemm_triton(x, q, sw, bias=bias, config=cfg)),
                     ("k2 lora(meta)+bias", lambda: lora_gemm_triton(x, q, sw, h=h, B=B, meta=meta, bias=bias,
                                                                     config=cfg)),
                     ("k2 base", lambda: lora_gemm_triton(x, q, sw, config=cfg))]
            if M > 512:
                cases += [("gluon_rs base+bias", lambda: lora_gemm_triton(x, q, sw, bias=bias)),
                          ("gluon_rs lora+bias", lambda: lora_gemm_triton(x, q, sw, h=h, B=B, bias=bias))]
            for name, fn in cases:
                y0 = fn()
                torch.cuda.synchronize()
                bad = sum(0 if torch.equal(fn(), y0) else 1 for _ in range(a.reps))
                row = dict(case=name, N=N, K=K, M=M, reps=a.reps, mismatches=bad, us=round(timer.graph_us(fn), 2),
                           config=list(cfg.key()) if name.startswith("k2") else None)
                print(row, flush=True)
                rows.append(row)
    out = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, sync_a=knobs().k2_sync_a,
               command=" ".join([Path(sys.executable).name] + sys.argv), rows=rows)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    main()
