"""vLLM's LoRA kernel metadata as the kernels' LoRAMeta: the one place that knows how vLLM versions lay it out.

The kernels (rlfp8.kernels) know no engine; the engine side converts vLLM's LoRAKernelMeta here.
"""
from __future__ import annotations

import inspect

import torch

from rlfp8.kernels.metadata import LoRAMeta

# type(LoRAKernelMeta) -> whether its meta_args takes specialize_active_lora (one inspect.signature per class: it
# cost ~15 us per projection call, and a class's signature does not change)
_TAKES_SPECIALIZE: dict[type, bool] = {}
# segments count -> the [1] int32 CPU tensor that stands for num_active_loras where vLLM has none (read only)
_ALL_SEGMENTS: dict[int, torch.Tensor] = {}


def _takes_specialize(meta) -> bool:
    cls = type(meta)
    takes = _TAKES_SPECIALIZE.get(cls)
    if takes is None:
        takes = _TAKES_SPECIALIZE[cls] = len(inspect.signature(meta.meta_args).parameters) >= 2
    return takes


def lora_meta_from_vllm(meta, num_tokens: int, specialize_active_lora: bool = True) -> LoRAMeta:
    """Views of a vLLM LoRAKernelMeta (0.26: meta_args(T) -> 6-tuple; later: meta_args(T, specialize)
    -> 7-tuple with num_active_loras). No copies; when vLLM does not count active adapters the grid
    covers max_loras + 1 segments and the idle ones exit."""
    if _takes_specialize(meta):
        args = meta.meta_args(num_tokens, specialize_active_lora)
    else:
        args = meta.meta_args(num_tokens)
    mapping, sorted_ids, ntok, start, ids, no_lora = args[:6]
    if len(args) >= 7:
        n_active = args[6]
    else:
        n_segments = ids.shape[0]
        n_active = _ALL_SEGMENTS.get(n_segments)
        if n_active is None:
            n_active = _ALL_SEGMENTS[n_segments] = torch.tensor([n_segments], dtype=torch.int32)
    return LoRAMeta(mapping, sorted_ids, ids, ntok, start, no_lora, n_active)
