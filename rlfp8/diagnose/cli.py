"""rlfp8-diagnose: decompose the engine-trainer mismatch by scoring one fixed set of samples with every engine
precision and every trainer arm.

    rlfp8-diagnose                                           # recipe=diagnose: SmolLM2-135M, all precisions
    rlfp8-diagnose model=tiny diagnose.engines=[bf16,w8a16] diagnose.out_dir=/tmp/d
    rlfp8-diagnose diagnose.samples=/tmp/d diagnose.trainer_head_fp32=true     # the same tokens, one knob changed
    rlfp8-diagnose ... --debug                               # errors with their traceback

Steps: the first engine starts and samples (or the samples are loaded); while it is up every trainer arm
scores them (hidden states kept, each trainer freed after) and its pairs are measured -> every other engine,
started one at a time and freed before the next: its distribution at the scored positions and its pairs ->
the floor (bf16/bf16, HF/HF batch vs single, vLLM/vLLM batch vs single) -> console table, report.json,
report.png in diagnose.out_dir. Keys: conf/diagnose/default.yaml.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import time
import traceback
from pathlib import Path

log = logging.getLogger("rlfp8.diagnose")

DEFAULT_RECIPE = "diagnose"
ENGINE_DISTRIBUTIONS = ("capture", "vllm_full")
ENGINE_BATCH = ("batch", "single")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from rlfp8.config import ConfigError
    try:
        return run(argv)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        if debug:
            traceback.print_exception(e)
        print(f"rlfp8-diagnose: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


# ------------------------------------------------------------------ configuration
def overrides_with_recipe(argv: list[str]) -> list[str]:
    return argv if any(a.startswith("recipe=") for a in argv) else [f"recipe={DEFAULT_RECIPE}", *argv]


def check_knobs(cfg: dict) -> None:
    """diagnose.* values (the section is rlfp8-diagnose's own; conf/diagnose/default.yaml documents it)."""
    from rlfp8.config import ConfigError
    from rlfp8.rollout.compat import PRECISIONS
    from rlfp8.trainer.fp8_lora import WEIGHT_MODES
    d = cfg["diagnose"]
    lists = {"diagnose.engines": (d["engines"], PRECISIONS), "diagnose.trainers": (d["trainers"], WEIGHT_MODES)}
    for key, (values, allowed) in lists.items():
        if not isinstance(values, list) or not values or any(v not in allowed for v in values):
            raise ConfigError(f"{key}={values!r}: a non-empty list of {list(allowed)}")
    for key, allowed in (("engine_distribution", ENGINE_DISTRIBUTIONS), ("engine_batch", ENGINE_BATCH)):
        if d[key] not in allowed:
            raise ConfigError(f"diagnose.{key}={d[key]!r}: allowed values are {list(allowed)}")
    if d["random_model"] is not None:
        from rlfp8.models import ARCHITECTURES
        if d["random_model"] not in ARCHITECTURES:
            raise ConfigError(f"diagnose.random_model={d['random_model']!r}: allowed values are null or {list(ARCHITECTURES)}")
    for key in ("num_prompts", "samples_per_prompt", "chunk_tokens", "random_layers", "random_prompt_len"):
        if not isinstance(d[key], int) or isinstance(d[key], bool) or d[key] < 1:
            raise ConfigError(f"diagnose.{key}={d[key]!r}: must be an integer >= 1")
    if not cfg["engine"]["enforce_eager"] and d["engine_distribution"] == "capture":
        raise ConfigError("engine.enforce_eager=false: diagnose.engine_distribution=capture hooks the engine model's "
                          "modules, which fire only in eager mode; set engine.enforce_eager=true")
    if d["batch_invariant"] and not _cuda():
        raise ConfigError("diagnose.batch_invariant=true: vLLM's batch-invariant mode needs a CUDA GPU with compute "
                          "capability >= 9.0")


def arm_configs(base: dict, key: str, values: list[str]) -> tuple[dict, dict]:
    """value -> the composed config `base` with `key=value` (validated as a composition would: a value this
    machine cannot run -> the reason instead)."""
    import copy

    from omegaconf import OmegaConf

    from rlfp8.config import ConfigError, validate
    section, name = key.split(".")
    ok, skipped = {}, {}
    for v in values:
        arm = copy.deepcopy(base)
        arm[section][name] = v
        try:
            validate(OmegaConf.create(arm))
            ok[v] = arm
        except ConfigError as e:
            skipped[v] = " ".join(str(e).split())
    return ok, skipped


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def out_folder(cfg: dict) -> Path:
    from rlfp8.paths import REPO
    out = cfg["diagnose"]["out_dir"] or REPO / "runs" / f"diagnose-{time.strftime('%Y%m%d-%H%M%S')}"
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


# ------------------------------------------------------------------ engines, one at a time
def engine_overrides(cfg: dict, max_tokens_per_step: int) -> dict:
    """vLLM arguments of the knobs; max_num_batched_tokens fits all samples in one step (capture, batch mode)."""
    d = cfg["diagnose"]
    over = {"max_num_batched_tokens": max(max_tokens_per_step, int(cfg["engine"]["max_model_len"])),
            "enable_prefix_caching": False}
    if d["engine_distribution"] == "vllm_full":
        over["max_logprobs"] = -1
    if d["engine_head_fp32"]:
        over["hf_overrides"] = {"head_dtype": "float32"}
    if d["attention_backend"]:
        over["attention_backend"] = str(d["attention_backend"])
    return over


@contextlib.contextmanager
def started_engine(model_path: str, cfg: dict, overrides: dict):
    """A RolloutEngine for the duration of the block, then freed (gc; on a GPU the cache is emptied too)."""
    import torch

    from rlfp8.rollout.engine import RolloutEngine
    if cfg["diagnose"]["batch_invariant"]:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    engine = RolloutEngine(model_path, cfg, llm_overrides=overrides)
    try:
        yield engine
    finally:
        core = getattr(engine.llm.llm_engine, "engine_core", None)
        if hasattr(core, "shutdown"):
            core.shutdown()
        engine.llm = None          # the caller's `as` name outlives the block: vLLM goes here
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            log.info("engine %s freed: %.1f GiB free on the GPU", engine.precision, torch.cuda.mem_get_info()[0] / 2**30)


def score_engine(engine, samples, name: str, cfg: dict, one_at_a_time: bool):
    from .arms import score_engine_capture, score_engine_full_vocab
    d = cfg["diagnose"]
    if d["engine_distribution"] == "vllm_full":
        return score_engine_full_vocab(engine, samples, name, one_at_a_time)
    return score_engine_capture(engine, samples, name, one_at_a_time, int(d["chunk_tokens"]))


# ------------------------------------------------------------------ the run
def run(argv: list[str]) -> int:
    from rlfp8.config import compose_dict
    cfg = compose_dict(overrides_with_recipe(argv))
    check_knobs(cfg)
    d = cfg["diagnose"]
    out = out_folder(cfg)
    model_path = resolve_model_path(cfg)
    engines, skipped_engines = arm_configs(cfg, "engine.precision", d["engines"])
    trainers, skipped_trainers = arm_configs(cfg, "trainer.weights", d["trainers"])
    for v, why in {**skipped_engines, **skipped_trainers}.items():
        log.warning("skipped %s: %s", v, why)
    if not engines or not trainers:
        raise ValueError(f"diagnose: no engine ({skipped_engines}) or no trainer arm ({skipped_trainers}) can run here")
    t0 = time.time()
    samples, trainer_arms, hf_floor_arm, pairs, failed, vllm_floor = score_all(cfg, model_path, engines, trainers, out)
    from .decompose import build_report
    report = build_report(cfg, samples, pairs, trainer_arms, hf_floor_arm, vllm_floor,
                          {"engines": skipped_engines, "trainers": skipped_trainers}, failed, time.time() - t0)
    from rlfp8.provenance import command, versions
    report.update(command=command(), versions=versions())
    from . import report as rep
    print(rep.table(report["pairs"]))
    print(rep.floor_text(report["floor"]))
    print(rep.acceptance_text(report["acceptance"]))
    js, png = rep.write(out, report)
    print(f"rlfp8-diagnose: {len(report['pairs'])} pairs on {samples.num_tokens} tokens -> {js}, {png}")
    for name, why in failed.items():
        print(f"rlfp8-diagnose: {name} FAILED: {why.splitlines()[-1]}", file=sys.stderr)
    return 1 if failed else 0


def resolve_model_path(cfg: dict) -> str:
    """model.path's folder, or the random real-shape model of diagnose.random_model."""
    from rlfp8.trainer.hf_models import default_cache_dir, resolve_model
    d = cfg["diagnose"]
    if d["random_model"]:
        from .random_model import random_model_folder
        path = str(random_model_folder(d["random_model"], int(d["random_layers"]), cfg["cache_dir"] or default_cache_dir(),
                                       int(cfg["seed"]), "cuda" if _cuda() else "cpu"))
    else:
        path = str(resolve_model(cfg["model"]["path"], cfg["cache_dir"], seed=cfg["seed"]))
    cfg["model"]["resolved_path"] = path
    return path


def score_all(cfg: dict, model_path: str, engines: dict, trainers: dict, out: Path):
    """The first engine samples (unless diagnose.samples is given) and stays up while the trainer arms score
    the samples and its own pairs are measured (one engine start saved); then the other engines."""
    from .samples import Samples
    d = cfg["diagnose"]
    given = Samples.load(d["samples"]) if d["samples"] else None
    bound = (_total_len(given) if given else
             int(d["num_prompts"]) * int(d["samples_per_prompt"]) * int(cfg["engine"]["max_model_len"]))
    (first, first_cfg), rest = next(iter(engines.items())), dict(list(engines.items())[1:])
    single = d["engine_batch"] == "single"
    with started_engine(model_path, first_cfg, engine_overrides(first_cfg, bound)) as engine:
        samples = given or sampled(cfg, model_path, engine)
        check_samples(cfg, samples, out)
        trainer_arms, hf_floor_arm = score_trainers(model_path, trainers, samples, cfg)
        pairs, vllm_floor = engine_pairs(engine, first, first_cfg, trainer_arms, samples, single)
    more, failed, floor = score_engines(model_path, rest, trainer_arms, samples, cfg)
    return samples, trainer_arms, hf_floor_arm, pairs + more, failed, vllm_floor or floor


def sampled(cfg: dict, model_path: str, engine):
    """diagnose.samples_per_prompt answers to each of the first diagnose.num_prompts held-out prompts."""
    from .samples import generate_samples
    d = cfg["diagnose"]
    prompts = held_out_prompts(cfg, model_path)[: int(d["num_prompts"])]
    return generate_samples(engine, prompts, int(d["samples_per_prompt"]), int(cfg["algo"]["max_response_len"]),
                            int(cfg["seed"]))


def check_samples(cfg: dict, samples, out: Path) -> None:
    longest = max(len(s) for s in samples.sequences)
    if longest + 1 > int(cfg["engine"]["max_model_len"]):
        raise ValueError(f"engine.max_model_len={cfg['engine']['max_model_len']}: the longest sample has {longest} "
                         "tokens (+1 scored step); raise it")
    log.info("samples: %d sequences, %d scored tokens (%s) -> %s", len(samples.sequences), samples.num_tokens,
             samples.source, samples.save(out))


def held_out_prompts(cfg: dict, model_path: str) -> list[list[int]]:
    """The data's held-out prompts, rendered; random token ids for a random model (its tokenizer has no text)."""
    from transformers import AutoTokenizer
    d = cfg["diagnose"]
    if d["random_model"]:
        from rlfp8.models import architecture_config

        from .random_model import random_prompts
        vocab = int(architecture_config(d["random_model"])["vocab_size"])
        return random_prompts(vocab, int(d["num_prompts"]), int(d["random_prompt_len"]), int(cfg["seed"]))

    from rlfp8.config import prompt_token_limit
    from rlfp8.data import build_dataset, render_prompt
    from rlfp8.data.tasks import LOOP_KEYS
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dcfg = cfg["data"]
    spec = {k: v for k, v in dcfg.items() if k not in LOOP_KEYS}
    spec["max_prompt_tokens"] = prompt_token_limit(cfg)
    _, eval_set = build_dataset(spec, tokenizer=tokenizer)
    return [render_prompt(tokenizer, ex, dcfg["use_chat_template"], dcfg["system_prompt"]) for ex in eval_set]


def score_trainers(model_path: str, trainers: dict, samples, cfg: dict):
    """Every trainer arm (padded batch); the bf16 arm once more one sequence at a time: the HF/HF floor.
    Each trainer is freed before the next starts."""
    import torch

    from rlfp8.trainer.core import PolicyTrainer

    from .arms import score_trainer
    d = cfg["diagnose"]
    chunk, head32 = int(d["chunk_tokens"]), bool(d["trainer_head_fp32"])
    arms, floor_arm = {}, None
    for weights, tcfg in trainers.items():
        trainer = PolicyTrainer(model_path, tcfg)
        arms[weights] = score_trainer(trainer, samples, f"trainer_{weights}", False, head32, chunk)
        if weights == "bf16":
            floor_arm = score_trainer(trainer, samples, f"trainer_{weights}_single", True, head32, chunk)
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return arms, floor_arm


def score_engines(model_path: str, engines: dict, trainer_arms: dict, samples, cfg: dict):
    """Per engine (one at a time): its pairs with every trainer arm. A failing engine is recorded, the rest run."""
    single = cfg["diagnose"]["engine_batch"] == "single"
    pairs, failed, vllm_floor = [], {}, None
    for precision, arm_cfg in engines.items():
        try:
            with started_engine(model_path, arm_cfg, engine_overrides(arm_cfg, _total_len(samples))) as engine:
                found, floor = engine_pairs(engine, precision, arm_cfg, trainer_arms, samples, single)
            pairs += found
            vllm_floor = floor if floor is not None else vllm_floor
        except Exception:         # noqa: BLE001  (recorded in the report and the exit code, never hidden)
            failed[f"engine_{precision}"] = traceback.format_exc()[-4000:]
            log.error("engine %s failed:\n%s", precision, failed[f"engine_{precision}"])
    return pairs, failed, vllm_floor


def engine_pairs(engine, precision: str, arm_cfg: dict, trainer_arms: dict, samples, single: bool):
    """The engine's pair records (plain dicts: no reference to the engine survives this call, so it can be
    freed) and, for the bf16 engine, its other batch mode against this one (the vLLM/vLLM floor)."""
    from .decompose import pair_record
    chunk = int(arm_cfg["diagnose"]["chunk_tokens"])
    arm = score_engine(engine, samples, f"engine_{precision}", arm_cfg, single)
    pairs = [pair_record(arm, t, samples, chunk) for t in trainer_arms.values()]
    floor = None
    if precision == "bf16":
        other = score_engine(engine, samples, f"engine_bf16_{'batch' if single else 'single'}", arm_cfg, not single)
        floor = pair_record(arm, other, samples, chunk)
    return pairs, floor


def _total_len(samples) -> int:
    return sum(len(s) for s in samples.sequences)
