"""GPU tier of the engine projection's launch plans (knob host_fast; marked gpu): on an H200, at a Qwen3-8B qkv
shape, replayed launches (PDL K1 -> K2 where an adapter is active) give the direct path's bits and dispatch counts
at decode and prefill token counts, replays are what decode calls run, and a plan replayed inside CUDA graph
capture records a graph whose replays give the direct path's output (a key first seen in capture runs direct)."""
from __future__ import annotations

import pytest
import torch

from rlfp8.kernels import dispatch, knobs
from rlfp8.rollout.lora_layers import run_projection
from tests.kernel.test_launch_plan import _direct, _layer, _plan_counts

pytestmark = pytest.mark.gpu

QKV = dict(K=4096, widths=(4096, 1024, 1024), S=1, r=64, device="cuda", max_tokens=1024)


def _counts_without_plans():
    return {op: paths for op, paths in dispatch.report().items() if op != "engine.host_plan"}


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
@pytest.mark.parametrize("active", [True, False])
@pytest.mark.parametrize("T", [16, 64, 600])
def test_replay_gives_the_direct_bits_on_gpu(mode, active, T):
    saved = knobs.set_knobs(backend="auto")
    try:
        layer = _layer(mode, **QKV)
        layer.punica_wrapper.token_mapping_meta.prepare(torch.zeros(T, dtype=torch.long) if active
                                                        else torch.full((T,), -1))
        x = torch.randn(T, QKV["K"], device="cuda").bfloat16()
        dispatch.reset_report()
        want = [_direct(layer, x) for _ in range(4)]
        direct_counts = _counts_without_plans()
        dispatch.reset_report()
        got = [run_projection(layer, x) for _ in range(4)]
        torch.cuda.synchronize()
        assert _counts_without_plans() == direct_counts
        assert all(torch.equal(y, want[0]) for y in got + want)
        if T <= 512:
            assert _plan_counts().get("replay", 0) >= 2, _plan_counts()
        if active:
            # W8A16 with K1 in K2's grid (knob k1_in_k2, <= 16 tokens) has no dependent launch; W8A8's grid is the
            # quantizer's dependent, K1's own launch K2's primary
            rep = dispatch.report()
            in_grid = mode == "w8a16" and rep.get("lora_gemm.k1") == {"in_k2": 4}
            assert rep["lora_gemm.launch"] == ({"stream": 4} if in_grid else {"pdl": 4}), rep
    finally:
        knobs.restore_knobs(saved)


def _graph_of(layer, static_x):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = run_projection(layer, static_x)
    return graph, static_y


def _replayed_output(graph, static_x, static_y, new_x):
    static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    return static_y


def test_plan_replayed_inside_cuda_graph_capture():
    saved = knobs.set_knobs(backend="auto")
    try:
        layer = _layer("w8a16", **QKV)
        meta = layer.punica_wrapper.token_mapping_meta
        meta.prepare(torch.zeros(64, dtype=torch.long))
        static_x = torch.randn(64, QKV["K"], device="cuda").bfloat16()
        for _ in range(3):
            run_projection(layer, static_x)                          # plan made outside capture
        torch.cuda.synchronize()
        replays = _plan_counts()["replay"]
        graph, static_y = _graph_of(layer, static_x)
        assert _plan_counts()["replay"] == replays + 1               # the capture replayed the plan
        new_x = torch.randn_like(static_x)
        assert torch.equal(_replayed_output(graph, static_x, static_y, new_x), _direct(layer, new_x))
        meta.prepare(torch.zeros(48, dtype=torch.long))              # a token count first seen in capture
        x48 = torch.randn(48, QKV["K"], device="cuda").bfloat16()
        graph48, y48 = _graph_of(layer, x48)
        assert _plan_counts().get("direct", 0) == 1                  # run direct, no plan made in the graph
        new48 = torch.randn_like(x48)
        assert torch.equal(_replayed_output(graph48, x48, y48, new48), _direct(layer, new48))
    finally:
        knobs.restore_knobs(saved)
