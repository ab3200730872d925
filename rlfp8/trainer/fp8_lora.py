"""FP8LoRALinear: a frozen FP8 (or 16-bit) base projection plus a trainable LoRA adapter, and
`apply_lora` which swaps every attention and MLP projection of an HF causal LM for it.

The base is held as buffers (never parameters): FP8 codes `qweight` [N, K] float8_e4m3fn and per-row
`weight_scale` [N] fp32, produced by the one quantizer the engine also uses
(rlfp8.kernels.quantize_weight), so both sides hold bit-identical codes. With trainer.weights=bf16 the
buffer is the dense `weight` [N, K] in the model dtype (the baseline arm). Buffers may later alias
the engine's memory (one_copy placement), so nothing here writes to them.

LoRA follows PEFT: A [r, K] initialised kaiming-uniform(a=sqrt(5)), B [N, r] zeros, scaling
alpha/r (alpha/sqrt(r) with rsLoRA), adapter masters in fp32. Saved names are PEFT's
(`base_model.model.<module>.lora_A.weight`), see adapter_io.py.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from rlfp8.kernels import linear as klinear
from rlfp8.kernels.fp8 import quantize_weight

# Attention and MLP projections of the Qwen2/Qwen3/Llama families (HF module names).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHT_MODES = ("fp8", "bf16")


class FP8LoRALinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, use_rslora: bool = False,
                 weights: str = "fp8"):
        super().__init__()
        if weights not in WEIGHT_MODES:
            raise ValueError(f"trainer.weights={weights!r}: allowed values are {WEIGHT_MODES}")
        if rank < 1:
            raise ValueError(f"adapter.rank={rank}: must be >= 1")
        self.in_features, self.out_features, self.rank, self.weights = in_features, out_features, rank, weights
        self.lora_alpha, self.use_rslora = alpha, use_rslora
        self.scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, dtype=torch.float32))     # [r, K]
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, dtype=torch.float32))    # [N, r]
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.adapter_enabled = True
        self._cast_key = None                 # adapter_casts' cache: key and (A_c, B_c)
        self._casts = None
        for name in ("qweight", "weight_scale", "weight", "bias"):     # set by from_linear
            self.register_buffer(name, None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, alpha: float, use_rslora: bool = False,
                    weights: str = "fp8", device: torch.device | str | None = None) -> "FP8LoRALinear":
        """Quantize (or keep) `linear`'s weight; the 16-bit weight is dropped afterwards."""
        device = torch.device(device) if device is not None else linear.weight.device
        mod = cls(linear.in_features, linear.out_features, rank, alpha, use_rslora, weights)
        w = linear.weight.detach().to(device)
        if weights == "fp8":
            q, s = quantize_weight(w)
            mod.qweight, mod.weight_scale = q, s              # [N, K] float8_e4m3fn, [N] fp32
        else:
            mod.weight = w.clone()                            # [N, K] model dtype
        if linear.bias is not None:
            mod.bias = linear.bias.detach().to(device).clone()
        mod.to(device)
        return mod

    def adapter_key(self, *extra) -> tuple:
        """What a cache of values derived from (A, B, s) is keyed on: in-place updates of A or B (an optimizer
        step, load_state_dict) bump their versions."""
        A, B = self.lora_A, self.lora_B
        return (A._version, B._version, A.data_ptr(), B.data_ptr(), self.scaling, *extra)

    def adapter_casts(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(A.to(dtype), (B·s).to(dtype)), the Triton linear's operand roundings, detached and cached per
        (A, B) version: every micro-batch, the pi_old pass and the parity probe of one step reuse them; an
        optimizer step or load_state_dict (in-place updates) bumps the versions and forces a recompute."""
        A, B = self.lora_A, self.lora_B
        key = self.adapter_key(A.device, dtype)
        if self._cast_key == key and not torch.is_inference_mode_enabled():
            return self._casts
        with torch.no_grad():
            casts = (A.to(dtype), (B * self.scaling).to(dtype))
        if not torch.is_inference_mode_enabled():      # inference tensors could not be saved for backward later
            self._cast_key, self._casts = key, casts
        return casts

    def forward(self, x: torch.Tensor) -> torch.Tensor:       # x [..., K] -> [..., N]
        A, B = (self.lora_A, self.lora_B) if self.adapter_enabled else (None, None)
        if self.weights == "fp8":
            return klinear.lora_linear(x, self.qweight, self.weight_scale, A, B, self.scaling, self.bias,
                                       casts=self.adapter_casts)
        return klinear.dense_lora_linear(x, self.weight, A, B, self.scaling, self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, base={self.weights}, r={self.rank}, "
                f"alpha={self.lora_alpha}, rslora={self.use_rslora}")


def apply_lora(model: nn.Module, rank: int, alpha: float, targets: Iterable[str] = DEFAULT_TARGETS,
               use_rslora: bool = False, weights: str = "fp8", device: torch.device | str | None = None,
               exclude: str | None = None, module_cls: type | None = None,
               fill_meta: Callable[[str, nn.Module], None] | None = None,
               after_each: Callable[[nn.Module], None] | None = None) -> list[str]:
    """Replace every nn.Linear whose last name is in `targets` by a `module_cls` (FP8LoRALinear by default;
    the adapter kind names its class: rlfp8.trainer.adapters); freeze the rest.

    Modules are converted one at a time (quantize on `device`, drop the 16-bit weight) so the peak
    memory is the FP8 model plus one 16-bit layer. fill_meta(name, linear): gives a linear whose weight is
    still on the meta device its values just before it is converted (random-weight models). after_each(new
    module): called right after each conversion (the offload source moves the frozen base to the host there, so
    a 16-bit base is never whole on the device). Returns the replaced module names.
    """
    cls = module_cls or FP8LoRALinear
    targets = set(targets)
    unknown = targets - set(DEFAULT_TARGETS) - {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    if unknown:
        raise ValueError(f"adapter.target_modules: {sorted(unknown)} match no module of this model; "
                         f"projections here are {sorted({n.rsplit('.', 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})}")
    for p in model.parameters():
        p.requires_grad_(False)
    replaced = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or name.rsplit(".", 1)[-1] not in targets:
            continue
        if exclude and re.search(exclude, name):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if fill_meta is not None and module.weight.is_meta:
            fill_meta(name, module)
        converted = cls.from_linear(module, rank, alpha, use_rslora, weights, device)
        setattr(parent, child, converted)
        for pname in list(module._parameters):   # the loop's module list keeps the original alive: drop its
            module._parameters[pname] = None      # 16-bit tensors now (a filled random weight is on the device)
        if after_each is not None:
            after_each(converted)
        replaced.append(name)
    if not replaced:
        raise ValueError(f"adapter.target_modules={sorted(targets)}: no nn.Linear matched")
    return replaced


def lora_modules(model: nn.Module) -> dict[str, FP8LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, FP8LoRALinear)}


class adapters_disabled:
    """Context manager: the base model alone (the reference policy for the KL term)."""

    def __init__(self, model: nn.Module):
        self.mods = list(lora_modules(model).values())

    def __enter__(self):
        for m in self.mods:
            m.adapter_enabled = False

    def __exit__(self, *exc):
        for m in self.mods:
            m.adapter_enabled = True
