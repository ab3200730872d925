"""Adapter-sorted segment metadata for the multi-adapter kernels, laid out exactly like vLLM's
LoRAKernelMeta (vllm/lora/ops/triton_ops/lora_kernel_metadata.py), so the engine can hand vLLM's own
tensors to K1/K2 without copies (rlfp8.rollout.vllm_lora_meta.lora_meta_from_vllm).

From per-token slot ids (int, -1 = no adapter), for T tokens and max_loras slots:
  token_lora_mapping               [T]              int32  slot per token (-1 = none)
  token_indices_sorted_by_lora_ids [T]              int32  stable argsort of the mapping (-1 tokens first)
  active_lora_ids                  [max_loras + 1]  int32  sorted distinct ids present (-1 included when some
                                                           token has no adapter), padded with -1
  num_tokens_per_lora              [max_loras + 1]  int32  tokens of each active id, 0-padded
  lora_token_start_loc             [max_loras + 2]  int32  0, then the running sum of num_tokens_per_lora
  no_lora_flag_cpu                 [1] bool (CPU)          every token has -1
  num_active_loras_cpu             [1] int32 (CPU)         number of active ids (segments), -1 counted
As in vLLM, a kernel grid has one program column per segment (num_active); the -1 segment's shrink
programs exit at once, so those rows of h are never written.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class LoRAMeta:
    token_lora_mapping: torch.Tensor
    token_indices_sorted_by_lora_ids: torch.Tensor
    active_lora_ids: torch.Tensor
    num_tokens_per_lora: torch.Tensor
    lora_token_start_loc: torch.Tensor
    no_lora_flag_cpu: torch.Tensor
    num_active_loras_cpu: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.token_lora_mapping.shape[0]

    @property
    def max_loras(self) -> int:
        return self.active_lora_ids.shape[0] - 1

    @property
    def no_lora(self) -> bool:
        return bool(self.no_lora_flag_cpu.item())

    @property
    def num_active(self) -> int:
        """Grid size over segments (-1 segment included, as vLLM counts it)."""
        return int(self.num_active_loras_cpu.item())

    def tensors(self) -> tuple:
        """Every field, in declaration order (the per-call inputs of a launch plan)."""
        return tuple(getattr(self, f.name) for f in fields(self))

    def validate(self, op: str, M: int) -> None:
        if self.token_lora_mapping.shape[0] != M or self.token_indices_sorted_by_lora_ids.shape[0] != M:
            raise ValueError(
                f"rlfp8.kernels.{op}: metadata covers {self.token_lora_mapping.shape[0]} tokens "
                f"(token_indices_sorted_by_lora_ids {tuple(self.token_indices_sorted_by_lora_ids.shape)}) but x has "
                f"{M} rows")
        L = self.active_lora_ids.shape[0]
        if self.num_tokens_per_lora.shape[0] != L or self.lora_token_start_loc.shape[0] != L + 1:
            raise ValueError(
                f"rlfp8.kernels.{op}: inconsistent metadata: active_lora_ids {tuple(self.active_lora_ids.shape)}, "
                f"num_tokens_per_lora {tuple(self.num_tokens_per_lora.shape)}, "
                f"lora_token_start_loc {tuple(self.lora_token_start_loc.shape)}")


def build_lora_meta(slot_ids: torch.Tensor, max_loras: int) -> LoRAMeta:
    """slot ids [T] (any int dtype, -1 = no adapter, else 0 <= id < max_loras) -> LoRAMeta on their device.
    Same steps as vLLM's LoRAKernelMeta.prepare_tensors (it synchronizes: call it outside CUDA graphs)."""
    if not isinstance(slot_ids, torch.Tensor) or slot_ids.dim() != 1 or slot_ids.is_floating_point():
        raise ValueError(f"build_lora_meta: slot_ids must be a 1-D integer tensor, got "
                         f"{getattr(slot_ids, 'dtype', type(slot_ids))} {tuple(getattr(slot_ids, 'shape', ()))}")
    if max_loras < 1:
        raise ValueError(f"build_lora_meta: max_loras must be >= 1, got {max_loras}")
    dev = slot_ids.device
    T = slot_ids.shape[0]
    mapping = slot_ids.to(torch.int32)
    if T and (int(mapping.min()) < -1 or int(mapping.max()) >= max_loras):
        raise ValueError(f"build_lora_meta: slot ids must lie in [-1, {max_loras - 1}], got range "
                         f"[{int(mapping.min())}, {int(mapping.max())}] (slot_ids shape {tuple(slot_ids.shape)})")
    active = torch.full((max_loras + 1,), -1, dtype=torch.int32, device=dev)
    ntok = torch.zeros(max_loras + 1, dtype=torch.int32, device=dev)
    start = torch.zeros(max_loras + 2, dtype=torch.int32, device=dev)
    no_lora = bool(T == 0 or torch.all(mapping == -1))
    sorted_ids = torch.sort(mapping, stable=True).indices.to(torch.int32)
    n_active = 0
    if not no_lora:
        ids, counts = torch.unique(mapping, sorted=True, return_counts=True)
        n_active = ids.shape[0]
        active[:n_active] = ids.to(torch.int32)
        ntok[:n_active] = counts.to(torch.int32)
        start[1:n_active + 1] = torch.cumsum(counts, 0).to(torch.int32)
    return LoRAMeta(mapping, sorted_ids, active, ntok, start,
                    torch.tensor([no_lora], dtype=torch.bool),
                    torch.tensor([n_active], dtype=torch.int32))
