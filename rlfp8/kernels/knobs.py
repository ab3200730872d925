"""The kernel knobs: every switch that changes which kernel path runs or how it is compiled, in one place.

Precedence, lowest first: the defaults below; the config section `kernels.*` (conf/kernels/default.yaml,
through `apply_config`); the environment variables in ENV_VARS (read once, at import, and re-applied over
every `apply_config`, so an operator's override wins over a recipe); `set_knobs(...)` (tests, benchmarks).
The kernels read `knobs()` at call time, never at import, so a config key or a test can change them.
The backend (auto|triton|torch) is a knob too, set from `trainer.kernels` through dispatch.set_backend.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

BACKENDS = ("auto", "triton", "torch")
W8A16_WIDENINGS = ("bits", "cvt")
PDL_MODES = ("auto", "on", "off")
PDL_W8A8_QUANT = ("separate", "fused")
BATCH_INVARIANT = ("auto", "on", "off")
K1_DECODE_RANK_BLOCKS = (0, 16, 32, 64)
K1_IN_K2 = ("off", "w8a8", "on")
K1_IN_K2_ONE_WAVE = ("off", "w8a16", "on")
K1_DECODE_SPLIT_MAX = (8, 16)
K2_PREFETCH_EPILOGUE = ("off", "before_loop", "after_loop", "split")


@dataclass(frozen=True)
class KernelKnobs:
    # which implementation of each op runs (rlfp8.kernels.dispatch): auto = Triton on CUDA, torch on the CPU
    backend: str = "auto"
    # K2 at > 512 tokens without metadata may run the Gluon warp-specialized main loop (lora_gemm_rs; same
    # bits); False keeps the Triton kernel (A/B timing, debugging)
    gemm_rs: bool = True
    # K2 W8A16 swap_ab: retire each k-step's wgmmas before the next widening; False reproduces the register
    # race it prevents (bench/lab/stress_determinism.py), never for real runs
    k2_sync_a: bool = True
    # K2 split-K: every program reduces its share of the tile's tokens; False = the tile's last program
    # reduces them all (A/B timing; same bits)
    k2_dist_red: bool = True
    # K2 decode tiles (fewer tokens than BLOCK_M): the padding token rows load no x (masked loads, zeros) instead of
    # re-reading a valid row; False = unpredicated loads of row 0 for them (A/B timing; same bits: an MMA output
    # column depends on its own token's x only)
    k2_mask_x_rows: bool = True
    # K2 at decode sizes (<= 16 tokens): where the epilogue's operands that K1 does not write (the weight and token
    # scales, the rows' slots, the first slot's B tile at rank <= 64) are loaded. "off" = in the epilogue, after the
    # main loop and the wait for h, as above 16 tokens; "before_loop" = before the main loop, held in registers
    # across it (the held B tile costs registers: W8A16's gate_up 4 instead of 6 programs per SM; the H100 measured
    # no layer faster, bench/README.md session 20); "after_loop" = right after the main loop, before the split-K
    # exchange and the wait for h, so their round trips overlap those; "split" = scales and slots before the main
    # loop, the B tile after it (the default: the fastest place, bench/README.md session 22). Same bits; dispatch
    # records "lora_gemm.prefetch_epilogue" = the place
    k2_prefetch_epilogue: str = "split"
    # W8A16 widening of e4m3 tiles: "bits" = each config's PTX widening (GemmConfig.widen), "cvt" = Triton's
    # .to(bf16) everywhere (same bits)
    w8a16_widen: str = "bits"
    # W8A8: promote the FP8 MMA accumulator to fp32 every k reduction elements (slower, DeepSeek-V3 style);
    # None = Triton's sm_90 default (fast accumulation, like vLLM's CUTLASS FastAccum)
    fp8_precise_acc: int | None = None
    # which tuned GEMM table (rlfp8/kernels/tuned/<slug>.json) to read; None = the current GPU's name
    tuned_gpu: str | None = None
    # a K2 key the tuned table lacks (another model's K) takes the nearest tuned K's entry of the same mode,
    # token bucket and N class (gemm_configs.nearest_tuned_config) instead of the heuristic; off until measured
    # on a GPU at an untuned shape. dispatch records "lora_gemm.config" = tuned | nearest_tuned | heuristic
    tuned_nearest: bool = False
    # the engine projection (fp8_lora_linear): K2 as a programmatic dependent launch of K1, its main loop
    # overlapping K1 (same bits). auto = where the GPU is sm_90+ and Triton has gdc_*; on = require it
    # (error elsewhere); off = plain stream order. dispatch records "lora_gemm.launch" = pdl | stream
    pdl: str = "auto"
    # W8A8 under PDL: "separate" = x quantized by its own kernel before K1, so K2 waits for K1 only before its
    # epilogue (as W8A16) and its main loop overlaps K1; "fused" = K1 quantizes x beside its shrink and K2 waits
    # before its main loop (x_q is K1's). Same codes, same bits; dispatch records "lora_gemm.pdl_wait"
    pdl_w8a8_quant: str = "separate"
    # W8A8 without an adapter (or no token with one) under PDL: K2 launched as the activation quantizer's
    # programmatic dependent (its launch and the L2 prefetch of its weight rows overlap the quantizer; it waits
    # before its main loop); False = quantizer, then K2 in stream order. Same bits; on by default since the A/B of
    # session 17 (the W8A8 layer without an adapter 0.96-0.97x, bench/README.md)
    pdl_quant_k2: bool = True
    # W8A8 calls of at most this many tokens (decode): K2 quantizes x per token itself (no quantizer launch; with
    # an adapter K1 only shrinks and, under PDL, K2's main loop overlaps it); 0 = never (the default: on the H200
    # each projection took 1.4-2.8x as long, bench/README.md). Same codes, same bits; dispatch records
    # "lora_gemm.x_quant" = k2 | k1 | kernel
    k2_quant_x_tokens: int = 0
    # K1 at decode sizes (<= 16 tokens): ranks per program (16 / 32 / 64), so a rank-64 shrink runs on 4 / 2 / 1
    # times the programs (more in flight beside K2's main loop under PDL); 0 = the whole rank up to 128. Same bits
    # (each h column's sum is its own); dispatch records "lora_shrink.rank_blocks"
    k1_decode_rank_block: int = 0
    # the engine projection with an adapter at decode sizes (<= k1_in_k2_tokens): K1's shrink programs run as the
    # first programs of K2's grid, one launch instead of two, K2's programs waiting on their counter before the
    # epilogue (no launch gap; W8A8 then quantizes x in its own kernel, K2 its programmatic dependent with
    # pdl_quant_k2, or takes the caller's codes). "on" = W8A8 calls of <= k1_in_k2_tokens and W8A16 calls of <=
    # k1_in_k2_w8a16_tokens, where the H100 measured the layer with one adapter 5-6% (W8A8) and 2-3% (W8A16, with
    # k1_in_k2_one_wave) faster than K1 in its own launch; "w8a8" = W8A8 calls only; "off" = K1 in its own kernel
    # (K2 its programmatic dependent under PDL). Same bits; dispatch records "lora_gemm.k1" = in_k2
    k1_in_k2: str = "on"
    k1_in_k2_tokens: int = 64
    # W8A16's own limit (at 64 tokens K1's 4x more programs made each projection slower inside the grid)
    k1_in_k2_w8a16_tokens: int = 16
    # K1 in K2's grid: where K1's programs push the grid past what the GPU holds at once (each takes a GEMM program's
    # shared memory and registers), K2's pipeline gets fewer stages (down to 3) until the whole grid is resident in
    # one wave, so no GEMM program waits for a K1 program to leave its SM (W8A16's down projection with one adapter
    # 47.8 -> 35.7 us on the H100). "on" = both modes (W8A8's layer with one adapter 0.7-0.9% faster at 1 to 4
    # tokens, bench/README.md session 23), "w8a16" = W8A16 calls only, "off" = the config as chosen. Same bits
    # (stages do not change the sums); dispatch records "lora_gemm.k1_wave" = one | fewer_stages | two
    k1_in_k2_one_wave: str = "on"
    # W8A8's K1 split-K cap at decode sizes (<= 16 tokens; W8A8 with batch_invariant=on excepted): 16 gives the
    # down projection (K = 12288) 16 programs of 768 K instead of 8 of 1,536 (the W8A8 layer with one adapter
    # ~1.5% faster on the H100, bench/README.md session 19); lowered where the tile's sum of partials would not
    # unroll. W8A16 (the matched engine and its trainer) keeps 8. Changes W8A8's h summation order
    k1_decode_split_max: int = 16
    # K1 at decode sizes (<= 16 tokens): a tile's padding rows (past its adapter's segment: at batch 1, 15 of 16)
    # load no x, as K2's k2_mask_x_rows; False = they re-read a valid row. Same bits (their h is never stored)
    k1_mask_x_rows: bool = False
    # the W8A8 engine under torch.compile (vLLM's compiled mode): x quantized per token by the reference formula in
    # the traced graph, where Inductor fuses it into the kernel that made x (the norm, the activation), and the
    # projection op takes the codes (dispatch "lora_gemm.x_quant" = graph); False = the quantizer kernel inside the
    # op, as in eager and decode-graph engines. Not the quantizer's bits: Inductor quantizes its fused kernel's fp32
    # value of x (scales within one bf16 ulp of the quantizer's on the op's x) and divides its own way, so codes
    # can sit one FP8 step apart (1.7-2.8% of a norm output's codes on an H100; same error against x)
    engine_graph_quant: bool = True
    # K1/K2 launch configs whose reductions over K follow one schedule per weight shape, whatever the token
    # count (gemm_configs.reduction_schedule): "auto" = for the W8A16 calls (the matched engine and the FP8
    # trainer's forward), "on" = W8A8 too, "off" = the tuned per-token-count configs everywhere
    batch_invariant: str = "auto"
    # the host fast paths (same bits): per-parameter cached adapter casts, the backward's side stream only where
    # it can overlap (linear_triton), K2's launch config chosen once per shape and token bucket, K1's h unfilled
    # without metadata; the engine projection's launch plans (rlfp8.kernels.launch_plan, rollout/lora_layers);
    # False = the plain path (the baseline arm of bench/lab/host_overhead.py, trainer_trace.py, engine_host_gpu.py)
    host_fast: bool = True


# environment variable -> knob; the only place in rlfp8.kernels that reads RLFP8_* variables
ENV_VARS = {
    "RLFP8_KERNELS": "backend",
    "RLFP8_GEMM_RS": "gemm_rs",
    "RLFP8_K2_SYNC_A": "k2_sync_a",
    "RLFP8_K2_DIST_RED": "k2_dist_red",
    "RLFP8_K2_MASK_X_ROWS": "k2_mask_x_rows",
    "RLFP8_K2_PREFETCH_EPILOGUE": "k2_prefetch_epilogue",
    "RLFP8_W8A16_WIDEN": "w8a16_widen",
    "RLFP8_FP8_PRECISE_ACC": "fp8_precise_acc",
    "RLFP8_TUNED_GPU": "tuned_gpu",
    "RLFP8_TUNED_NEAREST": "tuned_nearest",
    "RLFP8_PDL": "pdl",
    "RLFP8_PDL_W8A8_QUANT": "pdl_w8a8_quant",
    "RLFP8_PDL_QUANT_K2": "pdl_quant_k2",
    "RLFP8_K2_QUANT_X_TOKENS": "k2_quant_x_tokens",
    "RLFP8_K1_DECODE_RANK_BLOCK": "k1_decode_rank_block",
    "RLFP8_K1_MASK_X_ROWS": "k1_mask_x_rows",
    "RLFP8_K1_IN_K2_TOKENS": "k1_in_k2_tokens",
    "RLFP8_K1_IN_K2": "k1_in_k2",
    "RLFP8_K1_IN_K2_ONE_WAVE": "k1_in_k2_one_wave",
    "RLFP8_K1_IN_K2_W8A16_TOKENS": "k1_in_k2_w8a16_tokens",
    "RLFP8_K1_DECODE_SPLIT_MAX": "k1_decode_split_max",
    "RLFP8_ENGINE_GRAPH_QUANT": "engine_graph_quant",
    "RLFP8_BATCH_INVARIANT": "batch_invariant",
    "RLFP8_HOST_FAST": "host_fast",
}
ENV_VARS_BY_KNOB = {knob: var for var, knob in ENV_VARS.items()}
_NAMES = tuple(f.name for f in dataclasses.fields(KernelKnobs))
_CHOICES = {"backend": BACKENDS, "w8a16_widen": W8A16_WIDENINGS, "pdl": PDL_MODES, "pdl_w8a8_quant": PDL_W8A8_QUANT,
            "batch_invariant": BATCH_INVARIANT, "k1_decode_rank_block": K1_DECODE_RANK_BLOCKS,
            "k1_in_k2": K1_IN_K2, "k1_in_k2_one_wave": K1_IN_K2_ONE_WAVE, "k1_decode_split_max": K1_DECODE_SPLIT_MAX,
            "k2_prefetch_epilogue": K2_PREFETCH_EPILOGUE}
_FLAGS = ("gemm_rs", "k2_sync_a", "k2_dist_red", "k2_mask_x_rows", "host_fast",
          "tuned_nearest", "pdl_quant_k2", "k1_mask_x_rows", "engine_graph_quant")
_COUNTS = ("k2_quant_x_tokens", "k1_in_k2_tokens", "k1_in_k2_w8a16_tokens")
_INTS = _COUNTS + ("k1_decode_rank_block", "k1_decode_split_max")       # read from the environment as ints


def _validated(name: str, value, source: str):
    """The knob's value, or a ValueError naming the knob (as `source` spells it) and its allowed values."""
    if name not in _NAMES:
        raise ValueError(f"{source}: unknown kernel knob {name!r}; known knobs: {', '.join(_NAMES)}")
    if name in _CHOICES:
        if value not in _CHOICES[name]:
            raise ValueError(f"{source}={value!r}: allowed values are {_CHOICES[name]}")
    elif name in _FLAGS:
        if not isinstance(value, bool):
            raise ValueError(f"{source}={value!r}: allowed values are true, false")
    elif name == "fp8_precise_acc":
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{source}={value!r}: allowed values are null or a positive int (k elements)")
    elif name in _COUNTS:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{source}={value!r}: allowed values are an int >= 0 (tokens)")
    elif value is not None and not isinstance(value, str):
        raise ValueError(f"{source}={value!r}: allowed values are null or a GPU name (string)")
    return value


def _from_env(name: str, text: str):
    """Parse an environment variable's text into its knob's type (flags: "0" = false, anything else true)."""
    if name in _FLAGS:
        return text != "0"
    if name == "fp8_precise_acc":
        try:
            return int(text) if text else None
        except ValueError:
            raise ValueError(f"{ENV_VARS_BY_KNOB[name]}={text!r}: allowed values are unset or a positive int")
    if name in _INTS:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{ENV_VARS_BY_KNOB[name]}={text!r}: allowed values are ints")
    return text



def _env_overrides(environ=os.environ) -> dict:
    found = {}
    for var, name in ENV_VARS.items():
        if environ.get(var) is not None:
            found[name] = _validated(name, _from_env(name, environ[var]), var)
    return found


_ENV = _env_overrides()
_knobs = dataclasses.replace(KernelKnobs(), **_ENV)


def knobs() -> KernelKnobs:
    return _knobs


def set_knobs(**changes) -> KernelKnobs:
    """Change some knobs (validated; a ValueError names the knob and its allowed values); returns the old set,
    which `restore_knobs` puts back."""
    global _knobs
    checked = {name: _validated(name, value, f"kernel knob {name}") for name, value in changes.items()}
    old, _knobs = _knobs, dataclasses.replace(_knobs, **checked)
    return old


def restore_knobs(saved: KernelKnobs) -> None:
    global _knobs
    _knobs = saved


def check_section(section: dict) -> None:
    """Validate the config section `kernels` (a ValueError names kernels.<knob> and its allowed values)."""
    for name, value in section.items():
        _validated(name, value, f"kernels.{name}")


def apply_config(section: dict | None) -> KernelKnobs:
    """Set the knobs from the config section `kernels` (keys as in conf/kernels/default.yaml; missing keys
    take the defaults), then the environment overrides again. Returns the resulting knobs."""
    global _knobs
    section = dict(section or {})
    checked = {name: _validated(name, value, f"kernels.{name}") for name, value in section.items()}
    _knobs = dataclasses.replace(KernelKnobs(backend=_knobs.backend), **{**checked, **_ENV})
    return _knobs
