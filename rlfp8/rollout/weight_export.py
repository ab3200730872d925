"""The engine's FP8 base weights handed to another process (placement=one_copy): the trainer maps them instead of
holding a copy.

`export_weights(model)` returns, for every projection computed by rlfp8's quant method, the handles of its codes
`weight` [N, K] e4m3 and scales `weight_scale` [N] fp32, and the row widths of the slices packed in it (qkv:
q, k, v; gate_up: gate, up), keyed by vLLM's module name:
  - on a GPU, CUDA IPC handles (torch.multiprocessing.reductions.reduce_tensor): the rlfp8 plugin keeps
    weights out of vLLM's cuMem pool, whose memory legacy IPC cannot share;
  - on a CPU machine, the tensors are moved once into files in /dev/shm (the engine's parameters then live in
    that shared memory too, same values) and the handle is the file: the same one-copy path, testable in CI.
`rlfp8.shared_tensors.map_shared_tensor(h)` (the receiving side) rebuilds a tensor that aliases the engine's memory. Nothing here copies per
step; `base_checksum` reads the codes to prove no one writes them.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from rlfp8.shared_tensors import base_checksum, map_shared_tensor  # noqa: F401  (the receiving side)

SHM = Path("/dev/shm")


def _rlfp8_linears(model) -> dict:
    out = {}
    for name, mod in model.named_modules():
        method = getattr(mod, "quant_method", None)
        if getattr(method, "mode", None) is not None and hasattr(mod, "weight_scale"):
            out[name.removesuffix(".base_layer")] = mod          # under LoRA the base layer is wrapped
    return out


def _to_shared_file(t: torch.Tensor, path: Path) -> torch.Tensor:
    """A tensor with t's values whose storage is the file `path` (MAP_SHARED)."""
    nbytes = t.numel() * t.element_size()
    flat = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    shared = flat.view(t.dtype).view(t.shape)
    shared.copy_(t)
    return shared


def export_weights(model, scratch: str | os.PathLike | None = None) -> dict:
    """vLLM module name -> {"weight": handle, "weight_scale": handle, "widths": [rows per packed slice]}."""
    mods = _rlfp8_linears(model)
    if not mods:
        raise RuntimeError("export_weights: the engine holds no rlfp8-quantized projections; one_copy needs "
                           "engine.precision=w8a16 or w8a8 (the trainer maps the engine's FP8 codes)")
    out = {}
    on_gpu = next(iter(mods.values())).weight.is_cuda
    folder = None
    if not on_gpu:
        folder = Path(scratch) if scratch else SHM / f"rlfp8-{os.getpid()}-weights"
        folder.mkdir(parents=True, exist_ok=True)
    for name, mod in mods.items():
        entry = {"widths": list(getattr(mod, "logical_widths", [mod.weight.shape[0]]))}
        for part in ("weight", "weight_scale"):
            t = getattr(mod, part)
            if on_gpu:
                from torch.multiprocessing.reductions import reduce_tensor
                entry[part] = ("cuda_ipc", reduce_tensor(t.data))
            else:
                path = folder / f"{name}.{part}"
                if not path.exists():
                    t.data = _to_shared_file(t.data, path)
                entry[part] = ("file", str(path), str(t.dtype).replace("torch.", ""), tuple(t.shape))
        out[name] = entry
    return out


def cleanup(scratch: str | os.PathLike | None = None) -> None:
    import shutil
    shutil.rmtree(Path(scratch) if scratch else SHM / f"rlfp8-{os.getpid()}-weights", ignore_errors=True)
