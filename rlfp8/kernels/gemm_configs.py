"""K2's launch configs: GemmConfig, the per-token-bucket heuristics and the tuned table that overrides them.

Configs are keyed by (mode, token bucket, K, N class) where the N class only separates N <= 8192 from wider
weights, so the q/k/v row views of a fused qkv (and o_proj) get the same split as the fused call: a row's
result does not depend on the view. A tuned table (rlfp8/kernels/tuned/<gpu>.json, written by
bench/kernel_bench.py --tune) overrides the heuristics; with the knob `tuned_nearest` a key it lacks takes the nearest
tuned K's entry (same mode, bucket, N class; nearest_tuned_config); the knob `tuned_gpu` picks another GPU's table.
Same (T, mode, K, N class) => same config => same arithmetic order for a row (the matched property).

Batch invariance (knob `batch_invariant`, default auto = the W8A16 calls): vLLM cuts the same rows into
chunks of any size (decode 1..16, prefill chunks), so the order of the additions over K must not depend on
T. `invariant_gemm_config` keeps one ReductionSchedule per (mode, K, N class) at every T:
  * SPLIT_K and the shares' boundaries fixed (SPLIT_K contiguous shares of whole BLOCK_K chunks), so the
    split-order sum of the fp32 partials is fixed (the last-program and the distributed reduction add in
    the same order);
  * swap_ab fixed (True) with >= 64 weight rows: every MMA is a wgmma with the widened weight rows as its A
    operand and k16 steps issued in k order into one accumulator, so no T switches to tokens-as-A or to
    mma.sync (below 64 tokens the other orientation runs on mma.sync: another instruction, not provably the
    same sums);
  * BLOCK_K free in W8A16 where the shares stay the schedule's (a multiple of its BLOCK_K that gives the same
    share boundaries, `same_sums`): a share's k16 wgmma steps run in k order into one accumulator whatever
    number of chunks groups them, so the sums are the same (H200: bench/lab/explore_decode_tiles.py, BLOCK_K
    64-1024 bit-identical on every Qwen3-8B projection; tests/gpu). Decode tiles want 256-512-byte row chunks.
    W8A8 keeps the schedule's BLOCK_K: the FP8 wgmma's accumulator promotion may follow the chunks;
  * free with T: BLOCK_M / BLOCK_N / GROUP_M (which tile a row lands in, not how its sum is formed),
    warps, stages, TMA and the widening variant (exact conversions).
The epilogue's h·Bᵀ sums over the rank in chunks (rank_chunk) with two fixed 16-bit MMAs each, and the
shrink (K1) pins its own schedule (shrink_triton.invariant_shrink_config). Costs: bench/lab/invariant_configs.py.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ._triton_utils import cdiv, next_pow2
from .knobs import knobs

__all__ = ["GLUON_SCHEDULE", "GemmConfig", "INVARIANT_SCHEDULES", "M_BUCKETS", "NUM_SMS_HINT", "RANK_CHUNK",
           "WIDENINGS", "ReductionSchedule", "SM90_MAX_SMEM", "batch_invariant", "block_r", "cached_launch_config",
           "config_generation", "config_key", "config_source", "fit_smem", "rank_chunk", "WGMMA_ROWS", "gemm_config",
           "gemm_config_and_source", "invariant_gemm_config", "invariant_tile", "m_bucket", "n_class",
           "NEAREST_K_RATIO", "nearest_tuned_config", "reduction_schedule", "reload_tuned_table", "same_sums",
           "schedule_of", "share_len", "smem_bytes", "stages_that_fit", "tuned_table_path"]

# How W8A16 widens e4m3 weight tiles to bf16, per config (GemmConfig.widen; the PTX is in widen.py): all exact,
# so all give the same bits; the interpreter always takes "cvt" (it cannot run inline PTX).
WIDENINGS = ("bits", "prmt", "cvt")


@dataclass(frozen=True)
class GemmConfig:
    block_n: int          # weight rows per tile (swap_ab: wgmma's M side, a multiple of 64; else >= 16)
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
    global _tuned, _generation
    _tuned = None
    _invariant.clear()
    _launch_configs.clear()
    _generation += 1


_generation = 0


def config_generation() -> int:
    """Bumped by reload_tuned_table: a cache of launches chosen from the configs (launch plans) keys on it."""
    return _generation


_launch_configs: dict = {}


def cached_launch_config(key: tuple, choose):
    """choose() once per key: a launcher's config choice, whose key names everything the choice reads (the
    caller's config, mode, token bucket, shape, device, the knobs); cleared with the tuned table."""
    cfg = _launch_configs.get(key)
    if cfg is None:
        cfg = _launch_configs[key] = choose()
    return cfg


def config_key(mode: str, M: int, N: int, K: int, transposed: bool = False) -> str:
    """Tuned-table key; "T" marks the backward dx GEMM that reads the codes transposed (qᵀ [K, N])."""
    return f"{mode}{'T' if transposed else ''}|{m_bucket(M)}|{K}|{n_class(N)}"


def gemm_config(mode: str, M: int, N: int, K: int, device=None, transposed: bool = False) -> GemmConfig:
    """The config the launcher uses: the tuned table's entry for (mode, bucket, K, N class), else (knob
    tuned_nearest) the nearest tuned K's (nearest_tuned_config), else the heuristic."""
    return gemm_config_and_source(mode, M, N, K, device, transposed)[0]


def config_source(mode: str, M: int, N: int, K: int, device=None, transposed: bool = False) -> str:
    """Where gemm_config's answer comes from: "tuned" | "nearest_tuned" | "heuristic" (dispatch records it)."""
    return gemm_config_and_source(mode, M, N, K, device, transposed)[1]


def gemm_config_and_source(mode: str, M: int, N: int, K: int, device=None,
                           transposed: bool = False) -> tuple[GemmConfig, str]:
    """(gemm_config's answer, config_source's) from one lookup."""
    if device is not None and torch.device(device).type == "cuda":
        table = _tuned_table(device)
        entry = table.get(config_key(mode, M, N, K, transposed))
        if entry is not None:
            return GemmConfig(**entry), "tuned"
        near = nearest_tuned_config(table, mode, M, N, K, transposed) if knobs().tuned_nearest else None
        if near is not None:
            return near, "nearest_tuned"
    return _heuristic(mode, M, N, K), "heuristic"


# With the knob tuned_nearest, a shape the table has not tuned (another model: Qwen3-32B's K 5120 / 8192 / 25600
# beside the tuned 8B's 4096 / 12288) takes the winner of the same mode, token bucket and N class at the nearest
# K, when that K is within this factor: on the H200 every tuned 8B winner beat the heuristic at its own key
# (1.41-1.55x at 64 tokens in W8A16: the heuristic has no TMA, no prmt widening, 128-row tiles), and the
# winners share their tiles across K.
NEAREST_K_RATIO = 3.0


def nearest_tuned_config(table: dict, mode: str, M: int, N: int, K: int,
                         transposed: bool = False) -> GemmConfig | None:
    """The tuned entry for (mode, bucket, N class) whose K is nearest to K (log scale; ties: the smaller K), its
    split-K clamped as reduction_schedule clamps (each share >= 2 BLOCK_K chunks); None when no tuned K is within
    NEAREST_K_RATIO. A function of (mode, bucket, K, N class) like the table's keys, so q/k/v row views still get
    the fused call's config (the matched property)."""
    head, cls = config_key(mode, M, N, K, transposed).split("|")[:2], n_class(N)
    best = None
    for key, entry in table.items():
        parts = key.split("|")
        if len(parts) != 4 or parts[:2] != head or parts[3] != cls:
            continue
        tuned_k = int(parts[2])
        ratio = max(tuned_k, K) / min(tuned_k, K)
        if ratio <= NEAREST_K_RATIO and (best is None or (ratio, tuned_k) < best[:2]):
            best = (ratio, tuned_k, entry)
    if best is None:
        return None
    cfg = GemmConfig(**best[2])
    return dataclasses.replace(cfg, split_k=max(1, min(cfg.split_k, K // (2 * cfg.block_k))))


# ----------------------------------------------------------------------------------------------------------
# batch invariance (module docstring)
@dataclass(frozen=True)
class ReductionSchedule:
    """How K2 sums over K: SPLIT_K contiguous shares of whole BLOCK_K chunks, each share summed in k order
    from zero, the shares' fp32 partials then added in split order."""
    split_k: int
    block_k: int


# per N class: narrow weights (qkv, o, down: <= 64 weight tiles of 64 rows at decode) need a split to fill
# the SMs at decode (split 2 measured within 3% of the tuned split 4 at 16 tokens, and it halves the
# partials' traffic at large T); wide ones (gate_up) do not, and BLOCK_K 64 is the Gluon main loop's, so
# that loop stays admissible for the trainer's > 512-token calls
INVARIANT_SCHEDULES = {"narrow": ReductionSchedule(2, 128), "wide": ReductionSchedule(1, 64)}
GLUON_SCHEDULE = ReductionSchedule(1, 64)      # lora_gemm_rs: no split, BK 64 (gemm_rs.BK)
SMEM_BYTES = 200 * 1024                        # shared memory a config's stages may take (sm_90: 227 KiB)


def batch_invariant(mode: str, transposed: bool = False) -> bool:
    """Does this K2/K1 call take the invariant schedule? (knob batch_invariant; the backward's dx GEMM on the
    transposed codes matches nothing on the engine side, so it keeps the tuned configs)."""
    setting = knobs().batch_invariant
    return not transposed and (setting == "on" or (setting == "auto" and mode == "w8a16"))


def reduction_schedule(mode: str, N: int, K: int) -> ReductionSchedule:
    """The schedule of every call on a weight of this shape: a function of (N class, K) only."""
    want = INVARIANT_SCHEDULES[n_class(N)]
    block_k = max(16, min(want.block_k, next_pow2(K)))
    return ReductionSchedule(max(1, min(want.split_k, K // (2 * block_k))), block_k)


def schedule_of(cfg: GemmConfig) -> ReductionSchedule:
    return ReductionSchedule(cfg.split_k, cfg.block_k)


def share_len(K: int, split_k: int, block_k: int) -> int:
    """Length of each of K2's split-K shares over K (whole BLOCK_K chunks; the last share may end early at K)."""
    return cdiv(cdiv(K, block_k), split_k) * block_k


def same_sums(cfg: GemmConfig, sched: ReductionSchedule, K: int, mode: str = "w8a16") -> bool:
    """Does cfg add the products over K as sched does? The same split into the same contiguous shares, each summed
    in k16 wgmma steps in k order (module docstring): in W8A16 any BLOCK_K that is a multiple of the schedule's and
    keeps the shares' boundaries; in W8A8 the schedule's own BLOCK_K. (Tiles and orientation: invariant_tile.)"""
    if cfg.split_k != sched.split_k:
        return False
    if cfg.block_k == sched.block_k:
        return True
    same_shares = sched.split_k == 1 or share_len(K, cfg.split_k, cfg.block_k) == share_len(K, sched.split_k,
                                                                                             sched.block_k)
    return mode == "w8a16" and cfg.block_k % sched.block_k == 0 and same_shares


# the fewest weight rows a swap_ab tile may have: wgmma's M side. Fewer rows (decode tiles of 16-32 rows, tokens on
# the M side) run mma.sync, another instruction whose sums are not provably wgmma's.
WGMMA_ROWS = 64


def invariant_tile(cfg: GemmConfig, sched: ReductionSchedule, K: int, mode: str = "w8a16") -> bool:
    """May a batch-invariant call on a weight with this K run cfg? Its sums are the schedule's (same_sums), with
    the weight rows on wgmma's M side and enough of them."""
    return same_sums(cfg, sched, K, mode) and cfg.swap_ab and cfg.block_n >= WGMMA_ROWS


def stages_that_fit(cfg: GemmConfig, mode: str, block_k: int) -> int:
    """How many main-loop stages of cfg's weight and x tiles, at this BLOCK_K, fit SMEM_BYTES."""
    x_bytes = 1 if mode == "w8a8" else 2
    return SMEM_BYTES // ((cfg.block_n + cfg.block_m * x_bytes) * block_k)


def _measured_candidate(mode: str, M: int, N: int, K: int, sched: ReductionSchedule, device) -> GemmConfig | None:
    """The tuner's fastest measured config for this bucket that a batch-invariant call may run (invariant_tile:
    the schedule's sums, swap_ab; tuned table's "candidates"), or None."""
    if device is None or torch.device(device).type != "cuda":
        return None
    p = tuned_table_path(device)
    if not p.exists():
        return None
    best = None
    for cand in json.loads(p.read_text()).get("candidates", {}).get(config_key(mode, M, N, K), []):
        if "us" not in cand:
            continue
        cfg = GemmConfig(*cand["config"])
        if invariant_tile(cfg, sched, K, mode) and (best is None or cand["us"] < best[0]):
            best = (cand["us"], cfg)
    return None if best is None else best[1]


def invariant_gemm_config(mode: str, M: int, N: int, K: int, device=None) -> GemmConfig:
    """K2's config in invariant mode: the tiles along T and N of the bucket's measured (else tuned or
    heuristic) config, with the shape's ReductionSchedule and swap_ab."""
    sched = reduction_schedule(mode, N, K)
    kn = knobs()
    key = (mode, m_bucket(M), n_class(N), K, str(device), kn.tuned_gpu, kn.tuned_nearest)   # what the choice reads
    if key not in _invariant:
        cfg = _measured_candidate(mode, M, N, K, sched, device)
        if cfg is None:
            base = gemm_config(mode, M, N, K, device)
            cfg = dataclasses.replace(base, split_k=sched.split_k, block_k=sched.block_k, swap_ab=True,
                                      block_n=max(WGMMA_ROWS, base.block_n),
                                      num_stages=max(1, min(base.num_stages, stages_that_fit(base, mode,
                                                                                             sched.block_k))))
        _invariant[key] = cfg
    return _invariant[key]


_invariant: dict = {}


# ----------------------------------------------------------------------------------------------------------
# shared memory: a config must fit the GPU's per-block limit at the adapter's rank (the epilogue's h and B
# tiles grow with it; the compiler's numbers are in bench/README.md, `dora.py` section)
SM90_MAX_SMEM = 232448      # H100/H200 max dynamic shared memory per block; the limit on CPU (compile, interpreter)
SMEM_SLACK = 1024           # barriers and scalars beside the tiles


def _main_loop_smem(cfg: GemmConfig, mode: str) -> int:
    x_bytes = 1 if mode == "w8a8" else 2
    main = cfg.num_stages * (cfg.block_n + cfg.block_m * x_bytes) * cfg.block_k
    if not cfg.swap_ab and mode == "w8a16":         # the widened weight tile, the shared-memory MMA operand
        main += cfg.block_n * cfg.block_k * 2
    return main


# K2's epilogue multiplies h·Bᵀ in rank chunks (gemm_triton._lora_ranks): at rank 384 the whole rank (BLOCK_R 512)
# made fit_smem cut the 4096-token tile from 256 to 64 tokens and the dx GEMM spill (bench/lab/rank_spills.py).
# Up to BLOCK_R 64 the chunk is the whole rank (the unchunked code, the same SASS); above it RANK_CHUNK (32: at
# 64 the dx GEMM's 128x256 tile still spilled ~100 bytes). The chunk depends on BLOCK_R alone and its boundaries
# are multiples of RANK_CHUNK, so two ranks above 64 group their sums alike, and an engine slot padded to a larger
# rank (compat.slot_rank: never from <= 64 to > 64) adds exact zeros: the matched property and the
# batch-invariant schedule hold.
RANK_CHUNK = 32
RANK_CHUNK_FROM = 64            # BLOCK_R up to this: one chunk


def block_r(rank: int) -> int:
    """BLOCK_R of K1/K2 for a LoRA rank: next_pow2(rank), at least 16 (tl.dot)."""
    return max(16, next_pow2(rank))


def rank_chunk(block_r: int) -> int:
    """The rank chunk of K2's epilogue for this BLOCK_R (a constexpr function in the kernel: gemm_triton)."""
    return block_r if block_r <= RANK_CHUNK_FROM else RANK_CHUNK


def _epilogue_smem(cfg: GemmConfig, rank: int) -> int:
    if not rank:
        return 0
    chunk = rank_chunk(block_r(rank))
    h_tile = chunk * cfg.block_m * 2                             # [BR_CHUNK, BLOCK_M] 16-bit
    b_tile = cfg.block_n * chunk * 2                             # [BLOCK_N, BR_CHUNK] 16-bit
    return max(2 * h_tile, b_tile + h_tile)


def smem_bytes(cfg: GemmConfig, mode: str, rank: int) -> int:
    """Upper bound on K2's shared memory with this config and LoRA rank (0 = no adapter): the largest of
      main loop  num_stages · (BLOCK_N·BLOCK_K fp8 weight tile + BLOCK_M·BLOCK_K x tile (2 bytes W8A16, 1 W8A8)),
                 plus the widened weight tile BLOCK_N·BLOCK_K·2 in W8A16 with tokens on M (swap_ab False);
      epilogue   one rank chunk's h tile [BR_CHUNK, BLOCK_M] as the 16-bit MMA operand twice (bf16x2's hi and
                 lo), or once beside its B tile [BLOCK_N, BR_CHUNK] (staged through shared memory when registers
                 run out): max(2·h, B + h), 2 bytes per element, BR_CHUNK = rank_chunk(block_r(rank));
      transpose  tokens on M: the accumulator's transpose BLOCK_N·BLOCK_M·4;
    which the compiler does not keep live together (it reuses the main loop's buffers after the loop), plus
    SMEM_SLACK. Checked against the sm_90a compiler's own numbers (tests/kernel/test_gemm_smem_fit.py: a
    sample of both orientations and modes, and every config fit_smem produces at ranks 256 and 384)."""
    transpose = 0 if cfg.swap_ab else cfg.block_n * cfg.block_m * 4
    return max(_main_loop_smem(cfg, mode), _epilogue_smem(cfg, rank), transpose) + SMEM_SLACK


@functools.lru_cache(maxsize=4096)      # called per launch; configs are frozen (hashable)
def fit_smem(cfg: GemmConfig, mode: str, rank: int, limit: int) -> GemmConfig:
    """cfg, or the nearest config whose smem_bytes fit `limit`: fewer stages (down to 2) while the main loop
    is the larger part; else, for the epilogue, half the weight rows (BLOCK_N, down to 64) while the B tile is
    larger than the h tile, half the tokens (BLOCK_M, down to 16) otherwise; then fewer stages down to 1.
    Never BLOCK_K, SPLIT_K or swap_ab: the reduction schedule, hence batch invariance and the engine/trainer
    match, stays as chosen (which tile a row lands in does not change its sums). ValueError when nothing fits."""
    fitted = cfg
    while smem_bytes(fitted, mode, rank) > limit:
        main, epilogue = _main_loop_smem(fitted, mode), _epilogue_smem(fitted, rank)
        if main >= epilogue and fitted.num_stages > 2:
            fitted = dataclasses.replace(fitted, num_stages=fitted.num_stages - 1)
        elif main < epilogue and fitted.block_n > max(64, fitted.block_m):     # the B tile is the larger
            fitted = dataclasses.replace(fitted, block_n=fitted.block_n // 2)
        elif fitted.block_m > 16:
            fitted = dataclasses.replace(fitted, block_m=fitted.block_m // 2)
        elif fitted.num_stages > 1:
            fitted = dataclasses.replace(fitted, num_stages=fitted.num_stages - 1)
        else:
            raise ValueError(f"rlfp8.kernels.lora_gemm: no config derived from {cfg} fits {limit} bytes of shared "
                             f"memory at rank {rank} ({mode}); the smallest needs {smem_bytes(fitted, mode, rank)}")
    return fitted
