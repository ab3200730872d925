"""Tensors one process shares with another (placement=one_copy), in a form both roles import without
importing each other: the handle format (CUDA IPC, or a /dev/shm file on a CPU machine), mapping a handle
back to a tensor that aliases the exporter's memory, the checksum both sides compute, and how vLLM packs the
HF projections into fused tensors (row concatenations, DESIGN's layout)."""
from __future__ import annotations

import torch

# vLLM module suffix -> the HF projections it packs, in row order (Qwen2/Qwen3/Llama)
PACKED_MODULES = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def map_shared_tensor(handle) -> torch.Tensor:
    """The receiving side: a tensor aliasing the exporter's memory (read-only by contract)."""
    kind = handle[0]
    if kind == "cuda_ipc":
        fn, args = handle[1]
        return fn(*args)
    if kind == "file":
        _, path, dtype, shape = handle
        dt = getattr(torch, dtype)
        numel = 1
        for s in shape:
            numel *= s
        flat = torch.from_file(path, shared=True, size=numel * torch.empty((), dtype=dt).element_size(),
                               dtype=torch.uint8)
        return flat.view(dt).view(shape)
    raise ValueError(f"map_handle: unknown handle kind {kind!r}")


def base_checksum(tensors, chunk: int = 1 << 24) -> int:
    """Position-weighted sum of the raw bytes of every tensor (int64, chunked so no large temporary): equal
    before and after training iff no byte moved or changed (for any realistic write)."""
    total, offset = 0, 0
    for t in tensors:
        b = t.detach().reshape(-1).view(torch.uint8)
        for start in range(0, b.numel(), chunk):
            part = b[start:start + chunk].to(torch.int64)
            w = (torch.arange(part.numel(), device=part.device, dtype=torch.int64) + offset + start) % 65521 + 1
            total = (total + int((part * w).sum())) % (1 << 61)
        offset += b.numel()
    return total


