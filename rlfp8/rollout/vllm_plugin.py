"""rlfp8's general vLLM plugin (entry point `vllm.general_plugins`: rlfp8 = rlfp8.rollout.vllm_plugin:register).

vLLM calls `register()` in every process it starts (driver, engine core, workers) before the model loads. It
registers the quantization names "rlfp8" (matched W8A16) and "rlfp8_w8a8" and puts rlfp8's LoRA layer classes
first in vLLM's list. Everything it adds is inert unless a model is loaded with one of those quantization
names: the LoRA classes replace a layer only when its quant method is rlfp8's, and the memory-pool patch
applies only to such engines. Serving a trained adapter with rlfp8's kernels through vLLM itself:

    LLM(model="<bf16 checkpoint>", quantization="rlfp8", enable_lora=True, max_lora_rank=64)
    vllm serve <bf16 checkpoint> --quantization rlfp8 --enable-lora --lora-modules name=<PEFT folder>
"""
from __future__ import annotations

import logging

log = logging.getLogger("rlfp8.rollout")
_registered = False


def register() -> None:
    """Idempotent: safe to call from the entry point and again from rlfp8's own engine."""
    global _registered
    if _registered:
        return
    from vllm.lora import utils as lora_utils
    from vllm.model_executor.layers.quantization import register_quantization_config

    from . import lora_layers
    from .quant_method import make_classes, register_ops

    _, configs = make_classes()
    for name, cls in configs.items():
        register_quantization_config(name)(cls)
    register_ops()
    lora_layers.register_op()
    ours = tuple(lora_layers.make_layer_classes())
    lora_utils._all_lora_classes = ours + tuple(c for c in lora_utils._all_lora_classes if c not in ours)
    _keep_weights_out_of_the_sleep_pool()
    _registered = True


def _keep_weights_out_of_the_sleep_pool() -> None:
    """With sleep mode on (KV release), vLLM allocates weights in its cuMem pool, whose memory CUDA IPC
    cannot share; for rlfp8 engines weights and LoRA buffers come from the ordinary allocator instead, so
    the trainer can map them (one_copy) and the KV cache alone is released. Other engines are untouched."""
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except ImportError:                  # CPU build: no cuMem pool
        return
    original = getattr(Worker, "_maybe_get_memory_pool_context", None)
    if original is None or getattr(original, "_rlfp8", False):
        return

    def _pool_context(self, tag: str):
        from contextlib import nullcontext
        from . import compat
        if tag == "weights" and compat.is_rlfp8_quantization(self.vllm_config.model_config.quantization):
            return nullcontext()
        return original(self, tag)

    _pool_context._rlfp8 = True
    Worker._maybe_get_memory_pool_context = _pool_context
