"""Adapter kinds: which parameters of the model an adapter trains, under which PEFT file keys, and
its PEFT adapter_config. The optimizer (core.py), save/load (adapter_io.py) and the sync to the
engine (export_adapter) all go through one AdapterKind, so a new kind (DoRA's magnitude vector)
adds its parameters here once.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from .dora import FP8DoRALinear, adapter_type, trainable_params
from .fp8_lora import FP8LoRALinear, lora_modules

PEFT_PREFIX = "base_model.model."
# What adapter.type may name (rlfp8.config reads this list); each has its kind in KINDS below.
ADAPTER_TYPES = ("lora", "dora")


class AdapterKind(ABC):
    name: str

    @abstractmethod
    def trainable_parameters(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """PEFT file key -> trainable parameter, in a fixed order (the optimizer's order)."""

    @abstractmethod
    def peft_config(self, model: nn.Module, base_model: str) -> dict:
        """The adapter_config.json content (a PEFT config as a dict)."""

    @abstractmethod
    def check_compatible(self, file_config: dict, model: nn.Module, where: str) -> None:
        """Raise ValueError, naming the config keys to change, when a file does not fit this model."""

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """CPU fp32 copies of the trainable tensors (the optimizer's masters), by PEFT key: one device-to-host
        copy of them all, as PackedTensors (one buffer through Ray)."""
        from rlfp8.peft_format import PackedTensors
        params = self.trainable_parameters(model)
        if not params:
            return PackedTensors()
        flat = torch.cat([p.detach().to(torch.float32).reshape(-1) for p in params.values()]).cpu()
        return PackedTensors.from_flat(list(params), [tuple(p.shape) for p in params.values()], flat)

    def load_state_dict(self, model: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
        """Copy every tensor into its parameter (shapes checked); every key must be used exactly once."""
        tensors = dict(tensors)
        for key, param in self.trainable_parameters(model).items():
            if key not in tensors:
                raise KeyError(f"adapter {where}: missing tensor {key}")
            t = tensors.pop(key)
            if t.shape != param.shape:
                raise ValueError(f"adapter {where}: {key} has shape {tuple(t.shape)}, expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(t)
        if tensors:
            raise KeyError(f"adapter {where}: tensors for modules this model does not adapt: {sorted(tensors)[:4]}...")


class LoRA(AdapterKind):
    """PEFT LoRA: lora_A [r, K] and lora_B [N, r] per adapted projection (DoRA adds its magnitude: the
    per-module table is rlfp8.trainer.dora.ADAPTER_TENSORS)."""
    name = "lora"
    use_dora = False
    module_cls = FP8LoRALinear

    def trainable_parameters(self, model: nn.Module) -> dict[str, nn.Parameter]:
        out = {}
        for name, m in lora_modules(model).items():
            if adapter_type(m) != self.name:
                raise ValueError(f"adapter.type={self.name} but {name} is a {adapter_type(m)} module")
            out.update({f"{PEFT_PREFIX}{name}.{key}": p for key, p in trainable_params(m).items()})
        return out

    def peft_config(self, model: nn.Module, base_model: str) -> dict:
        mods = lora_modules(model)
        if not mods:
            raise ValueError("the model has no LoRA modules")
        m0 = next(iter(mods.values()))
        targets = sorted({n.rsplit(".", 1)[-1] for n in mods})
        from peft import LoraConfig
        lora_config = LoraConfig(r=m0.rank, lora_alpha=m0.lora_alpha, target_modules=targets,
                                 use_rslora=m0.use_rslora, use_dora=self.use_dora, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                                 base_model_name_or_path=str(base_model))
        return lora_config.to_dict()

    def check_compatible(self, file_config: dict, model: nn.Module, where: str) -> None:
        if bool(file_config.get("use_dora", False)) != self.use_dora:
            raise ValueError(f"adapter {where}: adapter_config.json has use_dora={file_config.get('use_dora', False)} "
                             f"but the run has adapter.type={self.name} (set adapter.type="
                             f"{'dora' if file_config.get('use_dora') else 'lora'} to match the file)")
        for name, m in lora_modules(model).items():
            short = name.rsplit(".", 1)[-1]
            r = file_config.get("rank_pattern", {}).get(short, file_config["r"])          # PEFT's optional keys
            alpha = file_config.get("alpha_pattern", {}).get(short, file_config["lora_alpha"])
            rslora = bool(file_config.get("use_rslora", False))
            if r != m.rank or float(alpha) != float(m.lora_alpha) or rslora != m.use_rslora:
                raise ValueError(f"adapter {where}: {name} has r={r}, alpha={alpha}, rslora={rslora} "
                                 f"but the model was built with r={m.rank}, alpha={m.lora_alpha}, rslora={m.use_rslora} "
                                 "(set adapter.rank / adapter.alpha to match)")


class DoRA(LoRA):
    """PEFT DoRA: LoRA's tensors plus lora_magnitude_vector [N] per projection, `use_dora: true`."""
    name = "dora"
    use_dora = True
    module_cls = FP8DoRALinear


KINDS: dict[str, AdapterKind] = {"lora": LoRA(), "dora": DoRA()}


def adapter_kind(adapter_type: str) -> AdapterKind:
    if adapter_type in KINDS:
        return KINDS[adapter_type]
    if adapter_type in ADAPTER_TYPES:
        raise NotImplementedError(f"adapter.type={adapter_type} is not built end to end yet (issue 16); "
                                  "use adapter.type=lora")
    raise ValueError(f"adapter.type={adapter_type!r}: allowed values are {list(ADAPTER_TYPES)}")


def kind_of(model: nn.Module) -> AdapterKind:
    """The kind of the adapter modules a model holds (one kind per model)."""
    kinds = {adapter_type(m) for m in lora_modules(model).values()}
    if len(kinds) != 1:
        raise ValueError(f"the model holds adapter modules of kinds {sorted(kinds)}: expected exactly one kind")
    return KINDS[kinds.pop()]
