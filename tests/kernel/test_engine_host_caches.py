"""The engine projection's per-process caches answer as the uncached code would: meta_args' form per LoRAKernelMeta
class, the adapters' 3-D views per layer, K1's config per key, the PDL answer per (device, interpreter)."""
import types

import pytest
import torch

from rlfp8.kernels import build_lora_meta, dispatch, knobs
from rlfp8.kernels.shrink_triton import _pick_shrink_config, invariant_shrink_config, shrink_config
from rlfp8.rollout.lora_layers import adapter_views
from rlfp8.rollout.vllm_lora_meta import lora_meta_from_vllm


class _Meta7:
    def __init__(self, slots, max_loras):
        self.m = build_lora_meta(slots, max_loras)
        self.default = torch.tensor([max_loras + 1], dtype=torch.int32)

    def meta_args(self, token_nums, specialize_active_lora):
        m = self.m
        return (m.token_lora_mapping[:token_nums], m.token_indices_sorted_by_lora_ids[:token_nums],
                m.num_tokens_per_lora, m.lora_token_start_loc, m.active_lora_ids, m.no_lora_flag_cpu,
                m.num_active_loras_cpu if specialize_active_lora else self.default)


class _Meta6(_Meta7):
    def meta_args(self, token_nums):
        return super().meta_args(token_nums, True)[:6]


def test_meta_args_form_is_per_class():
    slots = torch.tensor([0, 0, -1, 1])
    for _ in range(2):                                  # the second round answers from the cache
        for cls in (_Meta7, _Meta6, _Meta7):
            for max_loras in (2, 5):
                view = lora_meta_from_vllm(cls(slots, max_loras), 4, specialize_active_lora=True)
                assert view.num_active == (3 if cls is _Meta7 else max_loras + 1), (cls, max_loras)
                assert view.num_tokens == 4 and not view.no_lora
        assert lora_meta_from_vllm(_Meta7(slots, 5), 4, specialize_active_lora=False).num_active == 6


def test_adapter_views_follow_the_layer_stacks():
    layer = types.SimpleNamespace(lora_a_stacked=(torch.randn(2, 1, 4, 8), torch.randn(2, 1, 4, 8)),
                                  lora_b_stacked=(torch.randn(2, 1, 6, 4),))
    A, B = adapter_views(layer)
    assert [tuple(a.shape) for a in A] == [(2, 4, 8)] * 2 and tuple(B[0].shape) == (2, 6, 4)
    assert adapter_views(layer)[0] is A                                  # cached: the same view objects
    layer.lora_a_stacked[1][1, 0].fill_(3.0)                             # an in-place slot write shows
    assert torch.equal(A[1][1], torch.full((4, 8), 3.0))
    layer.lora_b_stacked = (torch.randn(2, 1, 10, 4),)                   # a replaced stack: new views
    A2, B2 = adapter_views(layer)
    assert tuple(B2[0].shape) == (2, 10, 4) and B2[0].data_ptr() == layer.lora_b_stacked[0].data_ptr()
    with pytest.raises(ValueError, match=r"lora_b_stacked\[0\] must be \[S, 1, a, b\]"):
        layer.lora_b_stacked = (torch.randn(2, 3, 10, 4),)
        adapter_views(layer)


def test_shrink_config_cache_follows_token_count_and_knob():
    saved = knobs.set_knobs(batch_invariant="off")
    try:
        for M in (4, 64, 300, 4, 64, 300):
            assert _pick_shrink_config(None, M, 4096, 64, "w8a16") == shrink_config(M, 4096, 64)
        assert shrink_config(4, 4096, 64) != shrink_config(300, 4096, 64)
        knobs.set_knobs(batch_invariant="auto")                     # W8A16: invariant; W8A8: per token count
        assert _pick_shrink_config(None, 300, 4096, 64, "w8a16") == invariant_shrink_config(4096, 64)
        assert _pick_shrink_config(None, 300, 4096, 64, "w8a8") == shrink_config(300, 4096, 64)
        assert _pick_shrink_config(None, 300, 1024, 16, "w8a16") == invariant_shrink_config(1024, 16)
    finally:
        knobs.restore_knobs(saved)


def test_pdl_answer_is_per_device_and_interpreter(monkeypatch):
    dispatch.reset_pdl_cache()
    calls = []

    def counted(device):
        calls.append(device)
        return f"fake answer for {device}"
    monkeypatch.setattr(dispatch, "pdl_unavailable", counted)
    try:
        for _ in range(3):
            assert not dispatch.choose_launch("lora_gemm", torch.device("cpu"))
        assert calls == [torch.device("cpu")]                              # asked once
        monkeypatch.setattr(dispatch, "triton_interpreting", lambda: False)
        dispatch.choose_launch("lora_gemm", "cpu")
        assert len(calls) == 2                                             # another key: asked again
        knobs.set_knobs(pdl="off")                                         # the knob is read per call
        assert not dispatch.choose_launch("lora_gemm", torch.device("cpu")) and len(calls) == 2
    finally:
        knobs.set_knobs(pdl="auto")
        dispatch.reset_pdl_cache()
