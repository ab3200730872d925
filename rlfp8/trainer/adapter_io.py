"""Adapter files in PEFT's format, so `peft.PeftModel.from_pretrained` and vLLM's LoRA loader read
them unchanged: adapter_config.json (a peft.LoraConfig) + adapter_model.safetensors with keys
`base_model.model.<module path>.lora_A.weight` [r, K] and `....lora_B.weight` [N, r]; DoRA adds
`"use_dora": true` and `....lora_magnitude_vector` [N] (the key names: rlfp8.trainer.dora.ADAPTER_TENSORS).

Tensors are written in fp32 (the optimizer's masters): the engine folds the scaling into B and casts
to its own dtype, the same rounding the trainer's forward applies.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .dora import adapter_type, trainable_params
from .fp8_lora import lora_modules

PREFIX = "base_model.model."


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in lora_modules(model).items():
        for key, p in trainable_params(m).items():
            out[f"{PREFIX}{name}.{key}"] = p.detach().to("cpu", torch.float32).contiguous()
    return out


def adapter_config(model: torch.nn.Module, base_model: str) -> dict:
    mods = list(lora_modules(model).values())
    if not mods:
        raise ValueError("the model has no LoRA modules")
    m0 = mods[0]
    targets = sorted({n.rsplit(".", 1)[-1] for n in lora_modules(model)})
    from peft import LoraConfig
    cfg = LoraConfig(r=m0.rank, lora_alpha=m0.lora_alpha, target_modules=targets, use_rslora=m0.use_rslora,
                     use_dora=adapter_type(m0) == "dora", lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", base_model_name_or_path=str(base_model))
    return cfg.to_dict()


def save_adapter(model: torch.nn.Module, out_dir: str | os.PathLike, base_model: str,
                 config: dict | None = None) -> Path:
    """Write atomically (temp folder + rename): a reader never sees half an adapter."""
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = dict(config) if config is not None else adapter_config(model, base_model)
    for k, v in list(cfg.items()):            # LoraConfig.to_dict holds sets; JSON wants lists
        if isinstance(v, set):
            cfg[k] = sorted(v)
    (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=2, default=str))
    save_file(adapter_state_dict(model), str(tmp / "adapter_model.safetensors"))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def load_adapter(model: torch.nn.Module, adapter_dir: str | os.PathLike) -> None:
    """Copy a PEFT LoRA/DoRA adapter into the model's FP8LoRALinear / FP8DoRALinear modules (kind, shapes and
    scaling checked)."""
    adir = Path(adapter_dir)
    cfg = json.loads((adir / "adapter_config.json").read_text())
    tensors = load_file(str(adir / "adapter_model.safetensors"))
    mods = lora_modules(model)
    file_kind = "dora" if cfg.get("use_dora", False) else "lora"
    for name, m in mods.items():
        if adapter_type(m) != file_kind:
            raise ValueError(f"adapter {adir}: adapter_config.json has use_dora={cfg.get('use_dora', False)} but "
                             f"{name} is a {adapter_type(m)} module (set adapter.type={file_kind} to match)")
        r = cfg.get("rank_pattern", {}).get(name.rsplit(".", 1)[-1], cfg["r"])
        alpha = cfg.get("alpha_pattern", {}).get(name.rsplit(".", 1)[-1], cfg["lora_alpha"])
        if r != m.rank or float(alpha) != float(m.lora_alpha) or bool(cfg.get("use_rslora", False)) != m.use_rslora:
            raise ValueError(f"adapter {adir}: {name} has r={r}, alpha={alpha}, rslora={cfg.get('use_rslora')} "
                             f"but the model was built with r={m.rank}, alpha={m.lora_alpha}, rslora={m.use_rslora} "
                             "(set adapter.rank / adapter.alpha to match)")
        for part, param in trainable_params(m).items():
            key = f"{PREFIX}{name}.{part}"
            if key not in tensors:
                raise KeyError(f"adapter {adir}: missing tensor {key}")
            t = tensors.pop(key)
            if t.shape != param.shape:
                raise ValueError(f"adapter {adir}: {key} has shape {tuple(t.shape)}, expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(t)
    if tensors:
        raise KeyError(f"adapter {adir}: tensors for modules this model does not adapt: {sorted(tensors)[:4]}...")
