"""A PEFT adapter folder on disk: adapter_config.json + adapter_model.safetensors.

File format only (no model, no engine): the trainer writes checkpoints with it and the rollout actor
writes the adapter updates it hands to vLLM's path-based loader, so neither imports the other.
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
    save_file(tensors, str(tmp / WEIGHTS_FILE))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def read_adapter_folder(adapter_dir: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config dict, {PEFT key: tensor})."""
    adir = Path(adapter_dir)
    return json.loads((adir / CONFIG_FILE).read_text()), load_file(str(adir / WEIGHTS_FILE))
