"""Registers, spills and shared memory of the training linear's kernels at large LoRA rank, compiled for sm_90a
on the CPU (no GPU needed), with the configs an H200 picks (its tuned table through the knob tuned_gpu, the
batch-invariant schedule, fit_smem at the H200's shared-memory limit).

Launches per (N out, K in) of bench/dora.py, M = 4096 tokens, rank r (tests/kernel/sm90_compile_worker.
large_rank_launch, which the sm_90a compile test also compiles at ranks 384 and 512):
  fwd      K2 forward (no metadata: ALL_SLOT0), the LoRA training linear's
  fwd_g    K2 forward with DoRA's g
  dgrad    K2 dx GEMM on the transposed codes qᵀ, dh·A_c in the epilogue (A_cᵀ as its "B")
  shrink   K1 h = x·Aᵀ
  dy_prep  gy and dh = dy·B_c
  eng1 / engN   the engine's K2 with metadata at 256 tokens: one adapter (per-slot loop) / four (PIPE_SLOTS)
`chunk`: ranks per K2 epilogue chunk / per K1 program (the whole BLOCK_R for dy_prep). Regs and the spill stack
come from the cubin (cuobjdump -res-usage), spill stores/loads from `ptxas -v` on the same PTX, smem from the
compiled kernel's metadata. The H200's K2 may run the Gluon main loop instead (gemm_rs, ranks <= 512, DoRA's g
too; the `path` column says which the dispatch would take); the Triton K2 is compiled here anyway.

    python bench/lab/rank_spills.py                       # (from the repository root) table to stdout
    python bench/lab/rank_spills.py --ranks 384 --json /tmp/spills.json --roles fwd,dgrad
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"
os.environ.setdefault("RLFP8_TUNED_GPU", "NVIDIA H200")       # as tests/kernel/test_compile_sm90.py
sys.path.insert(0, os.getcwd())

from rlfp8.kernels import _triton_utils as tu  # noqa: E402
from rlfp8.kernels.gemm_configs import rank_chunk  # noqa: E402
from rlfp8.kernels.shrink_triton import shrink_rank_block  # noqa: E402
from tests.kernel.sm90_compile_worker import LARGE_RANK_ROLES, _cuda_tool, _sass_facts, large_rank_launch  # noqa: E402

SHAPES = {"8192x8192": (8192, 8192), "8192x28672": (8192, 28672)}     # bench/dora.py: (N out, K in)


def collect(shapes, ranks, roles, M: int = 4096) -> list:
    items = []
    for shape in shapes:
        N, K = SHAPES[shape]
        for r in ranks:
            for role in roles:
                with tu.collect_launches() as rec:
                    path = large_rank_launch(role, N, K, r, M)
                for kern, _grid, args, kw in rec:
                    items.append(dict(role=role, shape=shape, r=r, path=path, spec=tu.jit_spec(kern, args, kw),
                                      arg_names=kern.arg_names))
    return items


def _spills_from_ptxas(ptx: str) -> dict:
    """ptxas -v on the kernel's PTX: registers and spill store/load bytes (Triton's own ptxas, sm_90a)."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([_cuda_tool("ptxas"), "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
    text = log.stdout + log.stderr
    st = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return dict(spill_st=int(st.group(1)), spill_ld=int(st.group(2))) if st else {}


def measure(item: dict) -> dict:
    spec = item["spec"]
    k = tu.compile_spec(spec)
    facts = _sass_facts(k.asm["cubin"], 0)
    named = {item["arg_names"][i[0]]: v for i, v in spec["constexprs"].items()}
    return dict(role=item["role"], shape=item["shape"], r=item["r"], path=item["path"], kernel=spec["name"],
                regs=facts.get("regs"), stack=facts.get("stack"), smem=k.metadata.shared,
                num_warps=spec["options"]["num_warps"], num_stages=spec["options"]["num_stages"],
                **_spills_from_ptxas(k.asm["ptx"]),
                chunk=_rank_chunk_of(spec["name"], named.get("BLOCK_R")),
                **{c: named.get(c) for c in ("BLOCK_N", "BLOCK_M", "BLOCK_T", "BLOCK_K", "SPLIT_K", "BLOCK_R",
                                             "PIPE_SLOTS")})


def _rank_chunk_of(kernel: str, block_r_: int | None) -> int | None:
    """Ranks per epilogue chunk (K2) / per program (K1); the whole BLOCK_R for dy_prep."""
    if block_r_ is None:
        return None
    if kernel == "_lora_gemm_kernel":
        return rank_chunk(block_r_)
    return shrink_rank_block(block_r_) if kernel == "_lora_shrink_kernel" else block_r_


def _tile(row: dict) -> str:
    dims = "x".join(str(row[c]) for c in ("BLOCK_N", "BLOCK_M", "BLOCK_T", "BLOCK_K") if row.get(c) is not None)
    split = f" sk{row['SPLIT_K']}" if row.get("SPLIT_K") not in (None, 1) else ""
    return f"{dims}{split} w{row['num_warps']} s{row['num_stages']}"


def print_table(rows: list) -> None:
    print(f"{'role':8s} {'shape':11s} {'r':>4s} {'path':8s} {'config':26s} {'BR':>4s} {'chunk':>5s} "
          f"{'regs':>4s} {'stack':>5s} {'spill st/ld':>13s} {'smem':>7s}")
    for x in rows:
        chunk = x.get("chunk") or "-"
        spill = f"{x.get('spill_st', '?')}/{x.get('spill_ld', '?')}"
        print(f"{x['role']:8s} {x['shape']:11s} {x['r']:4d} {x['path']:8s} {_tile(x):26s} {x['BLOCK_R'] or '-':>4} "
              f"{chunk:>5} {x['regs']:4d} {x['stack']:5d} {spill:>13s} {x['smem']:7d}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="64,384,512")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--roles", default=",".join(LARGE_RANK_ROLES))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    items = collect(a.shapes.split(","), [int(r) for r in a.ranks.split(",")], a.roles.split(","), a.tokens)
    with ProcessPoolExecutor(max_workers=a.jobs) as pool:
        rows = list(pool.map(measure, items))
    print_table(rows)
    if a.json:
        import triton
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(a.json, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "target": "sm_90a, compiled on this CPU (Triton's ptxas)",
                       "triton": triton.__version__, "commit": commit, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
