"""K2's launch configs: GemmConfig, the per-token-bucket heuristics and the tuned table that overrides them.

Configs are keyed by (mode, token bucket, K, N class) where the N class only separates N <= 8192 from wider
weights, so the q/k/v row views of a fused qkv (and o_proj) get the same split as the fused call: a row's
result does not depend on the view. A tuned table (rlfp8/kernels/tuned/<gpu>.json, written by
bench/kernels.py --tune) overrides the heuristics; the knob `tuned_gpu` picks another GPU's table.
Same (T, mode, K, N class) => same config => same arithmetic order for a row (the matched property).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ._triton_utils import cdiv
from .knobs import knobs

__all__ = ["GemmConfig", "M_BUCKETS", "NUM_SMS_HINT", "WIDENINGS", "config_key", "gemm_config", "m_bucket",
           "n_class", "reload_tuned_table", "tuned_table_path"]

# How W8A16 widens e4m3 weight tiles to bf16, per config (GemmConfig.widen; the PTX is in widen.py): all exact,
# so all give the same bits; the interpreter always takes "cvt" (it cannot run inline PTX).
WIDENINGS = ("bits", "prmt", "cvt")


@dataclass(frozen=True)
class GemmConfig:
    block_n: int          # weight rows per tile (wgmma M side, multiple of 64)
    block_m: int          # tokens per tile (wgmma N side, >= 16)
    block_k: int
    split_k: int = 1
    group_m: int = 8      # token tiles swept per weight tile (L2 reuse at large T)
    num_warps: int = 4
    num_stages: int = 4
    w_tma: bool = False   # load the weight tiles with TMA (host TensorDescriptor) instead of cp.async
    widen: str = "bits"   # W8A16 with bf16 x: "bits", "prmt" or "cvt" (see WIDENINGS); same results
    swap_ab: bool = True  # weight rows on wgmma's M side (register-A widening) or tokens (weight tile via smem)
    x_tma: bool = False   # load the x tiles with TMA too, where the rows are not gathered (no metadata or no
                          # adapter); same MMAs, same bits. Gathered rows keep the pointer loads (dispatch
                          # records "lora_gemm.x_loads"). With swap_ab the tile is transposed in shared memory;
                          # its wrong results on the H200 were SYNC_A's register race, not the TMA load

    def key(self) -> tuple:
        return tuple(asdict(self).values())


M_BUCKETS = (16, 32, 64, 128, 256, 512, 1 << 62)
NUM_SMS_HINT = 132          # H100/H200; only shapes the split-K heuristic


def m_bucket(M: int) -> int:
    for b in M_BUCKETS:
        if M <= b:
            return b
    return M_BUCKETS[-1]


def n_class(N: int) -> str:
    return "narrow" if N <= 8192 else "wide"


def _heuristic(mode: str, M: int, N: int, K: int) -> GemmConfig:
    fp8 = mode == "w8a8"
    b = m_bucket(M)
    if b <= 16:
        bn, bm, bk, nw, ns = 64, 16, 256, 4, 5 if fp8 else 4
    elif b <= 32:
        bn, bm, bk, nw, ns = 64, 32, 256, 4, 4
    elif b <= 64:
        bn, bm, bk, nw, ns = 128, 64, 128, 4, 4
    elif b <= 256:
        bn, bm, bk, nw, ns = 128, 128, 128 if fp8 else 64, 8, 4
    else:
        bn, bm, bk, nw, ns = 128, 256, 128 if fp8 else 64, 8, 3
    return GemmConfig(bn, bm, bk, _split(b, N, K, bn, bm, bk), 8, nw, ns)


def _split(b: int, N: int, K: int, bn: int, bm: int, bk: int) -> int:
    """split-K while the tile grid is below ~2 waves, capped so that the fp32 partials (written and read
    once per split: 8·T·N bytes) stay under ~1/2 of the FP8 weight bytes (N·K). The N class replaces N so
    q/k/v views, qkv and o_proj (all N <= 8192) get the same split (the matched property across views)."""
    if b > 256:
        return 1
    n_eff = 4096 if n_class(N) == "narrow" else N
    tiles = cdiv(n_eff, bn) * cdiv(b, bm)
    return max(1, min(round(2 * NUM_SMS_HINT / tiles), K // (2 * bk), K // (16 * b), 8))


_tuned: dict | None = None


def tuned_table_path(device: torch.device | None = None) -> Path:
    name = knobs().tuned_gpu
    if name is None:
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "cpu"
    slug = "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")
    return Path(__file__).parent / "tuned" / f"{slug}.json"


def _tuned_table(device) -> dict:
    global _tuned
    if _tuned is None:
        p = tuned_table_path(device)
        _tuned = json.loads(p.read_text()).get("gemm", {}) if p.exists() else {}
    return _tuned


def reload_tuned_table() -> None:
    global _tuned
    _tuned = None


def config_key(mode: str, M: int, N: int, K: int, transposed: bool = False) -> str:
    """Tuned-table key; "T" marks the backward dx GEMM that reads the codes transposed (qᵀ [K, N])."""
    return f"{mode}{'T' if transposed else ''}|{m_bucket(M)}|{K}|{n_class(N)}"


def gemm_config(mode: str, M: int, N: int, K: int, device=None, transposed: bool = False) -> GemmConfig:
    """The config the launcher uses: the tuned table's entry for (mode, bucket, K, N class), else heuristic."""
    if device is not None and torch.device(device).type == "cuda":
        entry = _tuned_table(device).get(config_key(mode, M, N, K, transposed))
        if entry is not None:
            return GemmConfig(**entry)
    return _heuristic(mode, M, N, K)
