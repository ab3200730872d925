"""GPU tier for the training linear's host fast paths (kernel knob host_fast; marked gpu): on an H200 the fast
path (cached adapter casts, side stream only for long dx GEMMs, cached K2 configs, K1's h unfilled) gives
the plain path's bits for outputs and gradients, at a quickstart shape (main stream) and a Qwen3-8B shape
(side stream); dispatch records which stream the LoRA gradients ran on."""
from __future__ import annotations

import copy

import pytest
import torch

from rlfp8.kernels import dispatch, linear_triton
from rlfp8.kernels.knobs import restore_knobs, set_knobs
from tests.kernel.test_host_fast import _module, _train_two_micro_batches

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T,K,N,r", [(2048, 576, 1536, 16), (8192, 4096, 4096, 64)])
def test_host_fast_gives_the_plain_paths_bits_on_gpu(T, K, N, r):
    base = _module(K, N, r, device="cuda")
    xs = [torch.randn(T, K, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    dys = [torch.randn(T, N, dtype=torch.bfloat16, device="cuda") * 0.01 for _ in range(2)]
    arms, streams = {}, {}
    for fast in (True, False):
        saved = set_knobs(host_fast=fast)
        dispatch.reset_report()
        try:
            with dispatch.use_backend("triton"):
                arms[fast] = _train_two_micro_batches(copy.deepcopy(base), xs, dys)
            torch.cuda.synchronize()
        finally:
            restore_knobs(saved)
        streams[fast] = dispatch.report()["lora_linear.grad_stream"]
    for step in range(2):
        for name, a, b in zip(("probe", "y", "dx", "dA", "dB"), arms[True][step], arms[False][step]):
            assert torch.equal(a, b), (step, name)
    long_dx = 2 * T * N * K >= linear_triton.SIDE_STREAM_MIN_FLOP
    assert streams[True] == {"side" if long_dx else "main": 2}
    assert streams[False] == {"side": 2}
