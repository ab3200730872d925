"""Kernel tier: every Triton kernel under the CPU interpreter (with tests/triton_interp_patch.py) at
small shapes against its torch reference, plus the sm_90a compile check (test_compile_sm90.py).
tests/conftest.py has already set TRITON_INTERPRET=1 when there is no GPU."""
import os

import pytest

from tests.conftest import HAS_CUDA

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests import triton_interp_patch
    triton_interp_patch.apply()


@pytest.fixture
def device():
    return "cuda" if HAS_CUDA else "cpu"
