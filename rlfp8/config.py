"""Config composition and the schema of allowed values.

Who owns what (docs/ARCHITECTURE.md says why):
- the YAML under conf/ owns every key and its default, and documents each in a comment;
- this module owns what values are allowed: choice lists are read from the registries that implement
  them (rlfp8.algos, rlfp8.kernels.dispatch, rlfp8.placement, ...) so nothing is listed twice, plus
  ranges, cross-key rules, and UNAVAILABLE: the combinations that are not built or cannot run on this
  machine, rejected when the config is composed, naming the keys and what to use instead.
Code reads a composed config by subscripts only (`cfg["engine"]["max_model_len"]`, or a section
alias such as `ecfg = cfg["engine"]`; tests/unit/test_config.py lists the aliases), never with
`.get(key, default)`, so that every default stays in conf/.

A recipe (recipes/<name>.yaml, or a path to a user's copy) is a Hydra primary config whose defaults
start from conf/config.yaml and override groups; command-line overrides come last. Unknown keys
(also in a recipe) and values outside the allowed set fail with a message naming the key.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from rlfp8.paths import CONF_DIR, RECIPES_DIR, REPO  # noqa: F401  (REPO: the checkout, for callers)

DEFAULT_RECIPE = "quickstart"


class ConfigError(ValueError):
    pass


def choices() -> dict[str, tuple]:
    """key -> allowed values; read from the registries that implement them where one exists."""
    from rlfp8 import algos
    from rlfp8.kernels.dispatch import BACKENDS
    from rlfp8.logger import WANDB_MODES
    from rlfp8.placement import STRATEGIES
    from rlfp8.rollout.compat import PRECISIONS
    from rlfp8.trainer.adapters import ADAPTER_TYPES
    from rlfp8.trainer.fp8_lora import WEIGHT_MODES
    return {
        "model.dtype": ("auto", "bfloat16", "float32"),
        "engine.precision": PRECISIONS,
        "engine.release_kv": ("auto", True, False),
        "engine.release_weights": (True, False),
        "engine.enforce_eager": ("auto", True, False),
        "engine.compile": (True, False),
        "engine.parity_probe.overlap": ("auto", True, False),
        "trainer.weights": WEIGHT_MODES,
        "trainer.kernels": BACKENDS,
        "trainer.device": ("auto", "cpu", "cuda"),
        "placement.name": tuple(STRATEGIES),
        "algo.advantage": tuple(algos.ESTIMATORS),
        "algo.scale_rewards": tuple(algos.SCALE_REWARDS),
        "algo.policy_loss": tuple(algos.POLICY_LOSSES),
        "algo.loss_agg": tuple(algos.AGG_MODES),
        "algo.correction": tuple(algos.CORRECTIONS),
        "algo.rollout_rs": (None,) + tuple(algos.ROLLOUT_RS_OPTIONS),
        "algo.kl_estimator": tuple(algos.KL_ESTIMATORS),
        "adapter.type": ADAPTER_TYPES,
        "logger.wandb.mode": WANDB_MODES,
    }


POSITIVE_INT = ("steps", "adapter.rank", "algo.group_size", "algo.max_response_len", "data.prompts_per_step",
                "engine.max_model_len", "trainer.micro_batch_tokens", "trainer.mini_batches", "trainer.epochs",
                "trainer.logprob_chunk", "keep_checkpoints", "logger.console_every", "ray.num_pairs")
NON_NEGATIVE_INT = ("eval_every", "save_every", "seed", "trainer.warmup_steps", "trainer.num_threads",
                    "engine.parity_probe.every")
POSITIVE_FLOAT = ("adapter.alpha", "algo.temperature", "trainer.lr", "algo.tis_cap", "trainer.grad_clip",
                  "engine.parity_probe.factor", "algo.std_eps", "engine.cpu_kv_cache_gb")
NON_NEGATIVE_FLOAT = ("algo.clip_eps_low", "algo.clip_eps_high", "algo.kl_coef", "trainer.weight_decay",
                      "trainer.activation_headroom_gib")
UNIT_INTERVAL = ("engine.top_p", "engine.gpu_memory_utilization")      # numbers in (0, 1]

NOT_BUILT, NEEDS_CUDA = "not built yet", "needs a CUDA GPU and this machine has none"
UNSUPPORTED = "cannot work"


@dataclass(frozen=True)
class Unavailable:
    """A combination rejected at composition: every key=value in `when` holds and `reason` applies
    (UNSUPPORTED and NOT_BUILT: everywhere; NEEDS_CUDA: where torch sees no CUDA device)."""
    when: dict[str, Any]
    reason: str
    what: str
    instead: str

    def message(self) -> str:
        keys = " ".join(f"{k}={v}" for k, v in self.when.items())
        return f"{keys}: {self.what} {self.reason}; use {self.instead}"


# The one table of combinations that cannot run. Delete an entry when what it names lands.
UNAVAILABLE: tuple[Unavailable, ...] = (
    *(Unavailable({"placement.name": "one_copy", "engine.precision": p}, UNSUPPORTED, "(the trainer maps rlfp8's "
                  "FP8 codes, which this engine does not hold)", "engine.precision=w8a16 or w8a8, or "
                  "placement=two_copies") for p in ("bf16", "w8a8_vllm")),
    Unavailable({"placement.name": "one_copy", "trainer.weights": "bf16"}, UNSUPPORTED, "(the shared base is FP8)",
                "trainer.weights=fp8, or placement=two_copies / offloaded for the 16-bit arm"),
    *(Unavailable({"adapter.type": "dora", "engine.precision": p}, UNSUPPORTED, "(vLLM's own LoRA kernels "
                  "cannot serve DoRA)", "engine.precision=w8a16 (the matched engine) or w8a8: rlfp8's kernels "
                  "apply DoRA's column scale in the GEMM epilogue") for p in ("bf16", "w8a8_vllm")),
    Unavailable({"engine.precision": "w8a8_vllm"}, NEEDS_CUDA, "w8a8_vllm (vLLM's fp8_per_channel, no CPU kernels)",
                "engine.precision=w8a8 (rlfp8's kernels, torch references on the CPU), w8a16 or bf16"),
    Unavailable({"trainer.device": "cuda"}, NEEDS_CUDA, "trainer.device=cuda", "trainer.device=auto or cpu"),
    *(Unavailable({"engine.release_weights": True, "engine.precision": p}, UNSUPPORTED, "(rlfp8's engines keep "
                  "their FP8 weights outside vLLM's cuMem pool, so that one_copy can map them)", "placement=one_copy "
                  "(one FP8 copy for both roles), or engine.release_weights=false") for p in ("w8a16", "w8a8")),
    Unavailable({"engine.release_weights": True, "engine.release_kv": False}, UNSUPPORTED, "(the weights go after "
                "the KV cache, through the same sleep mode)", "engine.release_kv=auto or true"),
    Unavailable({"engine.release_weights": True}, NEEDS_CUDA, "engine.release_weights (vLLM's sleep mode: its cuMem "
                "allocator)", "engine.release_weights=false"),
)


def native_bf16() -> tuple[bool, str]:
    """Does this machine compute in bfloat16 natively? A CUDA GPU with bf16, or a CPU with AVX512-BF16 or
    AMX-BF16; elsewhere (e.g. an AVX2-only CPU) torch and vLLM emulate bf16 several times slower than float32."""
    import torch
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported(), f"GPU {torch.cuda.get_device_name()}"
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    native = bool(flags & {"avx512_bf16", "amx_bf16"})
    return native, "CPU with " + ("avx512_bf16/amx_bf16" if native else "no avx512_bf16/amx_bf16")


CPU_MICRO_BATCH_TOKENS, GPU_MICRO_BATCH_TOKENS = 2048, 8192   # trainer.micro_batch_tokens=auto


def resolve_auto(cfg: DictConfig) -> None:
    """model.dtype=auto -> bfloat16 where the machine computes it natively, float32 elsewhere;
    trainer.micro_batch_tokens=auto -> 2048 on a CPU (activation memory), 8192 on a GPU;
    engine.parity_probe.overlap=auto -> on a GPU only. Resolved once,
    here, so the engine and the trainer (and a resumed run, which reads the saved config) use one dtype."""
    if cfg.model.dtype == "auto":
        native, where = native_bf16()
        cfg.model.dtype = "bfloat16" if native else "float32"
        print(f"[rlfp8] model.dtype=auto -> {cfg.model.dtype} ({where})", flush=True)
    if cfg.trainer.micro_batch_tokens == "auto":      # GPU: one large micro-batch (small ones are host-bound)
        cfg.trainer.micro_batch_tokens = GPU_MICRO_BATCH_TOKENS if cuda_available() else CPU_MICRO_BATCH_TOKENS
    if cfg.engine.parity_probe.overlap == "auto":     # CPU: the trainer's scoring would take the engine's cores
        cfg.engine.parity_probe.overlap = cuda_available()


def cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def _find_recipe(recipe: str) -> tuple[Path, str]:
    p = Path(recipe).expanduser()
    if p.suffix in (".yaml", ".yml"):
        if not p.exists():
            raise ConfigError(f"recipe={recipe}: file not found")
        return p.resolve().parent, p.stem
    if (RECIPES_DIR / f"{recipe}.yaml").exists():
        return RECIPES_DIR, recipe
    known = sorted(f.stem for f in RECIPES_DIR.glob("*.yaml"))
    raise ConfigError(f"recipe={recipe!r}: allowed values are {known} or a path to a .yaml file")


def compose(overrides: list[str]) -> DictConfig:
    """Compose recipe + overrides (Hydra's compose API: no working-directory change, no output dir)."""
    recipe, rest = DEFAULT_RECIPE, []
    for o in overrides:
        if o.startswith("recipe="):
            recipe = o.split("=", 1)[1]
        else:
            rest.append(o)
    rdir, rname = _find_recipe(recipe)
    cfg, base = _hydra_compose(rdir, rname, rest)
    with open_dict(cfg):
        del cfg["hydra"]
        cfg.recipe = rname
    _check_known_keys(cfg, base)
    resolve_auto(cfg)
    validate(cfg)
    return cfg


def _hydra_compose(rdir: Path, rname: str, overrides: list[str]) -> tuple[DictConfig, DictConfig]:
    """The recipe composed with the overrides, and the base config with the same group choices
    (the set of keys a recipe may set)."""
    from hydra import compose as hy_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    GlobalHydra.instance().clear()
    extra = [f"hydra.searchpath=[file://{CONF_DIR}]"] if rdir != CONF_DIR else []
    try:
        with initialize_config_dir(config_dir=str(rdir), version_base=None):
            cfg = hy_compose(config_name=rname, overrides=extra + overrides, return_hydra_config=True)
        groups = {g: c for g, c in cfg.hydra.runtime.choices.items()
                  if not g.startswith("hydra") and (CONF_DIR / g).is_dir() and c is not None}
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            base = hy_compose(config_name="config", overrides=[f"{g}={c}" for g, c in groups.items()])
    except Exception as e:          # Hydra's own message names the key / lists the options
        raise ConfigError(f"{type(e).__name__}: {e}") from None
    finally:
        GlobalHydra.instance().clear()
    return cfg, base


def base_config(groups: dict[str, str] | None = None) -> DictConfig:
    """conf/config.yaml with its default group choices (or `groups`), not validated."""
    cfg, _ = _hydra_compose(CONF_DIR, "config", [f"{g}={c}" for g, c in (groups or {}).items()])
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def _check_known_keys(cfg: DictConfig, base: DictConfig, prefix: str = "") -> None:
    """Keys a recipe adds that the base config does not know are typos: fail, naming them."""
    for k in cfg.keys():
        if prefix == "" and k in ("recipe", "hydra"):
            continue
        full = f"{prefix}{k}"
        if k not in base:
            raise ConfigError(f"unknown config key {full!r} (from the recipe); known keys here: {sorted(base.keys())}")
        v, b = cfg[k], base[k]
        if isinstance(v, DictConfig) and isinstance(b, DictConfig):
            _check_known_keys(v, b, full + ".")


def _get(cfg, key):
    return OmegaConf.select(cfg, key, default=None)


def validate(cfg: DictConfig) -> None:
    _check_values(cfg)
    _check_kernel_knobs(cfg)
    _check_rules(cfg)
    _check_data(cfg)
    _check_available(cfg)


def _check_kernel_knobs(cfg: DictConfig) -> None:
    from rlfp8.kernels.knobs import check_section
    try:
        check_section(OmegaConf.to_container(cfg.kernels, resolve=True))
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


def _check_values(cfg: DictConfig) -> None:
    from rlfp8.algos import RENAMED_CORRECTIONS
    if _get(cfg, "algo.correction") in RENAMED_CORRECTIONS:
        raise ConfigError(f"algo.correction={cfg.algo.correction!r}: {RENAMED_CORRECTIONS[cfg.algo.correction]}")
    for key, allowed in choices().items():
        v = _get(cfg, key)
        if v not in allowed:
            raise ConfigError(f"{key}={v!r}: allowed values are {list(allowed)}")
    for key in POSITIVE_INT + NON_NEGATIVE_INT:
        v = _get(cfg, key)
        lo = 1 if key in POSITIVE_INT else 0
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ConfigError(f"{key}={v!r}: must be an integer >= {lo}")
    for key in POSITIVE_FLOAT + NON_NEGATIVE_FLOAT:
        v = _get(cfg, key)
        strict = key in POSITIVE_FLOAT
        if not _is_number(v) or v < 0 or (strict and v == 0):
            raise ConfigError(f"{key}={v!r}: must be a number {'>' if strict else '>='} 0")
    for key in UNIT_INTERVAL:
        v = _get(cfg, key)
        if not _is_number(v) or not 0 < v <= 1:
            raise ConfigError(f"{key}={v!r}: must be a number in (0, 1]")
    from rlfp8.trainer.checkpointing import parse_mode
    try:
        parse_mode(_get(cfg, "trainer.gradient_checkpointing"))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_rules(cfg: DictConfig) -> None:
    _validate_algo(cfg.algo)
    _validate_run_values(cfg)
    if cfg.model.path in (None, "???"):
        raise ConfigError("model.path is not set: a local HF folder, a hub id, 'tiny', random:<arch> or "
                          "gguf:smollm2-135m-instruct")
    _check_random_model(cfg)
    if not cfg.adapter.target_modules:
        raise ConfigError("adapter.target_modules is empty: list the projections to adapt (e.g. [q_proj, v_proj])")
    if cfg.resume and not cfg.run_dir:
        raise ConfigError("resume=true needs run_dir=<the run's folder>")
    if cfg.engine.top_p != 1.0 or cfg.engine.top_k != -1:
        import logging
        logging.getLogger("rlfp8").warning(
            "engine.top_p/top_k truncate the sampling distribution; the trainer's log-probs do not, so the "
            "mismatch metrics and importance ratios include that truncation")
    if cfg.engine.parity_probe.size < 1 or cfg.engine.parity_probe.abs_tol < 0:
        raise ConfigError("engine.parity_probe.size must be >= 1 and engine.parity_probe.abs_tol >= 0")
    if cfg.engine.release_weights and cfg.placement.name == "offloaded" and cfg.engine.parity_probe.every:
        raise ConfigError("engine.release_weights=true with placement=offloaded needs engine.parity_probe.every=0: "
                          "the probe's trainer side scores on the device-resident base while the engine's KV cache "
                          "is mapped, and the two do not fit together there (that is why the weights go to the host)")
    if cfg.algo.max_response_len >= cfg.engine.max_model_len:
        raise ConfigError(f"algo.max_response_len={cfg.algo.max_response_len} must be < engine.max_model_len="
                          f"{cfg.engine.max_model_len} (prompt + response)")


def _check_random_model(cfg: DictConfig) -> None:
    """model.path=random:<arch>: the architecture exists (rlfp8/models/<arch>.json or a .json path), and a layer
    count in trainer.gradient_checkpointing is within its decoder layers."""
    from rlfp8.models import RANDOM_PREFIX, architecture_config, is_random
    from rlfp8.trainer.checkpointing import parse_mode
    if is_random(cfg.model.path):
        try:
            arch = architecture_config(cfg.model.path[len(RANDOM_PREFIX):])
            parse_mode(_get(cfg, "trainer.gradient_checkpointing"), arch["num_hidden_layers"])
        except ValueError as e:
            raise ConfigError(f"{e} (model.path={cfg.model.path})" if "gradient_checkpointing" in str(e)
                              else str(e)) from None


def _check_data(cfg: DictConfig) -> None:
    """data.* values: rlfp8.data owns them (tasks.resolve_config); checked here, before Ray starts."""
    from rlfp8.data import DataConfigError, resolve_config
    from rlfp8.data.tasks import LOOP_KEYS
    try:
        resolve_config({k: v for k, v in cfg.data.items() if k not in LOOP_KEYS})
    except DataConfigError as e:
        raise ConfigError(str(e)) from None


def _check_available(cfg: DictConfig) -> None:
    for entry in UNAVAILABLE:
        if all(_get(cfg, k) == v for k, v in entry.when.items()):
            if entry.reason != NEEDS_CUDA or not cuda_available():
                raise ConfigError(entry.message())


def _number(a: DictConfig, key: str, ok, rule: str, nullable: bool = False) -> None:
    v = a[key]
    if v is None and nullable:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
        raise ConfigError(f"algo.{key}={v!r}: must be {rule}")


def _validate_algo(a: DictConfig) -> None:
    """Ranges and combinations of the algo keys (allowed choice values: CHOICES)."""
    _number(a, "clip_eps_low", lambda v: 0 <= v < 1, ">= 0 and must be < 1 (the ratio's lower bound 1 - eps must "
            "stay > 0)")
    _number(a, "clip_eps_high", lambda v: v >= 0, "a number >= 0")
    _number(a, "clip_ratio_c", lambda v: v > 1, "a number > 1 (verl's dual-clip bound) or null (off)", nullable=True)
    _number(a, "std_eps", lambda v: v >= 0, "a number >= 0")
    _number(a, "tis_low", lambda v: 0 <= v <= a.tis_cap, f"null or a number in [0, algo.tis_cap={a.tis_cap}]",
            nullable=True)
    for key in ("kl_coef", "entropy_coeff"):
        _number(a, key, lambda v: v >= 0, "a number >= 0")
    for key in ("rollout_is_batch_normalize", "drop_rejected_from_denominator", "use_bias_correction_kl"):
        if not isinstance(a[key], bool):
            raise ConfigError(f"algo.{key}={a[key]!r}: must be true or false")
    if a.scale_rewards != "group" and a.advantage != "grpo":
        raise ConfigError(f"algo.scale_rewards={a.scale_rewards!r} applies to algo.advantage=grpo only "
                          f"(got algo.advantage={a.advantage!r})")
    if a.rollout_is_batch_normalize and a.correction == "none":
        raise ConfigError("algo.rollout_is_batch_normalize=true needs a weighting algo.correction (not 'none')")
    if a.rollout_rs is not None:
        from rlfp8.algos import parse_rollout_rs_threshold
        try:
            parse_rollout_rs_threshold(a.rollout_rs, a.rollout_rs_threshold)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    elif a.rollout_rs_threshold is not None:
        raise ConfigError(f"algo.rollout_rs_threshold={a.rollout_rs_threshold!r} is set but algo.rollout_rs is null")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _validate_run_values(cfg: DictConfig) -> None:
    """Values that would fail late inside an actor (issue 19): checked before anything starts."""
    a = cfg.algo
    if a.group_size < 2:
        raise ConfigError(f"algo.group_size={a.group_size}: algo.advantage={a.advantage} compares the samples "
                          f"of a prompt with each other, so it needs >= 2 per prompt")
    if a.tis_low is not None and a.tis_low <= 0:
        raise ConfigError(f"algo.tis_low={a.tis_low!r}: must be null (= 1 / algo.tis_cap) or a number in "
                          f"(0, algo.tis_cap={a.tis_cap}]")
    from rlfp8.rollout.compat import VLLM_LORA_RANKS
    if cfg.adapter.rank > VLLM_LORA_RANKS[-1]:
        raise ConfigError(f"adapter.rank={cfg.adapter.rank}: the engine serves LoRA ranks up to "
                          f"{VLLM_LORA_RANKS[-1]} (vLLM's slot ranks {list(VLLM_LORA_RANKS)}; a rank in "
                          f"between uses the next slot)")
    _validate_ray(cfg)
    top_k = _get(cfg, "engine.top_k")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or (top_k != -1 and top_k < 1):
        raise ConfigError(f"engine.top_k={top_k!r}: must be -1 (off) or an integer >= 1")
    betas = _get(cfg, "trainer.betas")
    if (not isinstance(betas, (list, tuple)) and not OmegaConf.is_list(betas)) or len(betas) != 2 \
            or not all(_is_number(b) and 0 <= b < 1 for b in betas):
        raise ConfigError(f"trainer.betas={betas!r}: must be two numbers in [0, 1)")


def _validate_ray(cfg: DictConfig) -> None:
    """ray.address: null | auto | host:port (or ray://host:port); ray.num_pairs <= data.prompts_per_step."""
    import re
    address = _get(cfg, "ray.address")
    if address is not None and (not isinstance(address, str)
                                or not (address == "auto" or re.fullmatch(r"(ray://)?[\w.\-]+:\d+", address))):
        raise ConfigError(f"ray.address={address!r}: must be null (start a local Ray), auto (join the running "
                          f"cluster) or host:port")
    if cfg.ray.num_pairs > cfg.data.prompts_per_step:
        raise ConfigError(f"ray.num_pairs={cfg.ray.num_pairs} is more than data.prompts_per_step="
                          f"{cfg.data.prompts_per_step}: every pair needs at least one prompt per step")


def prompt_token_limit(cfg: dict) -> int:
    """Longest prompt a run accepts: data.max_prompt_tokens, capped by engine.max_model_len -
    algo.max_response_len (prompt + response must fit the engine's context). Longer prompts are
    dropped with a counted warning before the engine sees them (rlfp8.data.build_dataset)."""
    room = int(cfg["engine"]["max_model_len"]) - int(cfg["algo"]["max_response_len"])
    limit = cfg["data"]["max_prompt_tokens"]
    return room if limit is None else min(int(limit), room)


# ------------------------------------------------------------------ resume: the saved config + the given overrides
def with_new_defaults(saved: dict) -> dict:
    """A saved run's config plus the keys added to conf/config.yaml since it was written: top-level keys, and
    keys of its own sections (ray.num_pairs, ...; a config group's section is the saved choice's, kept)."""
    base = to_dict(base_config())
    merged = {**{k: v for k, v in base.items() if k not in saved}, **saved}
    for k, v in base.items():
        if isinstance(v, dict) and isinstance(saved.get(k), dict) and not (CONF_DIR / k).is_dir():
            merged[k] = {**{sk: sv for sk, sv in v.items() if sk not in saved[k]}, **saved[k]}
    return merged


def _parse_overrides(overrides: list[str]) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    try:
        return OverridesParser.create().parse_overrides([o for o in overrides if not o.startswith("recipe=")])
    except Exception as e:          # noqa: BLE001 - Hydra's grammar errors name the override
        raise ConfigError(f"{type(e).__name__}: {e}") from None


def command_line_value(overrides: list[str], key: str, default: Any = None) -> Any:
    """The value the command line gives `key` (the last one wins), without composing: a resume must
    not be validated against the default recipe's values."""
    values = [o.value() for o in _parse_overrides(overrides) if o.key_or_group == key and not o.is_delete()]
    return values[-1] if values else default


def compose_resume(saved: dict, overrides: list[str]) -> DictConfig:
    """Resume: the saved (resolved) config is the source of truth and only `overrides` are applied to
    it: `key=value` sets a key, `group=choice` replaces that group's subtree by the choice's file. A
    different `recipe=` composes afresh (the caller refuses that without force=true)."""
    recipe = next((o.split("=", 1)[1] for o in overrides if o.startswith("recipe=")), None)
    if recipe is not None and _find_recipe(recipe)[1] != saved["recipe"]:
        return compose(overrides)
    cfg = OmegaConf.create(saved)
    for o in _parse_overrides(overrides):
        key = o.key_or_group
        if o.is_sweep_override() or o.is_delete():
            raise ConfigError(f"{o.input_line}: sweeps and deletions are not supported on resume")
        if "." not in key and (CONF_DIR / key).is_dir():
            cfg[key] = base_config({key: o.value()})[key]
        elif OmegaConf.select(cfg, key, default="???missing") == "???missing" and not o.is_add():
            raise ConfigError(f"unknown config key {key!r} in {o.input_line!r} (the saved config has no such key)")
        else:
            OmegaConf.update(cfg, key, o.value(), merge=False, force_add=o.is_add())
    resolve_auto(cfg)
    validate(cfg)
    return cfg


def to_dict(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)


def compose_dict(overrides: list[str]) -> dict[str, Any]:
    """compose + to_dict: the plain dict the actors receive."""
    return to_dict(compose(overrides))
