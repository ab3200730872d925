"""Adapter files in PEFT's format, so `peft.PeftModel.from_pretrained` and vLLM's LoRA loader read
them unchanged: adapter_config.json (a peft.LoraConfig) + adapter_model.safetensors with keys
`base_model.model.<module path>.lora_A.weight` [r, K] and `....lora_B.weight` [N, r].
Which tensors and keys: the adapter kind (adapters.py); the folder itself: rlfp8.peft_format.

Tensors are written in fp32 (the optimizer's masters): the engine folds the scaling into B and casts
to its own dtype, the same rounding the trainer's forward applies.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from rlfp8.peft_format import read_adapter_folder, write_adapter_folder

from .adapters import PEFT_PREFIX, AdapterKind, kind_of  # noqa: F401

PREFIX = PEFT_PREFIX


def adapter_state_dict(model: torch.nn.Module, kind: AdapterKind | None = None) -> dict[str, torch.Tensor]:
    kind = kind or kind_of(model)
    return kind.state_dict(model)


def adapter_config(model: torch.nn.Module, base_model: str, kind: AdapterKind | None = None) -> dict:
    kind = kind or kind_of(model)
    return kind.peft_config(model, base_model)


def save_adapter(model: torch.nn.Module, out_dir: str | os.PathLike, base_model: str,
                 config: dict | None = None, kind: AdapterKind | None = None) -> Path:
    """Write atomically (temp folder + rename): a reader never sees half an adapter."""
    kind = kind or kind_of(model)
    file_config = config if config is not None else kind.peft_config(model, base_model)
    return write_adapter_folder(out_dir, kind.state_dict(model), file_config)


def load_adapter(model: torch.nn.Module, adapter_dir: str | os.PathLike, kind: AdapterKind | None = None) -> None:
    """Copy a PEFT adapter into the model's adapter modules (shapes and scaling checked)."""
    kind = kind or kind_of(model)
    file_config, tensors = read_adapter_folder(adapter_dir)
    kind.check_compatible(file_config, model, str(adapter_dir))
    kind.load_state_dict(model, tensors, str(adapter_dir))
