"""GPU tier (marked gpu) for issue 15, knob k1_in_k2: K1's shrink programs as the first programs of K2's grid
give the same bits as K1 in its own launch (K2 its programmatic dependent), every Qwen3-8B projection shape, both
modes, M in {1, 4, 16, 64}, one rank-64 adapter with tokens without adapter beside it and four adapters at once;
repeated eagerly and replayed 100 times from a CUDA graph, every result bit-identical (the counter protocol
leaves no race and resets itself). Also knob k2_prefetch_epilogue: K2's epilogue loads ahead of the epilogue at
<= 16 tokens (before its main loop, after it, split) give the bits of the loads in it, K1 in K2's grid or in its
own launch, and beside a distributed split-K sum.
    python -m pytest tests/gpu/test_k1_in_k2_gpu.py -m gpu -v -s
"""
from __future__ import annotations

import os

import pytest
import torch

from rlfp8.kernels import _triton_utils as tu
from rlfp8.kernels import dispatch, fp8
from rlfp8.kernels.gemm_configs import GemmConfig
from rlfp8.kernels.gemm_triton import lora_gemm_triton
from rlfp8.kernels.knobs import K2_PREFETCH_EPILOGUE, restore_knobs, set_knobs
from rlfp8.kernels.metadata import build_lora_meta
from rlfp8.kernels.shrink_ref import lora_shrink_ref
from tests.gpu.test_pdl_gpu import projection_with, require_sm90

pytestmark = pytest.mark.gpu

SHAPES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (12288, 12288)),
          "down": (12288, (4096,))}
MS = (1, 4, 16, 64)
PREFETCH_MS = (1, 4, 16)                    # knob k2_prefetch_epilogue: K2 at <= 16 tokens
PREFETCH_PLACES = K2_PREFETCH_EPILOGUE[1:]     # every place but off
DIST_RED_SPLIT = GemmConfig(64, 32, 128, 2, 8, 4, 3)    # 16 tokens per program: the distributed split-K sum
MODES = ("w8a16", "w8a8")
DEV = "cuda"


def _problem(shape, M, adapters=1, r=64, seed=0):
    K, widths = SHAPES[shape]
    g = torch.Generator(device=DEV).manual_seed(seed)
    q, sw = fp8.quantize_weight_ref(torch.randn(sum(widths), K, device=DEV, generator=g) * 0.02)
    x = torch.randn(M, K, device=DEV, generator=g).to(torch.bfloat16)
    A = [(torch.randn(adapters, r, K, device=DEV, generator=g) * 0.02).to(torch.bfloat16) for _ in widths]
    B = [(torch.randn(adapters, n, r, device=DEV, generator=g) * 0.05).to(torch.bfloat16) for n in widths]
    slots = torch.arange(M, device=DEV) % adapters
    if M > 1:
        slots[1::3] = -1                                      # tokens without adapter beside the adapters'
    return x, q, sw, A, B, build_lora_meta(slots, adapters)


def _run(in_k2, mode, *problem, prefetch="before_loop"):
    return projection_with(dict(pdl="on", k1_in_k2="on" if in_k2 else "off", k1_in_k2_w8a16_tokens=64, k2_prefetch_epilogue=prefetch), mode,
                           *problem)


def _k2_split(prefetch, mode, x, q, sw, A, B, meta):
    """K2 alone with DIST_RED_SPLIT at 16 tokens, h from the torch shrink."""
    xq, xs = fp8.quantize_activation(x) if mode == "w8a8" else (x, None)
    h = lora_shrink_ref(x, A, meta).h
    saved = set_knobs(k2_prefetch_epilogue=prefetch)
    try:
        return lora_gemm_triton(xq, q, sw, x_scale=xs, h=h, B=B, meta=meta, config=DIST_RED_SPLIT)
    finally:
        restore_knobs(saved)


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    require_sm90("the decode path's kernels target sm_90+")
    with tu.collect_launches() as rec:
        for shape in SHAPES:
            for M in MS:
                for adapters in (1, 4):
                    p = _problem(shape, M, adapters)
                    for mode in MODES:
                        for in_k2 in (True, False):
                            _run(in_k2, mode, *p)
                            if M in PREFETCH_MS:
                                for where in ("off",) + PREFETCH_PLACES[1:]:
                                    _run(in_k2, mode, *p, prefetch=where)
        x, q, sw, A, B, meta = _problem("qkv", 16)
        for mode in MODES:
            for prefetch in ("off",) + PREFETCH_PLACES:
                for m in (meta, None):
                    _k2_split(prefetch, mode, x, q, sw, A, B, m)
    info = tu.precompile(rec, jobs=min(16, os.cpu_count() or 4))
    print(f"\n[precompile] {info['kernels']} kernels in {info['seconds']} s, errors: {info['errors']}")


@pytest.mark.parametrize("adapters", [1, 4])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_k1_in_k2_gives_k1s_own_launch_bits(shape, M, mode, adapters):
    p = _problem(shape, M, adapters)
    y_own = _run(False, mode, *p)
    dispatch.reset_report()
    y_in = _run(True, mode, *p)
    torch.cuda.synchronize()
    assert dispatch.report()["lora_gemm.k1"] == {"in_k2": 1}
    assert y_in.abs().sum() > 0 and torch.equal(y_in, y_own)
    for _ in range(20):
        assert torch.equal(_run(True, mode, *p), y_own)
    assert tu.split_counters("lora_gemm.k1_sync", 2, DEV)[:2].tolist() == [0, 0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("M", (1, 16))
@pytest.mark.parametrize("shape", ["qkv", "down"])
def test_k1_in_k2_inside_cuda_graphs(shape, M, mode):
    """Captured in a CUDA graph (as vLLM's decode graphs capture the projection) and replayed 100 times with new
    inputs copied in: every replay equals the eager own-launch result for that input."""
    p = list(_problem(shape, M))
    _run(True, mode, *p)                                      # warm-up outside the capture (counters, configs)
    x_static = p[0].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        y_static = _run(True, mode, x_static, *p[1:])
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.Generator(device=DEV).manual_seed(1)
    for i in range(100):
        x = torch.randn(x_static.shape, device=DEV, generator=g).to(torch.bfloat16) if i % 10 else p[0]
        x_static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_static, _run(False, mode, x, *p[1:])), f"replay {i}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("M", (1, 16))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_one_wave_stages_keep_the_bits(shape, M, mode):
    """Knob k1_in_k2_one_wave (fewer pipeline stages where K1's programs would push the grid into a second wave):
    the same bits as the tuned stages, and the dispatch says which it ran."""
    p = _problem(shape, M, adapters=4)
    knob = dict(pdl="on", k1_in_k2="on")
    y_tuned = projection_with(dict(knob, k1_in_k2_one_wave="off"), mode, *p)
    dispatch.reset_report()
    y_one = projection_with(dict(knob, k1_in_k2_one_wave="on"), mode, *p)
    torch.cuda.synchronize()
    wave = dispatch.report()["lora_gemm.k1_wave"]
    print(f"\n[one_wave] {shape} M={M} {mode}: {wave}")
    assert sum(wave.values()) == 1 and set(wave) <= {"one", "fewer_stages", "two"}
    assert y_one.abs().sum() > 0 and torch.equal(y_one, y_tuned)


@pytest.mark.parametrize("adapters", [1, 4])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("M", PREFETCH_MS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_prefetched_epilogue_gives_the_same_bits(shape, M, mode, adapters):
    """Knob k2_prefetch_epilogue: the engine projection (PDL; K1 in K2's grid and in its own launch) with K2's
    epilogue scales, slots and first B tile loaded before its main loop, after it, or split, equals the loads in
    the epilogue, bit for bit (one adapter: the per-slot epilogue takes the prefetched tile; four: the slot
    pipeline, scales and slots)."""
    p = _problem(shape, M, adapters)
    for in_k2 in (True, False):
        outs = {}
        for where in ("off",) + PREFETCH_PLACES:
            dispatch.reset_report()
            outs[where] = _run(in_k2, mode, *p, prefetch=where)
            assert dispatch.report()["lora_gemm.prefetch_epilogue"] == {where: 1}
        torch.cuda.synchronize()
        assert outs["off"].abs().sum() > 0, in_k2
        for where in PREFETCH_PLACES:
            assert torch.equal(outs[where], outs["off"]), (where, in_k2)
            for _ in range(5):
                assert torch.equal(_run(in_k2, mode, *p, prefetch=where), outs["off"]), (where, in_k2)


@pytest.mark.parametrize("mode", MODES)
def test_prefetched_epilogue_beside_a_distributed_split_k_sum(mode):
    """16 tokens in a 32-token tile split 2 ways: the distributed sum recomputes each program's rows after it, so
    s_x and the slots load there as before; s_w (and without metadata the B tile) ahead of the epilogue, at every
    place. The same bits as the knob off, with metadata and without."""
    require_sm90("the distributed split-K sum runs on the GPU")
    x, q, sw, A, B, meta = _problem("qkv", 16)
    for m in (meta, None):
        outs = {}
        for where in ("off",) + PREFETCH_PLACES:
            dispatch.reset_report()
            outs[where] = _k2_split(where, mode, x, q, sw, A, B, m)
            rep = dispatch.report()
            assert rep["lora_gemm.split_k"] == {"distributed": 1}
            assert rep["lora_gemm.prefetch_epilogue"] == {where: 1}
        torch.cuda.synchronize()
        assert outs["off"].abs().sum() > 0, m is None
        for where in PREFETCH_PLACES:
            assert torch.equal(outs[where], outs["off"]), (where, m is None)
