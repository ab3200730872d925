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


def _algo_choices() -> dict[str, tuple]:
    """The algo choice keys' allowed values, owned by the registries in rlfp8.algos."""
    from rlfp8 import algos
    return {
        "algo.advantage": tuple(algos.ESTIMATORS),
        "algo.scale_rewards": tuple(algos.SCALE_REWARDS),
        "algo.policy_loss": tuple(algos.POLICY_LOSSES),
        "algo.loss_agg": tuple(algos.AGG_MODES),
        "algo.correction": tuple(algos.CORRECTIONS),
        "algo.rollout_rs": (None,) + tuple(algos.ROLLOUT_RS_OPTIONS),
        "algo.kl_estimator": tuple(algos.KL_ESTIMATORS),
    }


# key -> allowed values (checked after composition)
CHOICES: dict[str, tuple] = {
    "model.dtype": ("bfloat16", "float32"),
    "engine.precision": ("bf16", "w8a8", "w8a16"),
    "trainer.weights": ("fp8", "bf16"),
    "trainer.kernels": ("auto", "triton", "torch"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "placement.name": ("two_copies", "offloaded"),
    "adapter.type": ("lora",),
    "logger.wandb.mode": ("auto", "online", "offline", "disabled"),
    **_algo_choices(),
}
POSITIVE_INT = ("steps", "adapter.rank", "algo.group_size", "algo.max_response_len", "data.prompts_per_step",
                "engine.max_model_len", "trainer.micro_batch_tokens", "trainer.mini_batches", "trainer.epochs",
                "trainer.logprob_chunk", "keep_checkpoints")
NON_NEGATIVE_INT = ("eval_every", "save_every", "seed", "trainer.warmup_steps", "trainer.num_threads")
POSITIVE_FLOAT = ("adapter.alpha", "algo.temperature", "trainer.lr", "algo.tis_cap", "trainer.grad_clip")


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
        GlobalHydra.instance().clear()
        # The base config with the same group choices: the set of keys a recipe may set.
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            base = hy_compose(config_name="config", overrides=[f"{g}={c}" for g, c in choices.items()])
    except Exception as e:          # Hydra's own message names the key / lists the options
        raise ConfigError(f"{type(e).__name__}: {e}") from None
    finally:
        GlobalHydra.instance().clear()
    with open_dict(cfg):
        del cfg["hydra"]
    with open_dict(cfg):
        cfg.recipe = rname
    _check_known_keys(cfg, base)
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
    from rlfp8.algos import RENAMED_CORRECTIONS
    if _get(cfg, "algo.correction") in RENAMED_CORRECTIONS:
        raise ConfigError(f"algo.correction={cfg.algo.correction!r}: {RENAMED_CORRECTIONS[cfg.algo.correction]}")
    for key, allowed in CHOICES.items():
        v = _get(cfg, key)
        if v not in allowed:
            raise ConfigError(f"{key}={v!r}: allowed values are {list(allowed)}")
    for key in POSITIVE_INT + NON_NEGATIVE_INT:
        v = _get(cfg, key)
        lo = 1 if key in POSITIVE_INT else 0
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ConfigError(f"{key}={v!r}: must be an integer >= {lo}")
    for key in POSITIVE_FLOAT:
        v = _get(cfg, key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{key}={v!r}: must be a number > 0")
    _validate_algo(cfg.algo)
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


def _number(a: DictConfig, key: str, ok, rule: str, nullable: bool = False) -> None:
    v = a[key]
    if v is None and nullable:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
        raise ConfigError(f"algo.{key}={v!r}: must be {rule}")


def _validate_algo(a: DictConfig) -> None:
    """Ranges and combinations of the algo keys (allowed choice values: CHOICES)."""
    _number(a, "clip_eps_low", lambda v: 0 <= v <= 1, "a number in [0, 1]")
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


def to_dict(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)
