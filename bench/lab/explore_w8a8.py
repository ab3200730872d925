#!/usr/bin/env python
"""Exploration: what can Triton 3.6 reach on the one W8A8 shape where K2 misses its target (gate_up,
256 tokens: x_q [256, 4096] · qᵀ, q [24576, 4096] e4m3; K2 56.6 us vs vLLM's CUTLASS 45.6 us on the H200)?

Standalone kernels (no LoRA epilogue, row/column scales + bf16 store), both operands through TMA:
  * plain: one program per output tile, tokens on the MMA's M side, grouped tile order;
  * persistent: NUM_SMS programs loop over tiles (tl.range(flatten=True): the next tile's loads overlap
    this tile's epilogue), optionally with Triton's automatic warp specialization;
  * wide: a 192-column weight tile as two dots (128 + 64) sharing the token tile: 128 tiles fill the 132 SMs
    in one wave (24576 = 128 · 192) and each token tile is read 128 times instead of 192-384.
Each against torch._scaled_mm (cuBLASLt, row-wise scales) and K2's tuned config, in one run; median of
--reps CUDA-graph replays with L2 flushed. Writes JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from bench.kernels import Timer  # noqa: E402
from rlfp8.kernels.gemm_triton import lora_gemm_triton  # noqa: E402

NUM_SMS = 132


@triton.jit
def _tile_pid(tile, num_m, num_n, GROUP: tl.constexpr):
    per_group = GROUP * num_n
    first_m = (tile // per_group) * GROUP
    gsz = tl.minimum(num_m - first_m, GROUP)
    return first_m + (tile % per_group) % gsz, (tile % per_group) // gsz


@triton.jit
def _epilogue(acc, y_ptr, sx_ptr, sw_ptr, offs_m, offs_n, M, N):
    sx = tl.load(sx_ptr + offs_m, mask=offs_m < M, other=0.0)
    sw = tl.load(sw_ptr + offs_n, mask=offs_n < N, other=0.0)
    y = (acc * sx[:, None] * sw[None, :]).to(tl.bfloat16)
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], y,
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def mm_plain(x_desc, w_desc, y_ptr, sx_ptr, sw_ptr, M, N, K,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    pid_m, pid_n = _tile_pid(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = x_desc.load([pid_m * BM, k])
        b = w_desc.load([pid_n * BN, k])
        acc = tl.dot(a, b.T, acc)
    _epilogue(acc, y_ptr, sx_ptr, sw_ptr, pid_m * BM + tl.arange(0, BM), pid_n * BN + tl.arange(0, BN), M, N)


@triton.jit
def mm_persistent(x_desc, w_desc, y_ptr, sx_ptr, sw_ptr, M, N, K,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                  NUM_SMS: tl.constexpr, WS: tl.constexpr, FLATTEN: tl.constexpr):
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=FLATTEN, warp_specialize=WS):
        pid_m, pid_n = _tile_pid(tile, num_m, num_n, GROUP)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = x_desc.load([pid_m * BM, ki * BK])
            b = w_desc.load([pid_n * BN, ki * BK])
            acc = tl.dot(a, b.T, acc)
        _epilogue(acc, y_ptr, sx_ptr, sw_ptr, pid_m * BM + tl.arange(0, BM), pid_n * BN + tl.arange(0, BN), M, N)


@triton.jit
def mm_wide(x_desc, w1_desc, w2_desc, y_ptr, sx_ptr, sw_ptr, M, N, K,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    # weight tile of 3·BN/2 columns = one BN-wide and one BN/2-wide dot sharing the token tile
    BN2: tl.constexpr = BN // 2
    WT: tl.constexpr = BN + BN2
    pid_m, pid_n = _tile_pid(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, WT), GROUP)
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc2 = tl.zeros((BM, BN2), dtype=tl.float32)
    for k in range(0, K, BK):
        a = x_desc.load([pid_m * BM, k])
        b1 = w1_desc.load([pid_n * WT, k])
        b2 = w2_desc.load([pid_n * WT + BN, k])
        acc1 = tl.dot(a, b1.T, acc1)
        acc2 = tl.dot(a, b2.T, acc2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    _epilogue(acc1, y_ptr, sx_ptr, sw_ptr, offs_m, pid_n * WT + tl.arange(0, BN), M, N)
    _epilogue(acc2, y_ptr, sx_ptr, sw_ptr, offs_m, pid_n * WT + BN + tl.arange(0, BN2), M, N)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--M", type=int, default=256)
    ap.add_argument("--N", type=int, default=24576)
    ap.add_argument("--K", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default="/tmp/explore_w8a8.json")
    a = ap.parse_args(argv)
    M, N, K = a.M, a.N, a.K
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(M, K, device=dev, generator=g).to(torch.float8_e4m3fn)
    q = (torch.randn(N, K, device=dev, generator=g) * 0.5).to(torch.float8_e4m3fn)
    sx = torch.rand(M, device=dev, generator=g) * 0.01 + 0.001
    sw = torch.rand(N, device=dev, generator=g) * 0.01 + 0.001
    ref = ((x.float() @ q.float().t()) * sx[:, None] * sw[None, :])
    timer = Timer(a.reps)
    y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    results = []

    def record(name, fn, **cfg):
        t0 = time.time()
        try:
            out = fn()
            torch.cuda.synchronize()
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            us = timer.graph_us(fn)
        except Exception as e:
            results.append(dict(name=name, **cfg, error=f"{type(e).__name__}: {str(e)[:300]}"))
            print(f"{name} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            return
        results.append(dict(name=name, **cfg, us=round(us, 2), max_rel_err=err))
        print(f"{name:12s} {cfg}: {us:7.2f} us  err {err:.1e}  ({time.time() - t0:.1f} s)", flush=True)

    record("scaled_mm", lambda: torch._scaled_mm(x, q.t(), scale_a=sx[:, None], scale_b=sw[None, :],
                                                  out_dtype=torch.bfloat16))
    record("k2_tuned", lambda: lora_gemm_triton(x, q, sw, x_scale=sx[:, None]))

    def descs(BM, BN, BK, wide=False):
        xd = TensorDescriptor.from_tensor(x, [BM, BK])
        if wide:
            return xd, TensorDescriptor.from_tensor(q, [BN, BK]), TensorDescriptor.from_tensor(q, [BN // 2, BK])
        return xd, TensorDescriptor.from_tensor(q, [BN, BK])

    plain = [(128, 128, 128, 8, 4, 4), (128, 128, 128, 4, 4, 4), (128, 256, 128, 8, 3, 4), (256, 128, 128, 8, 3, 4),
             (64, 256, 128, 4, 4, 4), (128, 128, 256, 8, 3, 4), (256, 128, 64, 8, 4, 4), (128, 256, 64, 8, 4, 4),
             (128, 128, 128, 8, 5, 2), (256, 256, 64, 8, 3, 1), (128, 128, 128, 8, 6, 2), (128, 128, 128, 8, 5, 1),
             (128, 128, 128, 8, 5, 8), (128, 128, 128, 4, 3, 2), (128, 128, 128, 8, 3, 2), (64, 128, 128, 4, 4, 2)]
    for BM, BN, BK, nw, ns, gm in plain:
        xd, wd = descs(BM, BN, BK)
        grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
        record("plain", lambda: (mm_plain[grid](xd, wd, y, sx, sw, M, N, K, BM=BM, BN=BN, BK=BK, GROUP=gm,
                                                num_warps=nw, num_stages=ns), y)[1],
               BM=BM, BN=BN, BK=BK, warps=nw, stages=ns, group=gm)
    for BM, BN, BK, nw, ns, gm in [(128, 128, 128, 8, 4, 4), (128, 256, 128, 8, 3, 4), (128, 128, 128, 4, 4, 4),
                                   (64, 256, 128, 4, 4, 4), (256, 128, 128, 8, 3, 4)]:
        for ws, fl in ((False, True), (False, False), (True, True)):
            xd, wd = descs(BM, BN, BK)
            record("persistent", lambda: (mm_persistent[(NUM_SMS,)](
                xd, wd, y, sx, sw, M, N, K, BM=BM, BN=BN, BK=BK, GROUP=gm, NUM_SMS=NUM_SMS, WS=ws, FLATTEN=fl,
                num_warps=nw, num_stages=ns), y)[1], BM=BM, BN=BN, BK=BK, warps=nw, stages=ns, group=gm, ws=ws,
                flatten=fl)
    for BM, BN, BK, nw, ns, gm in [(128, 128, 128, 8, 3, 2), (128, 128, 128, 8, 4, 2), (256, 128, 64, 8, 3, 1),
                                   (256, 128, 128, 8, 2, 1), (128, 128, 64, 8, 4, 2), (128, 128, 128, 4, 3, 2),
                                   (64, 128, 128, 4, 4, 4)]:
        xd, w1, w2 = descs(BM, BN, BK, wide=True)
        grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN * 3 // 2),)
        record("wide192", lambda: (mm_wide[grid](xd, w1, w2, y, sx, sw, M, N, K, BM=BM, BN=BN, BK=BK, GROUP=gm,
                                                 num_warps=nw, num_stages=ns), y)[1],
               BM=BM, BN=BN * 3 // 2, BK=BK, warps=nw, stages=ns, group=gm)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                command=" ".join(["python"] + sys.argv), M=M, N=N, K=K, reps=a.reps)
    Path(a.out).write_text(json.dumps({**meta, "results": results}, indent=1))
    ok = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    print("fastest:", *[f"{r['name']} {r['us']}" for r in ok[:6]], sep="\n  ")


if __name__ == "__main__":
    main()
