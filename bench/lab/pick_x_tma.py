"""bench/lab/pick_x_tma.py (H200): for the W8A16 64-token keys (swap_ab loop) whose entry loads x with pointers,
time the entry's config against its x_tma variant (paired graphs, L2 flushed, median of 100) over the key's
projections; take the variant when its bits equal the entry's and it is faster; record the measurement in the
table's `edits`.
    python bench/lab/pick_x_tma.py      # edits rlfp8/kernels/tuned/<gpu>.json in place
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import kernel_bench as kb  # noqa: E402  (Timer, PROJ)
from rlfp8.kernels import gemm_configs as lg  # noqa: E402
from rlfp8.kernels.gemm_triton import lora_gemm_triton  # noqa: E402
from rlfp8.kernels.fp8_triton import quantize_weight_triton  # noqa: E402

DEV = "cuda"
GROUPS = {"w8a16|64|4096|narrow": ["qkv", "o"], "w8a16|64|4096|wide": ["gate_up"], "w8a16|64|12288|narrow": ["down"]}


def compare(cfg, var, names, timer, g) -> tuple[float, float, bool]:
    """(µs with cfg, µs with var) summed over the projections, and whether var's 20 outputs equal cfg's."""
    tot_a = tot_b = 0.0
    same = True
    for name in names:
        K, widths = kb.PROJ[name]
        w = torch.randn(sum(widths), K, device=DEV, dtype=torch.bfloat16, generator=g) * .02
        q, sw = quantize_weight_triton(w)
        x = torch.randn(64, K, device=DEV, dtype=torch.bfloat16, generator=g)
        a = lambda: lora_gemm_triton(x, q, sw, config=cfg)       # noqa: E731
        b = lambda: lora_gemm_triton(x, q, sw, config=var)       # noqa: E731
        same &= all(torch.equal(b(), a()) for _ in range(20))
        ua, ub = timer.paired_us([a, b])
        tot_a, tot_b = tot_a + ua, tot_b + ub
        print(name, round(ua, 2), round(ub, 2), same, flush=True)
    return tot_a, tot_b, same


def main() -> int:
    g = torch.Generator(device=DEV).manual_seed(0)
    timer = kb.Timer(100)
    path = lg.tuned_table_path()
    table = json.loads(path.read_text())
    for key, names in GROUPS.items():
        cfg = lg.GemmConfig(**table["gemm"][key])
        var = dataclasses.replace(cfg, x_tma=True)
        if var == cfg:
            print(key, "already x_tma")
            continue
        us_ptr, us_tma, same = compare(cfg, var, names, timer, g)
        if same and us_tma < 0.99 * us_ptr:
            table["gemm"][key]["x_tma"] = True
            table.setdefault("edits", []).append({
                "key": key, "change": "x_tma: true", "date": datetime.date.today().isoformat(),
                "why": f"H200, 64 tokens, {'+'.join(names)}: pointer x loads {us_ptr:.2f} us vs TMA {us_tma:.2f} us "
                       f"(paired graphs, L2 flushed, median of 100), outputs bit-identical over 20 calls "
                       f"(bench/lab/pick_x_tma.py)"})
            print("take", key)
    path.write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
