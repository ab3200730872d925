"""vLLM's LoRA kernel metadata as the kernels' LoRAMeta: the one place that knows how vLLM versions lay it out.

The kernels (rlfp8.kernels) know no engine; the engine side converts vLLM's LoRAKernelMeta here.
"""
from __future__ import annotations

import inspect

import torch

from rlfp8.kernels.metadata import LoRAMeta


def lora_meta_from_vllm(meta, num_tokens: int, specialize_active_lora: bool = True) -> LoRAMeta:
    """Views of a vLLM LoRAKernelMeta (0.26: meta_args(T) -> 6-tuple; later: meta_args(T, specialize)
    -> 7-tuple with num_active_loras). No copies; when vLLM does not count active adapters the grid
    covers max_loras + 1 segments and the idle ones exit."""
    params = inspect.signature(meta.meta_args).parameters
    args = meta.meta_args(num_tokens, specialize_active_lora) if len(params) >= 2 else meta.meta_args(num_tokens)
    mapping, sorted_ids, ntok, start, ids, no_lora = args[:6]
    if len(args) >= 7:
        n_active = args[6]
    else:
        n_active = torch.tensor([ids.shape[0]], dtype=torch.int32)
    return LoRAMeta(mapping, sorted_ids, ids, ntok, start, no_lora, n_active)
