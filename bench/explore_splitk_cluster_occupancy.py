"""Why the cluster-launched split-K K2 is slower (experiment, reverted next): cuOccupancyMaxActiveClusters of
the cluster kernels (92 clusters of 4 at 3 CTAs per SM: fewer than qkv's 96 tiles at 64 tokens), the cluster
launch alone, and a 2-stage ring.    python bench/explore_splitk_cluster_occupancy.py   # H200"""
import ctypes, dataclasses, json, os, sys
sys.path.insert(0, os.getcwd())
import torch
from bench.kernels import Timer
from bench.k2_ab import load_copy
from rlfp8.kernels import _triton_utils as tu
from rlfp8.kernels import lora_gemm as lg
from rlfp8.kernels.fp8_triton import quantize_weight_triton

cl_only = load_copy("rlfp8/kernels/lora_gemm.py", "k2_clonly")     # L2 protocol, cluster launch
_orig = cl_only.launch
def _launch(kernel, grid, *a, cluster=None, **kw):
    S = kw.get("SPLIT_K", 1)
    if S > 1 and not kw["SPLIT_CLUSTER"]:
        return _orig(kernel, (grid[0] // S,), *a, cluster=(S, 0), **kw)
    return _orig(kernel, grid, *a, cluster=cluster, **kw)
cl_only.launch = _launch
cl_only.SPLIT_CLUSTER = False

libcuda = ctypes.CDLL("libcuda.so.1")
class Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("x", ctypes.c_uint), ("y", ctypes.c_uint),
                ("z", ctypes.c_uint), ("rest", ctypes.c_char * 52)]
class Cfg(ctypes.Structure):
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint), ("bx", ctypes.c_uint),
                ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(Attr)), ("n", ctypes.c_uint)]

def max_clusters(ck, S, grid):
    a = Attr(id=4, x=S, y=1, z=1)
    c = Cfg(grid * S, 1, 1, 32 * ck.metadata.num_warps, 1, 1, ck.metadata.shared, None, ctypes.pointer(a), 1)
    n = ctypes.c_int(-1)
    rc = libcuda.cuOccupancyMaxActiveClusters(ctypes.byref(n), ctypes.c_void_p(ck.function), ctypes.byref(c))
    nb = ctypes.c_int(-1)
    rc2 = libcuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(nb), ctypes.c_void_p(ck.function),
                                                              32 * ck.metadata.num_warps, ctypes.c_size_t(ck.metadata.shared))
    return dict(rc=rc, max_clusters=n.value, blocks_per_sm=nb.value, rc2=rc2, smem=ck.metadata.shared,
                regs=ck.n_regs)

timer = Timer(100)
out = []
for proj, M, N, K in [("qkv", 64, 6144, 4096), ("o", 64, 4096, 4096), ("down", 64, 4096, 12288), ("qkv", 1, 6144, 4096)]:
    q, sw = quantize_weight_triton(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * .02)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    cfg = lg.gemm_config("w8a16", M, N, K, "cuda")
    arms = {"l2": lambda c=cfg: (setattr(lg, "SPLIT_CLUSTER", False), lg.lora_gemm_triton(x, q, sw, config=c))[1],
            "l2_cluster_launch": lambda c=cfg: cl_only.lora_gemm_triton(x, q, sw, config=cl_only.GemmConfig(**dataclasses.asdict(c))),
            "dsmem": lambda c=cfg: (setattr(lg, "SPLIT_CLUSTER", True), lg.lora_gemm_triton(x, q, sw, config=c))[1]}
    for ns in (2,):
        c2 = dataclasses.replace(cfg, num_stages=ns)
        arms[f"dsmem_stages{ns}"] = lambda c=c2: (setattr(lg, "SPLIT_CLUSTER", True), lg.lora_gemm_triton(x, q, sw, config=c))[1]
        arms[f"l2_stages{ns}"] = lambda c=c2: (setattr(lg, "SPLIT_CLUSTER", False), lg.lora_gemm_triton(x, q, sw, config=c))[1]
    ys = {k: f() for k, f in arms.items()}
    same = {k: torch.equal(ys["l2"], y) for k, y in ys.items()}
    ts = timer.paired_us(list(arms.values()))
    row = dict(proj=proj, M=M, cfg=dataclasses.asdict(cfg), us={k: round(t, 2) for k, t in zip(arms, ts)}, same=same)
    # occupancy of the compiled kernels
    occ = {}
    for name, mod in (("dsmem", lg), ("l2", lg)):
        pass
    for key, ck in list(lg._lora_gemm_kernel.device_caches[0][0].items()):
        pass
    print(json.dumps(row), flush=True)
    out.append(row)
occ = []
for ck in lg._lora_gemm_kernel.device_caches[0][0].values():
    ck = ck.result() if hasattr(ck, "result") else ck
    S = ck.packed_metadata[1]
    if S > 1:
        occ.append(dict(name=ck.name, nctas=S, **max_clusters(ck, S, 96)))
for ck in cl_only._lora_gemm_kernel.device_caches[0][0].values():
    ck = ck.result() if hasattr(ck, "result") else ck
    S = ck.packed_metadata[1]
    if S > 1:
        occ.append(dict(name="clonly", nctas=S, **max_clusters(ck, S, 96)))
for o in occ: print(o)
json.dump(dict(rows=out, occupancy=occ), open(os.environ.get("OUT", "/tmp") + "/cl_probe.json", "w"), indent=1)
