"""The engine's FP8 base weights handed to another process (placement=one_copy): the trainer maps them instead of
holding a copy.

`export_weights(model)` returns, for every projection computed by rlfp8's quant method, the handles of its codes
`weight` [N, K] e4m3 and scales `weight_scale` [N] fp32 (and of its `bias` [N] where it has one: Qwen2's q/k/v),
and the row widths of the slices packed in it (qkv: q, k, v; gate_up: gate, up), keyed by vLLM's module name:
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


def export_weights(model, scratch: str | os.PathLike | None = None, dense: bool = False) -> dict:
    """{"projections": {vLLM module name -> {"weight": handle, "weight_scale": handle, "bias": handle (only where
    the projection has one), "widths": [rows per packed slice]}}, "dense": {parameter name -> handle}}.
    dense=True (random-weight models, whose other tensors exist nowhere else) also exports every other parameter
    (embeddings, norms, lm_head; vLLM's LoRA wrappers' names without ".base_layer"), so the trainer computes on
    exactly the engine's model."""
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
        for part in ("weight", "weight_scale", "bias"):
            if getattr(mod, part, None) is not None:       # a bias only where the architecture has one
                entry[part] = _handle(getattr(mod, part), folder, f"{name}.{part}")
        out[name] = entry
    dense_out = {}
    if dense:
        for pname, param in model.named_parameters():
            hf_name = pname.replace(".base_layer", "")
            if hf_name.rpartition(".")[0] not in mods:
                dense_out[hf_name] = _handle(param, folder, hf_name)
    return {"projections": out, "dense": dense_out}


def _handle(param: torch.Tensor, folder: Path | None, name: str):
    """CUDA IPC handle of a GPU tensor; on a CPU machine the tensor's storage moves (once) into the file
    `folder/name` and the handle names it."""
    if param.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor
        return ("cuda_ipc", reduce_tensor(param.data))
    path = folder / name
    if not path.exists():
        param.data = _to_shared_file(param.data, path)
    return ("file", str(path), str(param.dtype).replace("torch.", ""), tuple(param.shape))


def cleanup(scratch: str | os.PathLike | None = None) -> None:
    import shutil
    shutil.rmtree(Path(scratch) if scratch else SHM / f"rlfp8-{os.getpid()}-weights", ignore_errors=True)
