"""A PEFT adapter folder on disk: adapter_config.json + adapter_model.safetensors.

File format only (no model, no engine): the trainer writes checkpoints with it and the rollout actor
writes the adapter updates it hands to vLLM's path-based loader, so neither imports the other. In memory, an
adapter update travels between the actors as PackedTensors: one flat buffer through Ray, not one pickled
tensor per key.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class PackedTensors(dict):
    """{PEFT key: tensor} that pickles as ONE contiguous buffer per dtype plus (key, shape) pairs, and unpickles
    into views of it: an adapter of a few hundred tensors crosses Ray in one copy instead of one pickled
    tensor each (what made the sync slow). Tensors must be on the CPU."""

    _flat: tuple | None = None          # (keys, shapes, buffer, views) when every value is a view of one buffer

    @classmethod
    def from_flat(cls, keys: list[str], shapes: list[tuple], flat: torch.Tensor) -> "PackedTensors":
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        views = [v.view(s) for v, s in zip(flat.split(sizes), shapes)]
        packed = cls(zip(keys, views))
        packed._flat = (list(keys), [tuple(s) for s in shapes], flat, views)
        return packed

    def _own_buffer(self):
        """(keys, shapes, buffer) when the values are still exactly from_flat's views: pickled as is, no copy."""
        if self._flat is None:
            return None
        keys, shapes, flat, views = self._flat
        if list(self) != keys or any(self[k] is not v for k, v in zip(keys, views)) or flat.device.type != "cpu":
            return None
        return keys, shapes, flat

    def __reduce__(self):
        own = self._own_buffer()
        if own is not None:
            keys, shapes, flat = own
            return _unpack_tensors, ([(keys, shapes, str(flat.dtype).removeprefix("torch."), _as_numpy(flat))], keys)
        groups: dict[torch.dtype, list[str]] = {}
        for k, t in self.items():
            if t.device.type != "cpu":
                raise ValueError(f"PackedTensors: {k} is on {t.device} {tuple(t.shape)}; adapter updates travel "
                                 "as CPU tensors")
            groups.setdefault(t.dtype, []).append(k)
        parts = [(ks, [tuple(self[k].shape) for k in ks], str(dtype).removeprefix("torch."),
                  _as_numpy(torch.cat([self[k].reshape(-1) for k in ks])))
                 for dtype, ks in groups.items()]
        return _unpack_tensors, (parts, list(self))


def _as_numpy(flat: torch.Tensor):
    """The buffer as a numpy array (bf16 and other dtypes numpy lacks: their bytes): pickle protocol 5 and Ray
    carry numpy buffers out of band (one copy into Ray's object store, read in place on the same node), where a
    torch tensor would be re-serialised through torch.save."""
    if flat.dtype in (torch.float32, torch.float64, torch.float16, torch.int32, torch.int64):
        return flat.numpy()
    return flat.view(torch.uint8).numpy()


def _unpack_tensors(parts, order: list[str]) -> PackedTensors:
    """Views of the received buffers. From Ray they are its read-only shared memory, read in place: consumers
    copy out (the engine into its slots, the driver's checksums) and never write them."""
    import warnings
    views: dict[str, torch.Tensor] = {}
    for keys, shapes, dtype_name, arr in parts:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            flat = torch.from_numpy(arr)
        dtype = getattr(torch, dtype_name)
        views.update(PackedTensors.from_flat(keys, shapes, flat if flat.dtype == dtype else flat.view(dtype)))
    return PackedTensors((k, views[k]) for k in order)


def write_adapter_folder(out_dir: str | os.PathLike, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """Write atomically (temp folder + rename): a reader never sees half an adapter."""
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    file_config = dict(config)
    for k, v in list(file_config.items()):    # LoraConfig.to_dict holds sets; JSON wants lists
        if isinstance(v, set):
            file_config[k] = sorted(v)
    (tmp / CONFIG_FILE).write_text(json.dumps(file_config, indent=2, default=str))
    if isinstance(tensors, PackedTensors):        # views of one buffer: safetensors refuses shared storage
        tensors = {k: t.clone() for k, t in tensors.items()}
    save_file(tensors, str(tmp / WEIGHTS_FILE))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def read_adapter_folder(adapter_dir: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config dict, {PEFT key: tensor})."""
    adir = Path(adapter_dir)
    return json.loads((adir / CONFIG_FILE).read_text()), load_file(str(adir / WEIGHTS_FILE))
