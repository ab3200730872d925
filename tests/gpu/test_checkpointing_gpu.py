"""GPU tier of trainer.gradient_checkpointing=auto (marked gpu; < 1 min on an H200): on the trainer's Triton kernels
and flash attention, what measure_saved_bytes reports is what the CUDA allocator holds after a grad-enabled forward
of another batch shape, and an update with some layers checkpointed equals the one with none.
    python -m pytest tests/gpu/test_checkpointing_gpu.py -m gpu -v -s
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from rlfp8.config import compose_dict
from rlfp8.trainer import checkpointing as ck
from rlfp8.trainer.core import PolicyTrainer
from rlfp8.trainer.hf_models import resolve_model
from tests.unit.test_checkpointing import _batch, _grads

pytestmark = pytest.mark.gpu
ARCH = f"random:{Path(__file__).resolve().parents[1] / 'data' / 'qwen3_gpu_small.json'}"


def _trainer(tmp_path, gc):
    cfg = compose_dict([f"model.path={ARCH}", "model.dtype=bfloat16", "adapter.rank=16", "trainer.device=cuda",
                        f"trainer.gradient_checkpointing={gc}", "algo.max_response_len=12"])
    return PolicyTrainer(str(resolve_model(cfg["model"]["path"], tmp_path / "m")), cfg)


def test_measured_bytes_are_what_the_allocator_holds(tmp_path):
    tr = _trainer(tmp_path, "auto")
    layers, c = tr.checkpointing.layers, tr.model.config
    saved = ck.measure_saved_bytes(tr.model, layers, tr.device, c.vocab_size, c.hidden_size, tr.dtype)
    rows, length = 2, 384
    ids = torch.randint(0, c.vocab_size, (rows, length), device="cuda")
    ck.set_checkpointed(layers, 0)
    body = tr.model.get_decoder()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    hidden = body(input_ids=ids, use_cache=False).last_hidden_state
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - hidden.numel() * hidden.element_size()
    predicted = len(layers) * saved.kept(rows, length)
    print(f"saved per token and layer {saved.per_token / 1024:.1f} KiB (+{saved.per_token_sq:.2f} B x length); "
          f"allocator {held / 2**20:.1f} MiB, predicted {predicted / 2**20:.1f} MiB")
    assert held == pytest.approx(predicted, rel=0.15)


def test_partly_checkpointed_update_equals_none_checkpointed(tmp_path, monkeypatch):
    ref = _trainer(tmp_path, False)
    with torch.no_grad():
        for p in ref.params:
            if p.shape[-1] == 16:
                p.normal_(0, 0.05)
    state = copy.deepcopy([p.detach() for p in ref.params])
    g_ref, m_ref = _grads(ref, _batch())
    tr = _trainer(tmp_path, "auto")
    with torch.no_grad():
        for p, s in zip(tr.params, state):
            p.copy_(s)
    monkeypatch.setattr(ck, "free_bytes", lambda device: 0.0)         # nothing free: every layer checkpointed
    g, m = _grads(tr, _batch())
    assert m["train/checkpointed_layers"] == len(tr.checkpointing.layers)
    for a, b in zip(g, g_ref):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-6)
    assert m["train/loss"] == pytest.approx(m_ref["train/loss"], rel=1e-4)
