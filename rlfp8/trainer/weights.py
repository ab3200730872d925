"""Base-weight sources: where the trainer's frozen base comes from and where it lives between phases.

    quantize  load the 16-bit checkpoint on the CPU and quantize one projection at a time (two_copies)
    offload   the same, and the frozen base waits in pinned host memory while the engine runs (offloaded)
    map       the engine's FP8 tensors handed over through CUDA IPC (one_copy): not built yet (issue 14)

A placement names its source (rlfp8.placement); one_copy is a new source here, not a branch in the trainer.
"""
from __future__ import annotations

import torch
from torch import nn

from .adapters import adapter_kind
from .fp8_lora import apply_lora


class BaseWeightSource:
    """Builds the model with its adapted projections; release/restore move the base between phases."""
    name = ""

    def load(self, model_path: str, cfg: dict, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, list[str]]:
        raise NotImplementedError

    def release(self, model: nn.Module, device: torch.device) -> None:
        """Before the engine runs. Resident sources keep the base where it is."""

    def restore(self, model: nn.Module, device: torch.device) -> None:
        """Before training. Resident sources keep the base where it is."""


class QuantizeFromCheckpoint(BaseWeightSource):
    name = "quantize"

    def load(self, model_path, cfg, device, dtype):
        from transformers import AutoModelForCausalLM
        acfg, tcfg = cfg["adapter"], cfg["trainer"]
        # Load the 16-bit checkpoint on the CPU, then quantize/move one projection at a time.
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, low_cpu_mem_usage=True)
        if getattr(model.get_output_embeddings(), "bias", None) is not None:
            raise NotImplementedError("lm_head with a bias is not supported by the chunked log-prob path")
        replaced = apply_lora(model, rank=int(acfg["rank"]), alpha=float(acfg["alpha"]),
                              targets=acfg["target_modules"], use_rslora=bool(acfg["use_rslora"]),
                              weights=tcfg["weights"], device=device,
                              module_cls=adapter_kind(acfg["type"]).module_cls)
        model.to(device)
        model.config.use_cache = False
        return model, replaced


class OffloadOnload(QuantizeFromCheckpoint):
    """The frozen base goes to (pinned, on a GPU machine) host memory; adapters and optimizer stay.
    On a CPU device there is nowhere else to go: only the state flag moves."""
    name = "offload"

    def __init__(self):
        self.offloaded = False

    def release(self, model, device):
        if device.type != "cuda" or self.offloaded:
            self.offloaded = True
            return
        for mod, name in frozen_tensors(model):
            t = getattr(mod, name)
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            _replace(mod, name, host)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.offloaded = True

    def restore(self, model, device):
        if device.type != "cuda" or not self.offloaded:
            self.offloaded = False
            return
        for mod, name in frozen_tensors(model):
            _replace(mod, name, getattr(mod, name).to(device, non_blocking=True))
        torch.cuda.synchronize()
        self.offloaded = False


class MapHandedOver(BaseWeightSource):
    """one_copy: the adapted projections alias the engine's FP8 codes and scales (handles from the engine's
    export_weights: CUDA IPC on a GPU, /dev/shm files on a CPU machine); q/k/v and gate/up are row views of
    the engine's fused tensors. The rest of the model (embeddings, norms, lm_head) is loaded as usual; the
    16-bit projection weights are read on the host and dropped, never moved to the device."""
    name = "map"

    def __init__(self, handles: dict | None = None):
        if not handles:
            raise ValueError("base-weight source 'map' needs the engine's exported weights (placement=one_copy)")
        self.handles = handles

    def load(self, model_path, cfg, device, dtype):
        from transformers import AutoModelForCausalLM
        acfg = cfg["adapter"]
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, low_cpu_mem_usage=True)
        cls = adapter_kind(acfg["type"]).module_cls
        views = self._row_views()
        replaced = []
        for name, module in list(model.named_modules()):
            short = name.rsplit(".", 1)[-1]
            if not isinstance(module, nn.Linear) or short not in acfg["target_modules"]:
                continue
            if name not in views:
                raise ValueError(f"one_copy: the engine exported no FP8 codes for {name} (exported: "
                                 f"{sorted(views)[:4]}...)")
            q, scale = views[name]
            mod = cls(module.in_features, module.out_features, int(acfg["rank"]), float(acfg["alpha"]),
                      bool(acfg["use_rslora"]), "fp8")
            mod.qweight, mod.weight_scale = q, scale
            if module.bias is not None:
                mod.bias = module.bias.detach().to(device).clone()
            mod.to(device)
            if hasattr(mod, "init_magnitude"):
                mod.init_magnitude()
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, mod)
            replaced.append(name)
        for p in model.parameters():
            if not any(p is q for m in replaced for q in model.get_submodule(m).parameters()):
                p.requires_grad_(False)
        model.to(device)
        model.config.use_cache = False
        return model, replaced

    def _row_views(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """HF projection name -> (codes, scales), row views of the engine's (possibly fused) tensors."""
        from rlfp8.shared_tensors import PACKED_MODULES
        views = {}
        for vname, entry in self.handles.items():
            q, scale = map_handle(entry["weight"]), map_handle(entry["weight_scale"])
            parent, _, last = vname.rpartition(".")
            subs = PACKED_MODULES.get(last, [last])
            if len(subs) != len(entry["widths"]):
                raise ValueError(f"one_copy: {vname} packs {entry['widths']} rows but {subs} were expected")
            start = 0
            for sub, width in zip(subs, entry["widths"]):
                views[f"{parent}.{sub}"] = (q[start:start + width], scale[start:start + width])
                start += width
        return views

    def tensors(self) -> list[torch.Tensor]:
        return [map_handle(e[k]) for e in self.handles.values() for k in ("weight", "weight_scale")]


def map_handle(handle) -> torch.Tensor:
    """A tensor aliasing the exporter's memory (the format: rlfp8.shared_tensors)."""
    from rlfp8.shared_tensors import map_shared_tensor
    return map_shared_tensor(handle)


SOURCES: dict[str, type[BaseWeightSource]] = {s.name: s for s in (QuantizeFromCheckpoint, OffloadOnload, MapHandedOver)}


def make_weight_source(name: str, handles: dict | None = None) -> BaseWeightSource:
    if name not in SOURCES:
        raise ValueError(f"base-weight source {name!r}: allowed values are {sorted(SOURCES)}")
    return SOURCES[name](handles) if name == "map" else SOURCES[name]()


def frozen_tensors(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, buffer name) of every frozen tensor: what `offload` moves out between phases."""
    out = []
    for mod in model.modules():
        for name, b in mod.named_buffers(recurse=False):
            if b is not None and b.numel() > 0:
                out.append((mod, name))
        for name, p in mod.named_parameters(recurse=False):
            if not p.requires_grad:
                out.append((mod, name))
    return out


def _replace(mod: nn.Module, name: str, t: torch.Tensor) -> None:
    if name in mod._parameters:
        mod._parameters[name] = torch.nn.Parameter(t, requires_grad=False)
    else:
        mod._buffers[name] = t
