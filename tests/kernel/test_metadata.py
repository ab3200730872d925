"""Adapter-sorted segment metadata: hand values, and identical to vLLM's LoRAKernelMeta when importable."""
import pytest
import torch

from rlfp8.kernels.metadata import build_lora_meta
from rlfp8.rollout.vllm_lora_meta import lora_meta_from_vllm


def test_hand_example():
    slots = torch.tensor([2, -1, 0, 2, 0, -1, 2])
    m = build_lora_meta(slots, max_loras=3)
    assert m.token_lora_mapping.dtype == torch.int32
    assert m.token_indices_sorted_by_lora_ids.tolist() == [1, 5, 2, 4, 0, 3, 6]
    assert m.active_lora_ids.tolist() == [-1, 0, 2, -1]
    assert m.num_tokens_per_lora.tolist() == [2, 2, 3, 0]
    assert m.lora_token_start_loc.tolist() == [0, 2, 4, 7, 0]
    assert not m.no_lora and m.num_active == 3 and m.max_loras == 3 and m.num_tokens == 7


def test_no_lora_and_bad_ids():
    m = build_lora_meta(torch.full((5,), -1), 4)
    assert m.no_lora and m.num_active == 0
    with pytest.raises(ValueError, match=r"slot ids must lie in \[-1, 3\]"):
        build_lora_meta(torch.tensor([0, 4]), 4)
    with pytest.raises(ValueError, match="1-D integer"):
        build_lora_meta(torch.zeros(2, 2, dtype=torch.long), 4)


def test_same_as_vllm_and_views_without_copies():
    vmeta = pytest.importorskip("vllm.lora.ops.triton_ops.lora_kernel_metadata",
                                reason="vLLM is not importable here")
    import inspect
    for trial in range(3):
        T, L = 40, 5
        slots = torch.randint(-1, L, (T,))
        if trial == 1:
            slots[:] = 3
        ours = build_lora_meta(slots, L)
        make = vmeta.LoRAKernelMeta.make
        vm = make(L, 64, "cpu") if len(inspect.signature(make).parameters) == 3 else make(L, 64, "cpu", None)
        vm.prepare_tensors(slots)
        view = lora_meta_from_vllm(vm, T)
        for f in ("token_lora_mapping", "token_indices_sorted_by_lora_ids", "active_lora_ids",
                  "num_tokens_per_lora", "lora_token_start_loc", "no_lora_flag_cpu"):
            assert torch.equal(getattr(ours, f), getattr(view, f)), f
        assert view.token_lora_mapping.data_ptr() == vm.token_lora_mapping.data_ptr()     # a view, no copy
        assert view.num_active >= ours.num_active
