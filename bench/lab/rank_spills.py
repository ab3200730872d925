"""Registers, spills and shared memory of the training linear's kernels at large LoRA rank, compiled for sm_90a
on the CPU (no GPU needed), with the configs an H200 picks (its tuned table through the knob tuned_gpu, the
batch-invariant schedule, fit_smem at the H200's shared-memory limit).

Launches per (N out, K in) of bench/dora.py, M = 4096 tokens, rank r:
  fwd      K2 forward (no metadata: ALL_SLOT0), the LoRA training linear's
  fwd_g    K2 forward with DoRA's g
  dgrad    K2 dx GEMM on the transposed codes qᵀ, dh·A_c in the epilogue (A_cᵀ as its "B")
  shrink   K1 h = x·Aᵀ
  dy_prep  gy and dh = dy·B_c
  eng1 / engN   the engine's K2 with metadata at 256 tokens: one adapter (per-slot loop) / four (PIPE_SLOTS)
Regs and the spill stack come from the cubin (cuobjdump -res-usage), spill stores/loads from `ptxas -v` on the
same PTX, smem from the compiled kernel's metadata. The H200's K2 at r <= 64 may run the Gluon main loop
instead (gemm_rs; the `path` column says which the dispatch would take); it is compiled here anyway.

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

import torch  # noqa: E402

from rlfp8.kernels import _triton_utils as tu  # noqa: E402
from rlfp8.kernels import gemm_triton  # noqa: E402
from rlfp8.kernels.gemm_triton import lora_gemm_triton  # noqa: E402
from rlfp8.kernels.gemm_configs import GLUON_SCHEDULE, SM90_MAX_SMEM, fit_smem, schedule_of  # noqa: E402
from rlfp8.kernels.gemm_rs import MAX_RANK as GLUON_MAX_RANK  # noqa: E402
from rlfp8.kernels.linear_triton import dy_prep_triton  # noqa: E402
from rlfp8.kernels.metadata import build_lora_meta  # noqa: E402
from rlfp8.kernels.shrink_triton import lora_shrink_triton  # noqa: E402

SHAPES = {"8192x8192": (8192, 8192), "8192x28672": (8192, 28672)}     # bench/dora.py: (N out, K in)
ROLES = ("fwd", "fwd_g", "dgrad", "shrink", "dy_prep", "eng1", "engN")
H200 = torch.device("cuda")          # only names the device whose configs to pick; nothing runs on it
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def _e(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype)


def h200_config(M: int, N: int, K: int, rank: int, transposed: bool = False):
    """(config, path): the W8A16 config lora_gemm_triton picks on an H200 for this call, fitted to its shared
    memory at this rank, and which main loop the dispatch would run (gluon_rs where gemm_rs can take it)."""
    q = _e(K, N, dtype=FP8).t() if transposed else _e(N, K, dtype=FP8)
    cfg, invariant = gemm_triton._pick_config(None, "w8a16", M, N, K, q, H200)
    gluon = rank <= GLUON_MAX_RANK and (not invariant or schedule_of(cfg) == GLUON_SCHEDULE)
    return fit_smem(cfg, "w8a16", rank, SM90_MAX_SMEM), "gluon_rs" if gluon and M > 512 else "triton"


def _launch_role(role: str, N: int, K: int, r: int, M: int) -> str:
    """Issue one role's launch (captured by collect_launches); returns the K2 path column."""
    q, sw = _e(N, K, dtype=FP8), torch.empty(N)
    if role in ("fwd", "fwd_g"):
        cfg, path = h200_config(M, N, K, r)
        lora_gemm_triton(_e(M, K), q, sw, h=torch.empty(1, M, r), B=_e(1, N, r),
                         g=torch.empty(1, N) if role == "fwd_g" else None, config=cfg)
        return "triton" if role == "fwd_g" else path
    if role == "dgrad":                  # GEMM over N: x = gy [M, N], weight qᵀ [K, N]
        cfg, path = h200_config(M, K, N, r, transposed=True)
        lora_gemm_triton(_e(M, N), q.t(), None, h=torch.empty(1, M, r), B=_e(r, K).t()[None], config=cfg)
        return path
    if role == "shrink":
        lora_shrink_triton(_e(M, K), _e(1, r, K), None)
        return "triton"
    if role == "dy_prep":
        dy_prep_triton(_e(M, N), torch.empty(N), _e(N, r))
        return "triton"
    Me, S = 256, 1 if role == "eng1" else 4                     # the engine: metadata, 256-token prefill chunk
    cfg, _ = h200_config(Me, N, K, r)
    meta = build_lora_meta(torch.arange(Me) % S, S)
    lora_gemm_triton(_e(Me, K), q, sw, h=torch.empty(1, Me, r), B=_e(S, N, r), meta=meta, config=cfg)
    return "triton"



def collect(shapes, ranks, roles, M: int = 4096) -> list:
    items = []
    for shape in shapes:
        N, K = SHAPES[shape]
        for r in ranks:
            for role in roles:
                with tu.collect_launches() as rec:
                    path = _launch_role(role, N, K, r, M)
                for kern, _grid, args, kw in rec:
                    items.append(dict(role=role, shape=shape, r=r, path=path, spec=tu.jit_spec(kern, args, kw),
                                      arg_names=kern.arg_names))
    return items


def _spills_from_ptxas(ptx: str) -> dict:
    """ptxas -v on the kernel's PTX: registers and spill store/load bytes (Triton's own ptxas, sm_90a)."""
    from tests.kernel.sm90_compile_worker import _cuda_tool
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
    from tests.kernel.sm90_compile_worker import _sass_facts
    spec = item["spec"]
    k = tu.compile_spec(spec)
    facts = _sass_facts(k.asm["cubin"], 0)
    named = {item["arg_names"][i[0]]: v for i, v in spec["constexprs"].items()}
    return dict(role=item["role"], shape=item["shape"], r=item["r"], path=item["path"], kernel=spec["name"],
                regs=facts.get("regs"), stack=facts.get("stack"), smem=k.metadata.shared,
                num_warps=spec["options"]["num_warps"], num_stages=spec["options"]["num_stages"],
                **_spills_from_ptxas(k.asm["ptx"]),
                **{c: named.get(c) for c in ("BLOCK_N", "BLOCK_M", "BLOCK_T", "BLOCK_K", "SPLIT_K", "BLOCK_R",
                                             "BLOCK_R_CHUNK", "PIPE_SLOTS")})


def _tile(row: dict) -> str:
    dims = "x".join(str(row[c]) for c in ("BLOCK_N", "BLOCK_M", "BLOCK_T", "BLOCK_K") if row.get(c) is not None)
    split = f" sk{row['SPLIT_K']}" if row.get("SPLIT_K") not in (None, 1) else ""
    return f"{dims}{split} w{row['num_warps']} s{row['num_stages']}"


def print_table(rows: list) -> None:
    print(f"{'role':8s} {'shape':11s} {'r':>4s} {'path':8s} {'config':26s} {'BR':>4s} {'chunk':>5s} "
          f"{'regs':>4s} {'stack':>5s} {'spill st/ld':>13s} {'smem':>7s}")
    for x in rows:
        chunk = x.get("BLOCK_R_CHUNK") or "-"
        spill = f"{x.get('spill_st', '?')}/{x.get('spill_ld', '?')}"
        print(f"{x['role']:8s} {x['shape']:11s} {x['r']:4d} {x['path']:8s} {_tile(x):26s} {x['BLOCK_R'] or '-':>4} "
              f"{chunk:>5} {x['regs']:4d} {x['stack']:5d} {spill:>13s} {x['smem']:7d}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="64,384,512")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--roles", default=",".join(ROLES))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    items = collect(a.shapes.split(","), [int(r) for r in a.ranks.split(",")], a.roles.split(","), a.tokens)
    with ProcessPoolExecutor(max_workers=a.jobs) as pool:
        rows = list(pool.map(measure, items))
    print_table(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
