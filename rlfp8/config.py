"""Config composition: a recipe (recipes/<name>.yaml, or a path to a user's copy) is a Hydra primary
config whose defaults start from conf/config.yaml and override groups; command-line overrides come
last. After composing, every key is checked: unknown keys (also in a recipe) and values outside the
allowed set fail with a message that names the key and the allowed values.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = Path(os.environ.get("RLFP8_CONF_DIR", REPO / "conf"))
RECIPES_DIR = Path(os.environ.get("RLFP8_RECIPES_DIR", REPO / "recipes"))
DEFAULT_RECIPE = "quickstart"


class ConfigError(ValueError):
    pass


# key -> allowed values (checked after composition)
CHOICES: dict[str, tuple] = {
    "model.dtype": ("bfloat16", "float32"),
    "engine.precision": ("bf16", "w8a8", "w8a16"),
    "trainer.weights": ("fp8", "bf16"),
    "trainer.kernels": ("auto", "triton", "torch"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "placement.name": ("two_copies", "offloaded"),
    "algo.advantage": ("grpo", "drgrpo", "rloo"),
    "algo.loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "algo.correction": ("none", "tis", "seq_tis", "token_mask", "seq_mask"),
    "algo.kl_estimator": ("k1", "k2", "k3"),
    "adapter.type": ("lora",),
    "logger.wandb.mode": ("auto", "online", "offline", "disabled"),
}
POSITIVE_INT = ("steps", "adapter.rank", "algo.group_size", "algo.max_response_len", "data.prompts_per_step",
                "engine.max_model_len", "trainer.micro_batch_tokens", "trainer.mini_batches", "trainer.epochs",
                "trainer.logprob_chunk", "keep_checkpoints")
NON_NEGATIVE_INT = ("eval_every", "save_every", "seed", "trainer.warmup_steps", "trainer.num_threads")
POSITIVE_FLOAT = ("adapter.alpha", "algo.temperature", "trainer.lr", "algo.tis_cap", "trainer.grad_clip",
                  "algo.std_eps", "engine.cpu_kv_cache_gb")
NON_NEGATIVE_FLOAT = ("algo.clip_eps_low", "algo.clip_eps_high", "algo.kl_coef", "trainer.weight_decay")
UNIT_INTERVAL = ("engine.top_p", "engine.gpu_memory_utilization")      # numbers in (0, 1]


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
    from hydra import compose as hy_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    recipe, rest = DEFAULT_RECIPE, []
    for o in overrides:
        if o.startswith("recipe="):
            recipe = o.split("=", 1)[1]
        else:
            rest.append(o)
    rdir, rname = _find_recipe(recipe)
    GlobalHydra.instance().clear()
    extra = [f"hydra.searchpath=[file://{CONF_DIR}]"] if rdir != CONF_DIR else []
    try:
        with initialize_config_dir(config_dir=str(rdir), version_base=None):
            cfg = hy_compose(config_name=rname, overrides=extra + rest, return_hydra_config=True)
        choices = {g: c for g, c in cfg.hydra.runtime.choices.items()
                   if not g.startswith("hydra") and (CONF_DIR / g).is_dir() and c is not None}
    except Exception as e:          # Hydra's own message names the key / lists the options
        raise ConfigError(f"{type(e).__name__}: {e}") from None
    finally:
        GlobalHydra.instance().clear()
    # The base config with the same group choices: the set of keys a recipe may set.
    base = _compose_base([f"{g}={c}" for g, c in choices.items()])
    with open_dict(cfg):
        del cfg["hydra"]
    with open_dict(cfg):
        cfg.recipe = rname
    _check_known_keys(cfg, base)
    validate(cfg)
    return cfg


def _compose_base(group_choices: list[str]) -> DictConfig:
    """conf/config.yaml with the given group choices ("model=tiny"), no recipe."""
    from hydra import compose as hy_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return hy_compose(config_name="config", overrides=group_choices)
    except Exception as e:          # Hydra's own message names the key / lists the options
        raise ConfigError(f"{type(e).__name__}: {e}") from None
    finally:
        GlobalHydra.instance().clear()


def with_new_defaults(saved: dict) -> dict:
    """A saved run's config plus the top-level keys added to conf/config.yaml since it was written."""
    base = to_dict(_compose_base([]))
    return {**{k: v for k, v in base.items() if k not in saved}, **saved}


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
    if recipe is not None and _find_recipe(recipe)[1] != saved.get("recipe"):
        return compose(overrides)
    cfg = OmegaConf.create(saved)
    for o in _parse_overrides(overrides):
        key = o.key_or_group
        if o.is_sweep_override() or o.is_delete():
            raise ConfigError(f"{o.input_line}: sweeps and deletions are not supported on resume")
        if "." not in key and (CONF_DIR / key).is_dir():
            cfg[key] = _compose_base([f"{key}={o.value()}"])[key]
        elif OmegaConf.select(cfg, key, default="???missing") == "???missing" and not o.is_add():
            raise ConfigError(f"unknown config key {key!r} in {o.input_line!r} (the saved config has no such key)")
        else:
            OmegaConf.update(cfg, key, o.value(), merge=False, force_add=o.is_add())
    validate(cfg)
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
    for key, allowed in CHOICES.items():
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
    _validate_algo(cfg)
    _validate_engine_and_trainer(cfg)
    _validate_data(cfg)
    if cfg.model.path in (None, "???"):
        raise ConfigError("model.path is not set: a local HF folder, a hub id, 'tiny' or gguf:smollm2-135m-instruct")
    if cfg.resume and not cfg.run_dir:
        raise ConfigError("resume=true needs run_dir=<the run's folder>")
    if cfg.engine.top_p != 1.0 or cfg.engine.top_k != -1:
        import logging
        logging.getLogger("rlfp8").warning(
            "engine.top_p/top_k truncate the sampling distribution; the trainer's log-probs do not, so the "
            "mismatch metrics and importance ratios include that truncation")
    if cfg.algo.max_response_len >= cfg.engine.max_model_len:
        raise ConfigError(f"algo.max_response_len={cfg.algo.max_response_len} must be < engine.max_model_len="
                          f"{cfg.engine.max_model_len} (prompt + response)")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _validate_algo(cfg: DictConfig) -> None:
    a = cfg.algo
    if a.clip_eps_low >= 1:
        raise ConfigError(f"algo.clip_eps_low={a.clip_eps_low}: must be < 1 (the ratio's lower bound 1 - eps "
                          f"must stay > 0)")
    if a.group_size < 2:
        raise ConfigError(f"algo.group_size={a.group_size}: algo.advantage={a.advantage} compares the samples "
                          f"of a prompt with each other, so it needs >= 2 per prompt")
    low = _get(cfg, "algo.tis_low")
    if low is not None and (not _is_number(low) or low <= 0 or low > a.tis_cap):
        raise ConfigError(f"algo.tis_low={low!r}: must be null (= 1 / algo.tis_cap) or a number in "
                          f"(0, algo.tis_cap={a.tis_cap}]")


def _validate_engine_and_trainer(cfg: DictConfig) -> None:
    from rlfp8.rollout.compat import VLLM_LORA_RANKS
    if cfg.adapter.rank > VLLM_LORA_RANKS[-1]:
        raise ConfigError(f"adapter.rank={cfg.adapter.rank}: the engine serves LoRA ranks up to "
                          f"{VLLM_LORA_RANKS[-1]} (vLLM's slot ranks {list(VLLM_LORA_RANKS)}; a rank in "
                          f"between uses the next slot)")
    top_k = _get(cfg, "engine.top_k")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or (top_k != -1 and top_k < 1):
        raise ConfigError(f"engine.top_k={top_k!r}: must be -1 (off) or an integer >= 1")
    betas = _get(cfg, "trainer.betas")
    if (not isinstance(betas, (list, tuple)) and not OmegaConf.is_list(betas)) or len(betas) != 2 \
            or not all(_is_number(b) and 0 <= b < 1 for b in betas):
        raise ConfigError(f"trainer.betas={betas!r}: must be two numbers in [0, 1)")


def _validate_data(cfg: DictConfig) -> None:
    from rlfp8.data.tasks import DataConfigError, resolve_config
    data = {k: v for k, v in to_dict(cfg.data).items() if k != "prompts_per_step"}
    try:
        resolve_config(data)
    except DataConfigError as e:
        raise ConfigError(str(e)) from None


def prompt_token_limit(cfg: dict) -> int:
    """Longest prompt a run accepts: data.max_prompt_tokens, capped by engine.max_model_len -
    algo.max_response_len (prompt + response must fit the engine's context). Longer prompts are
    dropped with a counted warning before the engine sees them (rlfp8.data.build_dataset)."""
    room = int(cfg["engine"]["max_model_len"]) - int(cfg["algo"]["max_response_len"])
    limit = cfg["data"].get("max_prompt_tokens")
    return room if limit is None else min(int(limit), room)


def to_dict(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)
