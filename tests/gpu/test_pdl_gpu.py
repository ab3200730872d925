"""GPU tier (marked gpu) for issue 15: the engine projection (fp8_lora_linear) with K2 launched as K1's
programmatic dependent (kernel knob pdl=on) gives the same bits as plain stream order (pdl=off), both modes
(W8A8 with x quantized before K1 and with K1's quantization: knob pdl_w8a8_quant),
M in {1, 8, 64, 512}, Qwen3-8B qkv (3 slices) and down (K = 12288) shapes, one rank-64 adapter with tokens
without adapter beside it; also replayed from CUDA graphs (100 replays, every one bit-identical).
    python -m pytest tests/gpu/test_pdl_gpu.py -m gpu -v -s
"""
from __future__ import annotations

import os

import pytest
import torch

from rlfp8.kernels import _triton_utils as tu
from rlfp8.kernels import dispatch, fp8
from rlfp8.kernels.knobs import restore_knobs, set_knobs
from rlfp8.kernels.metadata import build_lora_meta
from rlfp8.kernels.projection import fp8_lora_linear

pytestmark = pytest.mark.gpu

SHAPES = {"qkv": (4096, (4096, 1024, 1024)), "down": (12288, (4096,))}
MS = (1, 8, 64, 512)
MODES = ("w8a16", "w8a8", "w8a8_fused")        # w8a8: knob pdl_w8a8_quant=separate (default); _fused: K1 quantizes
DEV = "cuda"


def _problem(shape, M, r=64, seed=0):
    K, widths = SHAPES[shape]
    g = torch.Generator(device=DEV).manual_seed(seed)
    q, sw = fp8.quantize_weight_ref(torch.randn(sum(widths), K, device=DEV, generator=g) * 0.02)
    x = torch.randn(M, K, device=DEV, generator=g).to(torch.bfloat16)
    A = [(torch.randn(1, r, K, device=DEV, generator=g) * 0.02).to(torch.bfloat16) for _ in widths]
    B = [(torch.randn(1, n, r, device=DEV, generator=g) * 0.05).to(torch.bfloat16) for n in widths]
    slots = torch.zeros(M, dtype=torch.long, device=DEV)
    slots[1::3] = -1                                          # tokens without adapter beside the adapter's
    return x, q, sw, A, B, build_lora_meta(slots, 1)


def projection_with(knob_values: dict, mode, x, q, sw, A, B, meta):
    """fp8_lora_linear under the given kernel knobs (restored afterwards)."""
    saved = set_knobs(**knob_values)
    try:
        return fp8_lora_linear(x, q, sw, A, B, meta, mode=mode)
    finally:
        restore_knobs(saved)


def require_sm90(why: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip(why)


def _run(pdl, mode, *problem):
    mode, _, fused = mode.partition("_")              # K1 in its own launch (knob k1_in_k2 off)
    return projection_with(dict(pdl=pdl, pdl_w8a8_quant=fused or "separate", k1_in_k2="off"), mode, *problem)


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    """Compile every kernel of the module's cases in parallel first (the launches are captured, not run)."""
    require_sm90("PDL needs sm_90+")
    with tu.collect_launches() as rec:
        for shape in SHAPES:
            for M in MS:
                p = _problem(shape, M)
                for mode in MODES:
                    for pdl in ("on", "off"):
                        _run(pdl, mode, *p)
    info = tu.precompile(rec, jobs=min(16, os.cpu_count() or 4))
    print(f"\n[precompile] {info['kernels']} kernels in {info['seconds']} s, errors: {info['errors']}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_pdl_and_stream_order_give_the_same_bits(shape, M, mode):
    p = _problem(shape, M)
    dispatch.reset_report()
    y_stream = _run("off", mode, *p)
    y_pdl = _run("on", mode, *p)
    torch.cuda.synchronize()
    assert dispatch.report()["lora_gemm.launch"] == {"stream": 1, "pdl": 1}
    assert y_pdl.abs().sum() > 0 and torch.equal(y_pdl, y_stream)
    for _ in range(20):                                       # repeated launches: no race shows up
        assert torch.equal(_run("on", mode, *p), y_stream)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("M", (1, 64))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_pdl_inside_cuda_graphs(shape, M, mode):
    """Captured as vLLM captures its decode graphs: K1 -> K2 (PDL) replayed, each replay bit-identical to the
    eager stream-ordered result, with the input refreshed in place between replays as the engine does."""
    x, q, sw, A, B, meta = _problem(shape, M)
    x2 = torch.randn_like(x)
    refs = [_run("off", mode, xi, q, sw, A, B, meta) for xi in (x, x2)]
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run("on", mode, static_x, q, sw, A, B, meta)         # warm-up outside the graph (counters, caches)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    mode, _, fused = mode.partition("_")
    saved = set_knobs(pdl="on", pdl_w8a8_quant=fused or "separate", k1_in_k2="off")
    try:
        with torch.cuda.graph(graph):
            y = fp8_lora_linear(static_x, q, sw, A, B, meta, mode=mode)
    finally:
        restore_knobs(saved)
    for i in range(100):
        static_x.copy_((x, x2)[i % 2])
        y.zero_()
        graph.replay()
        assert torch.equal(y, refs[i % 2]), f"replay {i}"
