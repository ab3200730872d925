"""The rlfp8 quantization method for vLLM: a bf16 checkpoint quantized at load time into rlfp8's FP8 layout,
every projection computed by rlfp8's kernels.

Names registered by the plugin (rlfp8/rollout/vllm_plugin.py):
  quantization="rlfp8"        the matched W8A16 engine: FP8 weights widened in registers, 16-bit activations,
                              fp32 accumulation, the FP8 trainer's arithmetic;
  quantization="rlfp8_w8a8"   activations rounded to FP8 per token (vLLM's dynamic per-token formula).
Both hold `weight` as float8_e4m3fn codes [N, K] (the nn.Linear layout; fused qkv / gate_up are row
concatenations, as in the checkpoint) and `weight_scale` fp32 [N], produced by `rlfp8.kernels.quantize_weight`
— the trainer's quantizer, so engine and trainer hold bit-identical codes.

Loading follows vLLM's online FP8: the 16-bit weight is registered on the meta device and vLLM's layerwise
loader materialises one layer at a time, so no full 16-bit copy of the model is ever resident.

Without a LoRA adapter the layer's `apply` runs the base GEMM (K2 without epilogue); with LoRA enabled the
plugin's LoRA layers (lora_layers.py) take over `apply` and run K1 + K2 with the adapters in the epilogue.
Inside vLLM's forward the base GEMM is one opaque custom op (`torch.ops.vllm.rlfp8_linear`, the layer looked up
by name in the forward context as lora_layers.py does), so vLLM's torch.compile (fullgraph) never traces the
kernels' host code; under compile the W8A8 layers quantize x in the graph first (knob engine_graph_quant) and
pass the codes to the op.
"""
from __future__ import annotations

from typing import Any

import torch

from rlfp8.kernels import dispatch, fp8_lora_linear
from rlfp8.kernels.fp8_ref import quantize_activation_ref
from rlfp8.kernels.knobs import knobs

# quantization name -> kernel mode
MODES = {"rlfp8": "w8a16", "rlfp8_w8a8": "w8a8"}
# engine.precision -> quantization name (bf16 and w8a8_vllm are not ours: see engine.py)
PRECISION_TO_QUANTIZATION = {"w8a16": "rlfp8", "w8a8": "rlfp8_w8a8"}


def make_classes():
    """Build the vLLM classes (imports vLLM; called by the plugin's register())."""
    from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
    from vllm.model_executor.model_loader.reload.layerwise import initialize_online_processing
    from vllm.model_executor.parameter import ModelWeightParameter
    from vllm.model_executor.utils import replace_parameter

    class RLFP8LinearMethod(LinearMethodBase):
        uses_meta_device = True             # vLLM's layerwise loader materialises one layer at a time

        def __init__(self, mode: str):
            self.mode = mode

        def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                           output_size, params_dtype, **extra_weight_attrs):
            layer.logical_widths = output_partition_sizes
            layer.input_size_per_partition = input_size_per_partition
            layer.output_size_per_partition = sum(output_partition_sizes)
            layer.orig_dtype = params_dtype
            weight = ModelWeightParameter(
                data=torch.empty(layer.output_size_per_partition, input_size_per_partition, device="meta",
                                 dtype=params_dtype),
                input_dim=1, output_dim=0, weight_loader=extra_weight_attrs.get("weight_loader"))
            layer.register_parameter("weight", weight)
            initialize_online_processing(layer)
            _register_in_forward_context(layer, self.mode)

        def process_weights_after_loading(self, layer) -> None:
            if getattr(layer, "_rlfp8_quantized", False):
                return
            from rlfp8.kernels import quantize_weight
            if layer.weight.is_meta:      # load_format="dummy" in a vLLM whose dummy loader skips meta weights
                _dummy_weight(layer)
            q, scale = quantize_weight(layer.weight.data)
            replace_parameter(layer, "weight", q)                 # [N, K] e4m3, row-major
            replace_parameter(layer, "weight_scale", scale)       # [N] fp32
            layer._rlfp8_quantized = True

        def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            return apply_base(layer, x, self.mode, bias)

    class RLFP8Config(QuantizationConfig):
        mode = "w8a16"
        name = "rlfp8"

        def get_name(self):
            return self.name

        def get_supported_act_dtypes(self) -> list[torch.dtype]:
            return [torch.bfloat16, torch.float16, torch.float32]

        @classmethod
        def get_min_capability(cls) -> int:
            return 89 if cls.mode == "w8a8" else 80

        @staticmethod
        def get_config_filenames() -> list[str]:
            return []                            # a bf16 checkpoint: vLLM calls cls() without a config file

        @classmethod
        def from_config(cls, config: dict[str, Any]):
            return cls()

        def get_quant_method(self, layer, prefix: str):
            if isinstance(layer, LinearBase):
                return RLFP8LinearMethod(self.mode)
            return None                          # embeddings, lm_head, attention: unquantized

    class RLFP8W8A8Config(RLFP8Config):
        mode = "w8a8"
        name = "rlfp8_w8a8"

    return RLFP8LinearMethod, {"rlfp8": RLFP8Config, "rlfp8_w8a8": RLFP8W8A8Config}


BASE_OP = "rlfp8_linear"


def graph_quant_enabled(mode: str) -> bool:
    """Whether a layer of this mode quantizes x in the compiled graph (knob engine_graph_quant): read when the
    layer is built, since a knobs() call inside a traced forward would be traced too."""
    return mode == "w8a8" and knobs().engine_graph_quant


def graph_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (codes, scales [T, 1]) by the reference formula (fp8_ref.quantize_activation_ref, rounding
    "div", the engine's), written in torch ops so that the compiled graph fuses it into x's producer."""
    if x.element_size() == 2:
        # Inductor fuses this into x's producer (a norm, an activation), computed in fp32, and may skip the
        # producer's cast to bf16 on the fused path; a bitcast asks for x's bf16 bits first. The codes can still
        # quantize a value one bf16 ulp from the op's x (measured on an H100: tests/compiled_engines.py).
        x = x.view(torch.int16).view(x.dtype)
    return quantize_activation_ref(x, "div")


def graph_codes(enabled: bool, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The codes an op takes beside x: made in the graph while torch.compile traces a layer with graph
    quantization enabled, else (None, None) and the op quantizes x itself (eager, decode graphs, W8A16)."""
    if enabled and x.dim() == 2 and torch.compiler.is_compiling():
        return graph_quantize(x)
    return None, None


def _register_in_forward_context(layer, mode: str) -> None:
    """Name the layer in vLLM's static forward context (where the op finds it), when a vLLM config is being built
    (model loading); elsewhere the layer keeps the direct call."""
    try:
        from vllm.config import get_current_vllm_config_or_none
        config = get_current_vllm_config_or_none()
    except ImportError:                      # a vLLM without it: the config vLLM builds the model under
        from vllm.config import get_current_vllm_config
        config = get_current_vllm_config()
    prefix = getattr(layer, "prefix", "")
    if config is None or not prefix:
        return
    ctx = config.compilation_config.static_forward_context
    name = f"{prefix}.{BASE_OP}"
    if ctx.get(name, layer) is not layer:          # the same layer again (weights re-created) is fine
        raise ValueError(f"rlfp8: duplicate linear layer name {name}")
    ctx[name] = layer
    layer.rlfp8_linear_name = name
    layer.rlfp8_graph_quant = graph_quant_enabled(mode)


def apply_base(layer, x: torch.Tensor, mode: str, bias: torch.Tensor | None) -> torch.Tensor:
    """The base projection (no LoRA layer around it): through the opaque op inside vLLM's forward, else direct."""
    from vllm.forward_context import is_forward_context_available
    name = getattr(layer, "rlfp8_linear_name", None)
    if name is None or not is_forward_context_available():
        return project(x, layer, mode, bias=bias)
    x_q, x_scale = graph_codes(layer.rlfp8_graph_quant, x)
    return torch.ops.vllm.rlfp8_linear(x, x_q, x_scale, bias, name, layer.output_size_per_partition)


def _base_op(x: torch.Tensor, x_q: torch.Tensor | None, x_scale: torch.Tensor | None, bias: torch.Tensor | None,
             layer_name: str, out_features: int) -> torch.Tensor:
    from vllm.forward_context import get_forward_context
    layer = get_forward_context().no_compile_layers[layer_name]
    return project(x, layer, layer.quant_method.mode, bias=bias, x_quant=None if x_q is None else (x_q, x_scale))


def _base_op_fake(x: torch.Tensor, x_q: torch.Tensor | None, x_scale: torch.Tensor | None,
                  bias: torch.Tensor | None, layer_name: str, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def register_ops() -> None:
    from vllm.utils.torch_utils import direct_register_custom_op
    if not hasattr(torch.ops.vllm, BASE_OP):
        direct_register_custom_op(op_name=BASE_OP, op_func=_base_op, fake_impl=_base_op_fake)


def _dummy_weight(layer) -> None:
    """vLLM's dummy values (uniform(-1e-3, 1e-3)) for a weight still on the meta device, on this worker's device."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    w = torch.empty(layer.weight.shape, dtype=layer.orig_dtype, device=device).uniform_(-1e-3, 1e-3)
    layer.weight = torch.nn.Parameter(w, requires_grad=False)


def project(x: torch.Tensor, layer, mode: str, *, A=None, B=None, meta=None, g=None, bias=None,
            x_quant=None) -> torch.Tensor:
    """One engine projection on the layer's FP8 codes: rlfp8.kernels.fp8_lora_linear (K1 + K2), Triton on CUDA,
    the torch references on the CPU; the dispatch records which path ran (engine.kernel_report()). x_quant: W8A8
    codes and scales made by the caller's compiled graph (lora_layers.py), else the op quantizes x itself."""
    flat = x.dim() == 2                 # vLLM's [T, K]: no reshapes (an aten call each)
    x2 = x if flat else x.reshape(-1, x.shape[-1])
    dispatch.record("engine.projection", mode)
    y = fp8_lora_linear(x2, layer.weight, layer.weight_scale, A, B, meta, mode=mode, g=g, bias=bias,
                        out_dtype=x.dtype if x.dtype != torch.float8_e4m3fn else torch.bfloat16, x_quant=x_quant)
    return y if flat else y.reshape(*x.shape[:-1], y.shape[-1])
