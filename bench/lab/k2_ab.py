#!/usr/bin/env python
"""A/B check of a K2 change: the working tree's rlfp8/kernels/gemm_triton.py ("new") against another version of
the file ("old", e.g. the last commit's), on every Qwen3-8B projection and token count whose tuned config
uses split-K (the configs both versions take from the same tuned table), both modes:
  * same_bits: new == old output (a change meant to keep the arithmetic must keep the bits);
  * repeat_same: 20 repeated new calls give identical outputs (determinism);
  * new_us / old_us: median of --reps CUDA-graph replays, the two graphs replayed in turn, L2 flushed.
The split-K protocol variants in bench/results/explore_k2_splitk_variants_h200.json were measured this way.

    git show HEAD:rlfp8/kernels/gemm_triton.py > /tmp/lora_gemm_old.py
    python bench/lab/k2_ab.py --old-src /tmp/lora_gemm_old.py --out /tmp/k2_ab.json          # H200, ~20 s
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

PROJ = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
TOKENS = (1, 4, 16, 64, 256)


WIDEN_IMPORT = "from .widen import _e4m3_to_bf16, _e4m3x2_to_bf16, _e4m3x4_to_bf16, _keep\n"


def standalone_source(src: str) -> str:
    """K2's module text (rlfp8/kernels/gemm_triton.py, or an older single-file lora_gemm.py) importable from
    any file: widen.py's helpers inlined (Triton resolves a kernel's helpers in its own module, and the arms
    of explore_k2_decode edit them), the other package-relative imports made absolute."""
    if WIDEN_IMPORT in src:
        widen = (ROOT / "rlfp8" / "kernels" / "widen.py").read_text()
        src = src.replace(WIDEN_IMPORT, "") + "\n\n" + widen[widen.index("\n@triton.jit") + 1:]
    src = src.replace("from .lora_shrink import", "from rlfp8.kernels import")      # pre-split versions
    src = re.sub(r"from \.(\w+) import", r"from rlfp8.kernels.\1 import", src)
    return src.replace("from . import dispatch", "from rlfp8.kernels import dispatch")


def import_source(src: str, name: str):
    """Import module text as `name` from a temporary file (Triton's JIT reads kernel source from the file)."""
    path = Path(tempfile.mkdtemp(prefix="k2_copy_")) / f"{name}.py"
    path.write_text(src)
    sys.path.insert(0, str(path.parent))        # precompile's spawned workers import it by name
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_copy(src_path: str, name: str = "k2_old"):
    """Import another version of lora_gemm.py as a stand-alone module."""
    return import_source(standalone_source(Path(src_path).read_text()), name)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-src", required=True, help="the other lora_gemm.py (e.g. git show HEAD:... > file)")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("k2_ab: needs a GPU")
    from bench.kernels import Timer
    from rlfp8.kernels import _triton_utils as tu
    from rlfp8.kernels import gemm_configs as lg
    from rlfp8.kernels.gemm_triton import lora_gemm_triton
    old = load_copy(a.old_src)
    timer = Timer(a.reps)
    with tu.collect_launches() as rec:          # compile every kernel of both versions in parallel first
        cases(lg, old, lambda *fns: [f() for f in fns])
    info = tu.precompile(rec, jobs=16)
    print(f"[precompile] {info['kernels']} kernels in {info['seconds']} s, errors: {info['errors']}", flush=True)
    rows, w8a16_rows = cases(lg, old, None, timer)
    if a.out:
        Path(a.out).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                               command=" ".join(sys.argv), rows=rows, w8a16_vs_w8a8=w8a16_rows),
                                          indent=1))


def cases(lg, old, collect, timer=None):
    """Run (collect is not None: only launch, for the precompile) or time every case."""
    from rlfp8.kernels.fp8_triton import quantize_activation_triton, quantize_weight_triton
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, w8a16_rows = [], []
    for proj, (N, K) in PROJ.items():
        q, sw = quantize_weight_triton(torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * .02)
        for M in TOKENS:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
            xq, xs = quantize_activation_triton(x)
            # the acceptance line "W8A16 <= 1.15x our W8A8 at M <= 64": new and old W8A16 against the new W8A8
            # the old copy gets the new one's config: its own tuned-table path is a temporary directory
            c16 = lg.gemm_config("w8a16", M, N, K, "cuda")
            c16_old = old.GemmConfig(**dataclasses.asdict(c16))
            fns = [lambda: lora_gemm_triton(x, q, sw, config=c16),
                   lambda: old.lora_gemm_triton(x, q, sw, config=c16_old),
                   lambda: lora_gemm_triton(xq, q, sw, x_scale=xs)]
            if collect is not None:
                collect(*fns)
            elif M <= 64:
                t16, t16_old, t8 = timer.paired_us(fns)
                r = dict(proj=proj, M=M, w8a16_us=round(t16, 2), w8a16_old_us=round(t16_old, 2), w8a8_us=round(t8, 2),
                         ratio=round(t16 / t8, 3), ratio_old=round(t16_old / t8, 3))
                print(r, flush=True)
                w8a16_rows.append(r)
            for mode in ("w8a16", "w8a8"):
                cfg = lg.gemm_config(mode, M, N, K, "cuda")
                if cfg.split_k == 1:
                    continue
                old_cfg = old.GemmConfig(**dataclasses.asdict(cfg))
                args, kw = ((x, q, sw), {}) if mode == "w8a16" else ((xq, q, sw), dict(x_scale=xs))
                fn_new = lambda: lora_gemm_triton(*args, config=cfg, **kw)           # noqa: E731
                fn_old = lambda: old.lora_gemm_triton(*args, config=old_cfg, **kw)      # noqa: E731
                if collect is not None:
                    collect(fn_new, fn_old)
                    continue
                y_new = fn_new()
                same = torch.equal(fn_old(), y_new)
                repeat = all(torch.equal(fn_new(), y_new) for _ in range(20))
                t_new, t_old = timer.paired_us([fn_new, fn_old])
                r = dict(proj=proj, M=M, mode=mode, split_k=cfg.split_k, new_us=round(t_new, 2),
                         old_us=round(t_old, 2), ratio=round(t_new / t_old, 3), same_bits=same, repeat_same=repeat)
                print(r, flush=True)
                rows.append(r)
    return rows, w8a16_rows


if __name__ == "__main__":
    main()
