"""Run without TRITON_INTERPRET (real JITFunctions, no GPU): the launch cache's argument order equals the
one Triton's binder produces for sm_90, and launches with equal cache keys have equal Triton
specializations and options (tests/kernel/test_host_fast.py runs this in a subprocess)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

from rlfp8.kernels import _triton_utils as tu
from rlfp8.kernels.linear_triton import lora_linear_triton


def records(T: int):
    x = torch.randn(T, 96, dtype=torch.bfloat16, requires_grad=True)
    q = torch.zeros(80, 96).to(torch.float8_e4m3fn)
    A = torch.randn(8, 96, requires_grad=True)
    B = torch.randn(80, 8, requires_grad=True)
    with tu.collect_launches() as rec:
        y = lora_linear_triton(x, q, torch.ones(80), A, B, 0.5)
        y.backward(torch.ones_like(y))
    return rec


def main() -> None:
    backend = make_backend(GPUTarget("cuda", 90, 32))
    by_key, checked = {}, 0
    for T in (96, 112, 37):               # 96 and 112: the same specialization; 37 another
        for kern, _grid, args, kw in records(T):
            binder = create_function_from_signature(kern.signature, kern.params, backend)
            bound, spec, options = binder(*args, **kw)
            rest = tu._rest_params(kern, len(args), kw)
            mine = tu._bound_args(args, kw, rest)
            assert len(mine) == len(bound), (kern.fn.__name__, len(mine), len(bound))
            for a, b in zip(mine, bound.values()):
                assert a is b or a == b, (kern.fn.__name__, a, b)
            key = tu._launch_key(kern, args, kw)
            assert key is not None, kern.fn.__name__
            seen = by_key.setdefault(key, (repr(spec), repr(options)))
            assert seen == (repr(spec), repr(options)), kern.fn.__name__
            checked += 1
    assert len(by_key) < checked              # some launches shared a key (the check above compared them)
    print(f"ok {checked} launches, {len(by_key)} keys")


if __name__ == "__main__":
    main()
