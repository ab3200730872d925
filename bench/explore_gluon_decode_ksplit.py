"""Experiment (reverted next): lora_gemm_rs's decode kernel -- K2's four split-K programs of a tile as the four
K warpgroups of ONE program (a TMA warp feeds them in turn, warpgroup 0 adds the partials from shared
memory: no L2 workspace, no counter) -- against K2 (Triton split-K) and our W8A8, base GEMM at 33-64 tokens:
bits and paired CUDA-graph timing.    python bench/explore_gluon_decode_ksplit.py    # H200, writes $OUT/dec_probe.json"""
import dataclasses, json, os, sys
sys.path.insert(0, os.getcwd())
import torch
from bench.kernels import Timer
from rlfp8.kernels import _triton_utils as tu
from rlfp8.kernels import lora_gemm as lg
from rlfp8.kernels import lora_gemm_rs as rs
from rlfp8.kernels.fp8_triton import quantize_weight_triton, quantize_activation_triton

PROJ = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 12288), "gate_up": (24576, 4096)}


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for proj, (N, K) in PROJ.items():
        q, sw = quantize_weight_triton(torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * .02)
        bias = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=g)
        for M in (64, 50, 33):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g) 
            xq, xs = quantize_activation_triton(x)
            fns = {"decode": lambda x=x, q=q, sw=sw: rs.lora_gemm_rs_decode(x, q, sw),
                   "k2": lambda x=x, q=q, sw=sw: lg.lora_gemm_triton(x, q, sw),
                   "w8a8": lambda xq=xq, q=q, sw=sw, xs=xs: lg.lora_gemm_triton(xq, q, sw, x_scale=xs),
                   "decode_bias": lambda x=x, q=q, sw=sw, b=bias: rs.lora_gemm_rs_decode(x, q, sw, bias=b),
                   "k2_bias": lambda x=x, q=q, sw=sw, b=bias: lg.lora_gemm_triton(x, q, sw, bias=b)}
            cases.append((proj, M, N, K, fns))
    with tu.collect_launches() as rec:
        for *_, fns in cases:
            for f in fns.values():
                f()
    print("precompile", tu.precompile(rec, jobs=16), flush=True)
    timer = Timer(100)
    rows = []
    for proj, M, N, K, fns in cases:
        cfg = lg.gemm_config("w8a16", M, N, K, "cuda")
        y = {k: f() for k, f in fns.items()}
        torch.cuda.synchronize()
        same = torch.equal(y["decode"], y["k2"]) and torch.equal(y["decode_bias"], y["k2_bias"])
        rep = all(torch.equal(fns["decode"](), y["decode"]) for _ in range(20))
        err = (y["decode"].float() - y["k2"].float()).abs().max().item()
        timed = {k: fns[k] for k in ("decode", "k2", "w8a8")}
        ts = dict(zip(timed, timer.paired_us(list(timed.values()))))
        r = dict(proj=proj, M=M, k2_split=cfg.split_k, supported=rs.decode_supported(y["k2"].new_empty(M, K), y["k2"].new_empty(N, K, dtype=torch.float8_e4m3fn), cfg.split_k),
                 same_bits_as_k2=same, max_abs_diff=err, repeat_same=rep, **{f"{k}_us": round(v, 2) for k, v in ts.items()},
                 decode_vs_w8a8=round(ts["decode"] / ts["w8a8"], 3), k2_vs_w8a8=round(ts["k2"] / ts["w8a8"], 3))
        print(json.dumps(r), flush=True)
        rows.append(r)
    json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), open(os.environ.get("OUT", "/tmp") + "/dec_probe.json", "w"), indent=1)


if __name__ == "__main__":
    main()
