"""FP8DoRALinear: FP8LoRALinear plus PEFT's DoRA magnitude, and the one table of each adapter kind's
trainable tensors and their PEFT file keys (adapter_io and the optimizer read it; nothing else names them).

DoRA (rlfp8.kernels.dora): y = g ⊙ (x·Wᵀ + s·(x·Aᵀ)·Bᵀ) + bias, g = m / ‖W + s·B·A‖_row (detached). The
parameter `lora_magnitude_vector` m [N] fp32 starts, as in PEFT, at the row norm of the base weight: here of
the dequantized FP8 weight s_w ⊙ q, i.e. sqrt of the cached ‖W‖²_row (with B = 0 at init, g ≡ 1). With
trainer.weights=bf16 it is the fp32 row norm of the 16-bit weight (PEFT would round it to bf16 first, see
docs/dora.md trap 1; fp32 keeps g ≡ 1 at init).

The norm depends only on (A, B, s) and is detached, so it is computed once per optimizer step and cached
under (A._version, B._version): every micro-batch, log-prob pass and checkpoint recompute reuses it; an
optimizer step or load_adapter (in-place updates) bumps the versions and forces a recompute.
"""
from __future__ import annotations

import torch
from torch import nn

from rlfp8.kernels import dora as kdora

from .fp8_lora import FP8LoRALinear

ADAPTER_TYPES = ("lora", "dora")
# adapter kind -> (module attribute, PEFT file-key suffix after `base_model.model.<module path>.`)
ADAPTER_TENSORS: dict[str, tuple[tuple[str, str], ...]] = {
    "lora": (("lora_A", "lora_A.weight"), ("lora_B", "lora_B.weight")),
    "dora": (("lora_A", "lora_A.weight"), ("lora_B", "lora_B.weight"),
             ("lora_magnitude_vector", "lora_magnitude_vector")),
}


def adapter_type(module: nn.Module) -> str:
    return "dora" if isinstance(module, FP8DoRALinear) else "lora"


def trainable_params(module: nn.Module) -> dict[str, nn.Parameter]:
    """PEFT file-key suffix -> trainable Parameter of one adapted projection (LoRA or DoRA)."""
    return {key: getattr(module, attr) for attr, key in ADAPTER_TENSORS[adapter_type(module)]}


class FP8DoRALinear(FP8LoRALinear):
    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, use_rslora: bool = False,
                 weights: str = "fp8"):
        super().__init__(in_features, out_features, rank, alpha, use_rslora, weights)
        self.lora_magnitude_vector = nn.Parameter(torch.ones(out_features, dtype=torch.float32))   # m [N]
        self.register_buffer("weight_sq_norm", None, persistent=False)         # ‖W‖²_row [N] fp32 (fp8 base)
        self._norm_key = None
        self._norm = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, alpha: float, use_rslora: bool = False,
                    weights: str = "fp8", device: torch.device | str | None = None) -> "FP8DoRALinear":
        mod = super().from_linear(linear, rank, alpha, use_rslora, weights, device)
        mod.init_magnitude()
        return mod

    @torch.no_grad()
    def init_magnitude(self) -> None:
        """m = ‖W‖_row (PEFT's init with B = 0); for the FP8 base W = s_w ⊙ q, computed from the codes."""
        if self.weights == "fp8":
            self.weight_sq_norm = kdora.weight_sq_norm(self.qweight, self.weight_scale)
            m = self.weight_sq_norm.sqrt()
        else:
            m = torch.linalg.norm(self.weight.float(), dim=1)
        self.lora_magnitude_vector.copy_(m)

    def row_norm(self) -> torch.Tensor:
        """n = ‖W + s·B·A‖_row [N] fp32, detached, cached per (A, B) version (FP8 base only)."""
        A, B = self.lora_A, self.lora_B
        key = self.adapter_key(self.qweight.data_ptr())
        if self._norm_key != key:
            if self.weight_sq_norm is None or self.weight_sq_norm.device != self.qweight.device:
                self.weight_sq_norm = kdora.weight_sq_norm(self.qweight, self.weight_scale)
            self._norm = kdora.dora_row_norm(self.qweight, self.weight_scale, A, B, self.scaling,
                                             self.weight_sq_norm)
            self._norm_key = key
        return self._norm

    def column_scale(self) -> torch.Tensor:
        """g = m / n [N] fp32 (detached): what the engine's K2 epilogue applies for this projection."""
        with torch.no_grad():
            return kdora.column_scale_from_norm(self.lora_magnitude_vector, self.row_norm())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapter_enabled:
            return super().forward(x)                       # the base alone (reference policy)
        A, B, m = self.lora_A, self.lora_B, self.lora_magnitude_vector
        if self.weights == "fp8":
            return kdora.dora_linear(x, self.qweight, self.weight_scale, A, B, m, self.row_norm(), self.scaling,
                                     self.bias)
        return kdora.dense_dora_linear(x, self.weight, A, B, m, self.scaling, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", dora=True"

