"""Base-weight sources: where the trainer's frozen base comes from and where it lives between phases.

    quantize  load the 16-bit checkpoint on the CPU and quantize one projection at a time (two_copies)
    offload   the same, and the frozen base waits in pinned host memory while the engine runs (offloaded)
    map       the engine's FP8 tensors handed over (CUDA IPC on a GPU, files on a CPU machine: one_copy)

A placement names its source (rlfp8.placement); one_copy is a new source here, not a branch in the trainer.

Random-weight models (model.path=random:<arch>, a folder with a config and no weights): the model is built
with its parameters on the meta device and no 16-bit copy of it ever exists. `quantize`/`offload` fill
each projection with seeded uniform(-1e-3, 1e-3) values on the device just before quantizing it (one
layer at a time) and the other tensors likewise; `map` maps the projections AND the engine's other tensors
(embeddings, norms, lm_head: the engine exports them for random models), so one_copy computes exactly
what the engine computes. With two_copies / offloaded the engine's random base (vLLM's load_format="dummy",
its own seeded init) is NOT the trainer's: mismatch metrics and the parity probe are meaningless there
(timing and memory only; engine.parity_probe.every=0).
"""
from __future__ import annotations

import torch
from torch import nn

from rlfp8.models import is_random

from .adapters import adapter_kind
from .fp8_lora import apply_lora

RANDOM_RANGE = 1e-3         # vLLM's dummy weights are uniform(-1e-3, 1e-3) too: activations of the same size


class BaseWeightSource:
    """Builds the model with its adapted projections; release/restore move the base between phases."""
    name = ""

    def load(self, model_path: str, cfg: dict, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, list[str]]:
        raise NotImplementedError

    def release(self, model: nn.Module, device: torch.device) -> None:
        """Before the engine runs. Resident sources keep the base where it is."""

    def restore(self, model: nn.Module, device: torch.device, free_host: bool = False) -> None:
        """Before training. Resident sources keep the base where it is."""


class QuantizeFromCheckpoint(BaseWeightSource):
    name = "quantize"

    def load(self, model_path, cfg, device, dtype):
        from transformers import AutoModelForCausalLM
        acfg, tcfg = cfg["adapter"], cfg["trainer"]
        random_weights = is_random(cfg["model"]["path"])
        seed = int(cfg["seed"])
        if random_weights:
            model = meta_skeleton(model_path, dtype)
        else:     # the 16-bit checkpoint on the CPU, then quantize/move one projection at a time
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, low_cpu_mem_usage=True)
        if getattr(model.get_output_embeddings(), "bias", None) is not None:
            raise NotImplementedError("lm_head with a bias is not supported by the chunked log-prob path")
        fill = (lambda name, linear: fill_random(name, linear, device, dtype, seed)) if random_weights else None
        replaced = apply_lora(model, rank=int(acfg["rank"]), alpha=float(acfg["alpha"]),
                              targets=acfg["target_modules"], use_rslora=bool(acfg["use_rslora"]),
                              weights=tcfg["weights"], device=device,
                              module_cls=adapter_kind(acfg["type"]).module_cls, fill_meta=fill,
                              after_each=self.converted(device))
        if random_weights:
            materialise_dense(model, device, dtype, seed)
        self.place(model, device)
        model.config.use_cache = False
        return model, replaced

    def converted(self, device: torch.device):
        """apply_lora's after_each for this source (None: the converted projection stays on the device)."""
        return None

    def place(self, model: nn.Module, device: torch.device) -> None:
        """Where the loaded model lives when the trainer starts."""
        model.to(device)


class OffloadOnload(QuantizeFromCheckpoint):
    """The frozen base goes to (pinned, on a GPU machine) host memory; adapters and optimizer stay.
    On a CPU device there is nowhere else to go: only the state flag moves."""
    name = "offload"

    def __init__(self):
        self.offloaded = False

    def converted(self, device):
        """On a GPU each projection's frozen base goes to the host as soon as it is built: the whole 16-bit base is
        never on the device at set-up (a 32B one is 61 GiB beside the engine's weights and KV cache)."""
        return self._to_host if device.type == "cuda" else None

    def place(self, model, device):
        """GPU: the frozen base on the host (pinned), the adapters on the device: set-up ends offloaded."""
        if device.type != "cuda":
            model.to(device)
            return
        for p in model.parameters():
            if p.requires_grad and p.device != device:
                p.data = p.data.to(device)
        self.release(model, device)

    @staticmethod
    def _to_host(model: nn.Module) -> None:
        """Every frozen tensor of `model` into pinned host memory (those already pinned stay). The copies are
        asynchronous (a freed device block is reused in stream order): _settle() once after the last."""
        for mod, name in frozen_tensors(model):
            t = getattr(mod, name)
            if t.device.type == "cpu" and t.is_pinned():
                continue
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            _replace(mod, name, host)

    @staticmethod
    def _settle() -> None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def release(self, model, device):
        if device.type != "cuda" or self.offloaded:
            self.offloaded = True
            return
        self._to_host(model)
        self._settle()
        self.offloaded = True

    def restore(self, model, device, free_host=False):
        if device.type != "cuda" or not self.offloaded:
            self.offloaded = False
            return
        for mod, name in frozen_tensors(model):
            _replace(mod, name, getattr(mod, name).to(device, non_blocking=True))
        torch.cuda.synchronize()
        self.offloaded = False
        if free_host:       # the host copies are gone; without this torch keeps their pinned pages cached
            from rlfp8.process import empty_host_cache
            if not empty_host_cache():
                raise RuntimeError("restore_base(free_host=True): this torch cannot empty its pinned host cache")


class MapHandedOver(BaseWeightSource):
    """one_copy: the adapted projections alias the engine's FP8 codes and scales (handles from the engine's
    export_weights: CUDA IPC on a GPU, /dev/shm files on a CPU machine); q/k/v and gate/up are row views of
    the engine's fused tensors, and so are their biases where the architecture has them (Qwen2's q/k/v). The
    rest of the model (embeddings, norms, lm_head) is loaded as usual; the 16-bit projection weights are read on
    the host and dropped, never moved to the device. A random-weight model has no checkpoint: the rest is mapped
    from the engine too (its export's "dense" part)."""
    name = "map"

    def __init__(self, handles: dict | None = None):
        if not handles:
            raise ValueError("base-weight source 'map' needs the engine's exported weights (placement=one_copy)")
        self.handles = handles

    def load(self, model_path, cfg, device, dtype):
        from transformers import AutoModelForCausalLM
        acfg = cfg["adapter"]
        random_weights = is_random(cfg["model"]["path"])
        if random_weights:
            model = meta_skeleton(model_path, dtype)
        else:
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
            q, scale, bias = views[name]
            mod = cls(module.in_features, module.out_features, int(acfg["rank"]), float(acfg["alpha"]),
                      bool(acfg["use_rslora"]), "fp8")
            mod.qweight, mod.weight_scale = q, scale
            if (module.bias is not None) != (bias is not None):
                raise ValueError(f"one_copy: {name} has {'a' if module.bias is not None else 'no'} bias in the "
                                 f"trainer's model but the engine exported {'one' if bias is not None else 'none'}")
            if bias is not None:     # the engine's values (a random model's exist nowhere else), aliased
                mod.bias = bias.to(device=device, dtype=dtype)
            mod.to(device)
            if hasattr(mod, "init_magnitude"):
                mod.init_magnitude()
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, mod)
            replaced.append(name)
        if random_weights:
            dense = {n: map_handle(h) for n, h in self.handles["dense"].items()}
            materialise_dense(model, device, dtype, int(cfg["seed"]), source=dense)
        for p in model.parameters():
            if not any(p is q for m in replaced for q in model.get_submodule(m).parameters()):
                p.requires_grad_(False)
        model.to(device)
        model.config.use_cache = False
        return model, replaced

    def _row_views(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """HF projection name -> (codes, scales, bias or None), row views of the engine's (possibly fused) tensors."""
        from rlfp8.shared_tensors import PACKED_MODULES
        views = {}
        for vname, entry in self.handles["projections"].items():
            q, scale = map_handle(entry["weight"]), map_handle(entry["weight_scale"])
            bias = map_handle(entry["bias"]) if "bias" in entry else None
            parent, _, last = vname.rpartition(".")
            subs = PACKED_MODULES.get(last, [last])
            if len(subs) != len(entry["widths"]):
                raise ValueError(f"one_copy: {vname} packs {entry['widths']} rows but {subs} were expected")
            start = 0
            for sub, width in zip(subs, entry["widths"]):
                rows = slice(start, start + width)
                views[f"{parent}.{sub}"] = (q[rows], scale[rows], None if bias is None else bias[rows])
                start += width
        return views

    def tensors(self) -> list[torch.Tensor]:
        return [map_handle(e[k]) for e in self.handles["projections"].values() for k in ("weight", "weight_scale")]


class _ParametersOnMeta:
    """Within: every nn.Parameter is created on the meta device; buffers (rotary inv_freq) stay real."""

    def __enter__(self):
        self.original = nn.Module.register_parameter

        def register(module, name, param):
            if param is not None and not param.is_meta:
                param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            self.original(module, name, param)
        nn.Module.register_parameter = register

    def __exit__(self, *exc):
        nn.Module.register_parameter = self.original


def meta_skeleton(model_path: str, dtype: torch.dtype) -> nn.Module:
    """The model of `model_path`'s config.json with every parameter on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(model_path)
    with _ParametersOnMeta():
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _generator(device: torch.device, seed: int, name: str) -> torch.Generator:
    import hashlib
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=7).digest(), "little"))
    return g


def fill_random(name: str, linear: nn.Linear, device: torch.device, dtype: torch.dtype, seed: int) -> None:
    """One projection's weight (and bias: zeros), seeded by (seed, name), on the device: apply_lora quantizes
    it right away, so only one 16-bit layer exists at a time."""
    w = torch.empty(linear.weight.shape, device=device, dtype=dtype)
    w.uniform_(-RANDOM_RANGE, RANDOM_RANGE, generator=_generator(device, seed, name))
    linear.weight = nn.Parameter(w, requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(torch.zeros(linear.out_features, device=device, dtype=dtype), requires_grad=False)


def materialise_dense(model: nn.Module, device: torch.device, dtype: torch.dtype, seed: int,
                      source: dict[str, torch.Tensor] | None = None) -> None:
    """Every parameter still on the meta device (embeddings, norms, lm_head) gets a real frozen tensor: the
    engine's tensor of the same name when `source` has it (aliased, rows cut to the vocabulary where vLLM
    pads), else seeded uniform values. A parameter `source` should have but lacks is an error."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    for mod_name, mod in model.named_modules():
        for pname, p in list(mod.named_parameters(recurse=False)):
            if not p.is_meta or (tied and mod is model.get_output_embeddings()):
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            if source is not None:
                if full not in source:
                    raise ValueError(f"one_copy with model.path=random:...: the engine exported no tensor {full!r} "
                                     f"(exported: {sorted(source)[:6]}...)")
                t = source[full][: p.shape[0]]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"one_copy: the engine's {full} is {tuple(source[full].shape)}, the trainer's "
                                     f"{tuple(p.shape)}")
                t = t.to(device=device, dtype=dtype)
            else:
                t = torch.empty(p.shape, device=device, dtype=dtype)
                t.uniform_(-RANDOM_RANGE, RANDOM_RANGE, generator=_generator(device, seed, full))
            mod._parameters[pname] = nn.Parameter(t, requires_grad=False)
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight


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
