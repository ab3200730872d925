"""DoRA's norm pieces keep one fp32 sum per K tile after Triton's optimizer (sm_90a, no GPU needed).

The kernel sums each tile's product apart and adds the tiles (a chain of K / BLOCK_K additions, not K), but
Triton folds `acc + dot(a, b)` into `dot(a, b, acc)` — which puts the running sum over all of K back into the
dot (measured on the H200: 7x cuBLAS's fp32 error in the "ieee" precision). The interpreter does not run that
pass, so this test reads the compiled TTIR: no dot in the K loop may accumulate into the loop-carried sum."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CODE = """
import sys, torch
from rlfp8.kernels import _triton_utils as tu
from rlfp8.kernels.dora_triton import norm_pieces_triton
K = 8192
with tu.collect_launches() as rec:
    norm_pieces_triton(torch.empty(8192, K, dtype=torch.float8_e4m3fn), torch.empty(8192), torch.empty(384, K),
                       precision=sys.argv[1])
fn, grid, args, kwargs = rec[0][:4]
print(tu.compile_like_jit(fn, args, kwargs).asm["ttir"])
"""


@pytest.mark.parametrize("precision", ["ieee", "bf16x2"])
def test_no_dot_accumulates_into_the_running_sum(precision):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", CODE, precision], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    loop = re.search(r"scf\.for .*iter_args\((%[\w.]+) = ", p.stdout)
    assert loop, "no K loop with a loop-carried accumulator in the TTIR"
    running = loop.group(1)
    dots = re.findall(r"tt\.dot (%[\w.]+), (%[\w.]+), (%[\w.]+)", p.stdout)
    assert dots, "no tt.dot in the TTIR"
    folded = [d for d in dots if d[2] == running]
    assert not folded, f"{precision}: a dot accumulates into the running sum {running}: {folded}"
