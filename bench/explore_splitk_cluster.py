"""Split-K through distributed shared memory (experiment, reverted next): K2's W8A16 split-K programs of a
tile launched as one thread-block cluster, the partials added through DSMEM instead of the L2 workspace and
tile counter. Arms (paired CUDA-graph timing on the H200, bits against the L2 protocol):
  l2                 the package protocol (store, fence, acq_rel counter, last program reloads)
  l2_cluster_launch  the same kernel launched as clusters of SPLIT_K CTAs (what the cluster launch alone costs)
  pull               each CTA stores its partial in its shared memory, split 0 loads the others' (DSMEM)
  pull_relaxed       same with a CTA-scope fence + relaxed cluster arrive (the release arrive is a GPU MEMBAR)
  push               splits 1.. store into split 0's shared memory (DSMEM stores), split 0 adds locally
  *_split3/2         the same with 3 / 2 splits (fewer CTAs per cluster)
    python bench/explore_splitk_cluster.py          # H200, writes $OUT/cl_probe2.json
"""
import dataclasses, json, os, sys
sys.path.insert(0, os.getcwd())
import torch
from bench.kernels import Timer
from bench.k2_ab import load_copy
from rlfp8.kernels import _triton_utils as tu
from rlfp8.kernels import lora_gemm as lg
from rlfp8.kernels.fp8_triton import quantize_weight_triton, quantize_activation_triton

cl_only = load_copy("rlfp8/kernels/lora_gemm.py", "k2_clonly")     # L2 protocol, cluster launch
_orig = cl_only.launch
def _launch(kernel, grid, *a, cluster=None, **kw):
    S = kw.get("SPLIT_K", 1)
    if S > 1 and not kw["SPLIT_CLUSTER"]:
        return _orig(kernel, (grid[0] // S,), *a, cluster=(S, 0), **kw)
    return _orig(kernel, grid, *a, cluster=cluster, **kw)
cl_only.launch = _launch
cl_only.SPLIT_CLUSTER = 0

def arm(proto, relaxed, cfg, x, q, sw, xs=None):
    def f():
        lg.SPLIT_CLUSTER, lg.CLUSTER_RELAXED = proto, relaxed
        return lg.lora_gemm_triton(x, q, sw, x_scale=xs, config=cfg)
    return f

def arms_for(x, q, sw, cfg):
    a = {"l2": arm(0, False, cfg, x, q, sw),
         "l2_cluster_launch": lambda: cl_only.lora_gemm_triton(x, q, sw, config=cl_only.GemmConfig(**dataclasses.asdict(cfg))),
         "pull": arm(1, False, cfg, x, q, sw), "pull_relaxed": arm(1, True, cfg, x, q, sw),
         "push": arm(2, False, cfg, x, q, sw)}
    c3 = dataclasses.replace(cfg, split_k=3)
    a["l2_split3"] = arm(0, False, c3, x, q, sw)
    a["pull_relaxed_split3"] = arm(1, True, c3, x, q, sw)
    a["push_split3"] = arm(2, False, c3, x, q, sw)
    c2 = dataclasses.replace(cfg, split_k=2)
    a["l2_split2"] = arm(0, False, c2, x, q, sw)
    a["push_split2"] = arm(2, False, c2, x, q, sw)
    return a

def main():
    cases = []
    for proj, M, N, K in [("qkv", 64, 6144, 4096), ("o", 64, 4096, 4096), ("down", 64, 4096, 12288), ("qkv", 1, 6144, 4096)]:
        q, sw = quantize_weight_triton(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * .02)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        xq, xs = quantize_activation_triton(x)
        cfg = lg.gemm_config("w8a16", M, N, K, "cuda")
        w8 = lg.gemm_config("w8a8", M, N, K, "cuda")
        a = arms_for(x, q, sw, cfg)
        a["w8a8"] = arm(0, False, w8, xq, q, sw, xs)
        cases.append((proj, M, cfg, a))
    with tu.collect_launches() as rec:
        for *_, a in cases:
            for f in a.values():
                f()
    info = tu.precompile(rec, jobs=16)
    print("precompile", info, flush=True)
    timer = Timer(100)
    rows = []
    for proj, M, cfg, a in cases:
        ys = {}
        for k, f in a.items():
            try:
                ys[k] = f(); torch.cuda.synchronize()
            except Exception as e:
                print(proj, M, k, "FAILED", type(e).__name__, str(e)[:300], flush=True)
        ok = {k: f for k, f in a.items() if k in ys}
        ref = lambda k: "l2_split3" if "split3" in k else "l2_split2" if "split2" in k else "l2"
        same = {k: torch.equal(ys[ref(k)], y) for k, y in ys.items() if k != "w8a8" and ref(k) in ys}
        rep = {k: all(torch.equal(ok[k](), ys[k]) for _ in range(10)) for k in ok if k != "w8a8"}
        ts = timer.paired_us(list(ok.values()))
        us = {k: round(t, 2) for k, t in zip(ok, ts)}
        row = dict(proj=proj, M=M, cfg=dataclasses.asdict(cfg), us=us, ratio_to_w8a8={k: round(v / us["w8a8"], 3) for k, v in us.items()},
                   same_bits_as_l2=same, repeat_same=rep)
        print(json.dumps(row), flush=True)
        rows.append(row)
    json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), open(os.environ.get("OUT", "/tmp") + "/cl_probe2.json", "w"), indent=1)


if __name__ == "__main__":
    main()
