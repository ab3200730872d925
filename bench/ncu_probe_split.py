"""ncu probe (explore_gluon_split experiment): one launch each of K2 W8A16 (tuned), our W8A8 (tuned), the Gluon split-K kernel at split 4 and 2, on a Qwen3-8B projection at 64 tokens, each after an L2 flush; run under ncu --profile-from-start off.
    python bench/ncu_probe_split.py N K"""
import sys, dataclasses, torch
sys.path.insert(0, '.')
from rlfp8.kernels import lora_gemm as lg
from rlfp8.kernels.fp8_triton import quantize_activation_triton, quantize_weight_triton
from rlfp8.kernels.lora_gemm_rs import lora_gemm_rs_split
g = torch.Generator(device='cuda').manual_seed(0)
N, K, M = int(sys.argv[1]), int(sys.argv[2]), 64
q, sw = quantize_weight_triton(torch.randn(N, K, device='cuda', dtype=torch.bfloat16, generator=g) * .02)
x = torch.randn(M, K, device='cuda', dtype=torch.bfloat16, generator=g)
xq, xs = quantize_activation_triton(x)
cfg = dataclasses.replace(lg.gemm_config('w8a16', M, N, K, 'cuda'), gluon=False)
c8 = lg.gemm_config('w8a8', M, N, K, 'cuda')
fns = [lambda: lg.lora_gemm_triton(x, q, sw, config=cfg), lambda: lg.lora_gemm_triton(xq, q, sw, x_scale=xs, config=c8),
       lambda: lora_gemm_rs_split(x, q, sw, cfg), lambda: lora_gemm_rs_split(x, q, sw, dataclasses.replace(cfg, split_k=2))]
for f in fns: f()
torch.cuda.synchronize()
flush = torch.empty(512 * 2**20, dtype=torch.uint8, device='cuda')
torch.cuda.cudart().cudaProfilerStart()
for f in fns:
    flush.zero_(); torch.cuda.synchronize(); f(); torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
