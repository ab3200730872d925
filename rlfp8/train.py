"""rlfp8-train: one RL run from a Hydra recipe.

    rlfp8-train recipe=quickstart                       # the embedded default (CPU-capable)
    rlfp8-train recipe=quickstart model=tiny steps=3    # any key can be overridden
    rlfp8-train ... resume=true run_dir=runs/my-run     # continue after a crash (its config.yaml is the config)
    rlfp8-train ... --debug                             # errors with their traceback (also debug=true)

The loop reads as a recipe: setup, then per step rollout (engine samples algo.group_size answers per
prompt, with their log-probs) -> score (rewards, group advantages) -> update (one GRPO update of the
adapter) -> sync (the new adapter goes to the engine) -> log, evaluate, checkpoint; then finish.
Design choices:
- Checks a sync starts (the parity probe's two scorings, one_copy's base checksums) run beside the next
  rollout (engine.parity_probe.overlap, on a GPU) and settle before the next update, a checkpoint or the
  end: nothing is trained, saved or reported on an unchecked sync, and the probe's wait leaves the step.
- The driver holds the tokenizer, the prompt stream and the rewards; the actors hold the model; the
  placement (rlfp8.placement) owns what happens around the phases.
- Metrics of every step go to metrics.jsonl, W&B and the console; the resolved config sits next to
  them (config.yaml). A held-out eval (greedy, one answer per prompt) runs before training, every
  `eval_every` steps and at the end.
- Checkpoints (adapter in PEFT format, optimizer, RNG, data cursor, step) every `save_every` steps
  and at the end; `resume=true run_dir=...` continues from the latest complete one. The run folder
  (lock, config on resume, checkpoints, scratch) is rlfp8.run_folder.RunFolder's.
- The engine samples step s from seeds that depend only on (seed, s): a resumed run repeats the
  uninterrupted one.
- ray.num_pairs > 1: the placement is rlfp8.placement.pairs.Pairs, N engine + trainer pairs; prompts are
  sharded over the pairs, rewards and advantages are computed here over the whole batch, the trainers sum
  their gradients (one update, equal adapters, checked every step). Pair 0 writes the checkpoints; a
  resume needs the same N.
- Mistakes a user can fix (config, data, run folder, model path) exit 2 with one line; a failed parity
  probe (the engine does not compute with the trainer's adapter) exits 3.
"""
from __future__ import annotations

import json
import logging
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfp8.profiling import phase

log = logging.getLogger("rlfp8")


@dataclass
class Run:
    """What the steps share: the config, the run folder, the data, the logger and the placement."""
    cfg: dict
    folder: Any                        # rlfp8.run_folder.RunFolder (locked)
    run_dir: Path
    tokenizer: Any
    train_stream: Any
    eval_set: Any
    logger: Any
    placement: Any
    scratch_dir: Path
    probe: Any = None                  # rlfp8.parity.ParityProbe (None: engine.parity_probe.every=0)
    probe_lora_dtype: Any = None       # the dtype the engine's LoRA slots hold (the probe's checksums cast to it)
    pending_probe: Any = None          # PendingProbe started at the last sync, until settle()
    start_step: int = 0
    t_start: float = field(default_factory=time.time)
    memory: dict = field(default_factory=dict)       # the last memory/<phase>/* metrics (the plan of an OOM error)
    first_rewards: list = field(default_factory=list)
    last_rewards: list = field(default_factory=list)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    debug = "--debug" in argv or any(a.lower() in ("debug=true", "debug=1") for a in argv)
    argv = [a for a in argv if a != "--debug"] + (["debug=true"] if "--debug" in argv else [])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("httpx", "filelock", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from rlfp8.memory_plan import OutOfMemoryPlanError
    from rlfp8.parity import ParityError
    from rlfp8.run_folder import RunFolder
    try:
        folder, cfg = RunFolder.start(argv)
        return run(cfg, folder)
    except _user_errors() as e:
        return _report_user_error(e, debug)
    except ParityError as e:
        print(f"rlfp8-train: stopped: {e}", file=sys.stderr)
        return 3
    except OutOfMemoryPlanError as e:
        print(f"rlfp8-train: {e}", file=sys.stderr)
        return 4


def _user_errors() -> tuple[type[BaseException], ...]:
    from rlfp8.config import ConfigError
    from rlfp8.data import DataConfigError, MissingPackageError, PromptTooLongError
    return ConfigError, DataConfigError, MissingPackageError, PromptTooLongError


def _report_user_error(e: BaseException, debug: bool) -> int:
    """One line naming the problem (exit 2); the traceback only with debug=true / --debug."""
    from rlfp8.config import ConfigError
    from rlfp8.run_folder import RunFolderError
    if debug:
        traceback.print_exception(e)
    cause = getattr(e, "cause", None) or e          # an actor's error arrives wrapped (RayTaskError)
    kind = ("run folder" if isinstance(cause, RunFolderError) else "config error" if isinstance(cause, ConfigError)
            else "data error")
    hint = "" if debug else "  (--debug shows the traceback)"
    print(f"rlfp8-train: {kind}: {' '.join(str(cause).split())}{hint}", file=sys.stderr)
    return 2


def run(cfg: dict, folder) -> int:
    """One run in `folder` (a locked rlfp8.run_folder.RunFolder; cfg from RunFolder.start)."""
    t_start = time.time()
    resume_from, driver_state = folder.resume_point()
    if resume_from is not None:
        check_num_pairs(cfg, resume_from, driver_state)
    r = setup(cfg, folder, resume_from is not None)
    r.t_start = t_start
    if resume_from is not None:
        restore(r, resume_from, driver_state)
    eval_first = evaluate(r, r.start_step) if r.start_step == 0 else None
    from tqdm import tqdm
    bar = tqdm(range(r.start_step, cfg["steps"]), desc="rl", unit="step", initial=r.start_step,
               total=cfg["steps"], dynamic_ncols=True, file=sys.stderr)
    for step in bar:
        metrics = rl_step(r, step, bar)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kl_k3=f"{metrics.get('mismatch/kl_k3', 0):.2e}")
        done = step + 1 == cfg["steps"]
        if cfg["eval_every"] and (step + 1) % cfg["eval_every"] == 0 and not done:
            bar.set_description(f"step {step + 1}: eval")
            evaluate(r, step + 1)
        if done or (cfg["save_every"] and (step + 1) % cfg["save_every"] == 0):
            bar.set_description(f"step {step + 1}: checkpoint")
            save_checkpoint(r, step + 1)
    bar.close()
    finish(r, eval_first)
    return 0


# ---------------------------------------------------------------------------------------- setup
def setup(cfg: dict, folder, resuming: bool) -> Run:
    """Model folder, tokenizer, data, logger, and the placement with its two actors."""
    from transformers import AutoTokenizer

    from rlfp8.config import ConfigError, prompt_token_limit
    from rlfp8.data import build_dataset
    from rlfp8.data.tasks import LOOP_KEYS
    from rlfp8.logger import RunLogger
    from rlfp8.placement.pairs import Pairs
    from rlfp8.trainer.hf_models import resolve_model

    run_dir = folder.path
    try:
        model_path = str(resolve_model(cfg["model"]["path"], cfg["cache_dir"], seed=cfg["seed"]))
    except (OSError, ValueError, ImportError, RuntimeError) as e:
        if not str(e).startswith("model"):       # resolve_model's own messages name model.path
            raise
        raise ConfigError(str(e)) from e
    cfg["model"]["resolved_path"] = model_path
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    data_spec = {k: v for k, v in cfg["data"].items() if k not in LOOP_KEYS}
    data_spec["max_prompt_tokens"] = prompt_token_limit(cfg)
    train_stream, eval_set = build_dataset(data_spec, tokenizer=tokenizer)
    lcfg = cfg["logger"]
    logger = RunLogger(run_dir, config=cfg, wandb_mode=lcfg["wandb"]["mode"], project=lcfg["wandb"]["project"],
                       name=lcfg["wandb"]["name"] or run_dir.name, resume=resuming,
                       console_every=lcfg["console_every"])
    scratch_dir = folder.scratch_dir()
    from rlfp8.memory_plan import on_out_of_memory
    from rlfp8.placement.ray_setup import NotEnoughGPUsError
    try:
        with on_out_of_memory("setup", cfg, {}):
            placement = Pairs(cfg, model_path, str(scratch_dir))
    except NotEnoughGPUsError as e:
        raise ConfigError(str(e)) from None
    r = Run(cfg, folder, run_dir, tokenizer, train_stream, eval_set, logger, placement, scratch_dir)
    r.probe = make_probe(r)
    return r


def render(r: Run, example) -> list[int]:
    from rlfp8.data import render_prompt
    return render_prompt(r.tokenizer, example, r.cfg["data"]["use_chat_template"], r.cfg["data"]["system_prompt"])


# ---------------------------------------------------------------------------------------- one step
def rl_step(r: Run, step: int, bar) -> dict[str, float]:
    """rollout -> score -> update -> sync, timed; logs the step's metrics and returns them. The memory of each
    phase is logged as memory/<phase>/* (GPU); an out-of-memory error shows the plan (rlfp8.memory_plan)."""
    from rlfp8.memory_plan import on_out_of_memory, phase_metrics
    from rlfp8.placement import call
    r.placement.take_move_times()        # the step's own moves only (an eval before it moved things too)
    t0 = time.time()
    bar.set_description(f"step {step + 1}: rollout")
    with on_out_of_memory("rollout", r.cfg, r.memory):
        examples, prompt_ids, samples = rollout(r, step)
    r.memory.update(phase_metrics("rollout", call(r.placement.engine.memory)))
    t_roll = time.time() - t0
    with phase("driver/reward"):
        rewards, batch = score(r, examples, prompt_ids, samples)
    settled = settle(r)              # the last sync's checks (they ran beside this rollout)
    bar.set_description(f"step {step + 1}: train")
    t1 = time.time()
    with on_out_of_memory("train", r.cfg, r.memory):
        metrics = update(r, batch)
    metrics.update(settled)
    r.memory.update(phase_metrics("train", {k: metrics.pop(k) for k in list(metrics) if k.startswith("memory/")}))
    t_train = time.time() - t1
    bar.set_description(f"step {step + 1}: sync")
    t2 = time.time()
    with on_out_of_memory("sync", r.cfg, r.memory):
        metrics.update(sync(r, step + 1))
    t_sync = time.time() - t2
    metrics.update(rollout_metrics(r, rewards, samples))
    metrics.update(r.placement.take_move_times())
    metrics.update({"time/rollout": t_roll, "time/train": t_train, "time/sync": t_sync,
                    "time/step": time.time() - t0,
                    "rollout/tokens_per_s": sum(len(s.token_ids) for s in samples) / max(t_roll, 1e-9),
                    "data/prompts_dropped": r.train_stream.num_dropped})
    with phase("driver/log"):
        r.memory.update(phase_metrics("sync", call(r.placement.engine.memory)))
        metrics.update(r.memory)
        r.logger.log(step + 1, metrics)
    (r.first_rewards if step < r.start_step + 3 else r.last_rewards).append(metrics["reward/mean"])
    r.last_rewards = r.last_rewards[-3:]
    return metrics


def rollout(r: Run, step: int):
    """The next prompts, rendered, and algo.group_size samples of each from the engines, seeded by (seed, step)."""
    from rlfp8.run_folder import step_seed
    algo_cfg, ecfg = r.cfg["algo"], r.cfg["engine"]
    with phase("driver/prompts"):
        examples = r.train_stream.next_batch(r.cfg["data"]["prompts_per_step"])
        prompt_ids = [render(r, ex) for ex in examples]
    r.placement.before_rollout()
    samples = r.placement.generate(prompt_ids, algo_cfg["group_size"], algo_cfg["temperature"],
                                   algo_cfg["max_response_len"], top_p=ecfg["top_p"], top_k=ecfg["top_k"],
                                   seed=step_seed(r.cfg["seed"], step))
    return examples, prompt_ids, samples


def score(r: Run, examples, prompt_ids, samples):
    """Rewards of the samples and their group advantages, as the trainer's batch."""
    import torch

    from rlfp8 import algos
    from rlfp8.data import batch_score
    from rlfp8.trainer.interface import Rollouts
    algo_cfg = r.cfg["algo"]
    rewards = batch_score([s.text for s in samples], [examples[s.prompt_index].answer for s in samples],
                          r.train_stream.reward_kind)
    adv = algos.compute_advantages(torch.tensor(rewards), algo_cfg["group_size"], algo_cfg["advantage"],
                                   algo_cfg["std_eps"], algo_cfg["scale_rewards"])
    batch = Rollouts(input_ids=[prompt_ids[s.prompt_index] + s.token_ids for s in samples],
                     prompt_lens=[len(prompt_ids[s.prompt_index]) for s in samples],
                     rollout_logprobs=[s.logprobs for s in samples], advantages=adv.tolist())
    return rewards, batch


def update(r: Run, batch) -> dict[str, float]:
    """One RL update of the adapter (the placement first brings the trainers' base back if needed)."""
    r.placement.before_train()
    return r.placement.train_step(batch)


def sync(r: Run, step: int) -> dict[str, float]:
    """Each trainer's adapter goes to its engine as tensors (an in-place slot update), then the parity probe
    (pair 0) starts: both sides score the probe batch at once. With engine.parity_probe.overlap the loop does
    not wait for it here: the trainer scores beside the next rollout and settle() checks the result before
    the next update; otherwise settle() runs now. Returns the metrics of what settled."""
    from rlfp8.placement import start_together
    from rlfp8.rollout.adapter_slots import expected_checksums
    update = r.placement.sync_adapters()
    every = r.cfg["engine"]["parity_probe"]["every"]
    if r.probe is not None and update["version"] % every == 0:
        engine, trainer = r.placement.engine, r.placement.trainer
        seqs, lens = r.probe.sequences, r.probe.prompt_lens
        refs = start_together((engine.score, seqs, lens, True), (trainer.score_tokens, seqs, lens),
                              (engine.slot_checksums,))
        with phase("driver/probe_checksums"):         # while both actors score
            expected = expected_checksums(update, r.probe_lora_dtype)
        r.pending_probe = PendingProbe(update["version"], step, refs, expected)
    r.placement.after_sync()
    return {} if r.cfg["engine"]["parity_probe"]["overlap"] else settle(r)


@dataclass
class PendingProbe:
    """A parity probe started at a sync: Ray refs to the engine's and the trainer's log-probs of the probe
    batch and the engine's slot checksums, and the checksums the update implies."""
    version: int
    step: int
    refs: list
    expected: dict


def settle(r: Run) -> dict[str, float]:
    """Check what the last sync started (the placement's checks, the parity probe); raises if one failed.
    Called before an update, before a checkpoint and at the end: no update, checkpoint or result follows an
    unchecked sync. The probe's metrics name the adapter version they checked (parity/version)."""
    import ray
    r.placement.settle()
    pending, r.pending_probe = r.pending_probe, None
    if pending is None:
        return {}
    with phase("driver/probe_wait"):
        engine_lp, trainer_lp, slots = ray.get(pending.refs)
    metrics = r.probe.check(version=pending.version, step=pending.step, engine_logprobs=engine_lp,
                            trainer_logprobs=trainer_lp, engine_checksums=slots, expected_checksums=pending.expected)
    return {**metrics, "parity/version": float(pending.version)}


def make_probe(r: Run):
    """Fixed probe sequences (the first eval prompts + the base model's greedy answers) and the pair's floor."""
    from rlfp8.parity import ParityProbe
    from rlfp8.placement import call
    pcfg = r.cfg["engine"]["parity_probe"]
    if not pcfg["every"]:
        return None
    engine, trainer = r.placement.engine, r.placement.trainer
    prompts = [render(r, ex) for ex in list(r.eval_set)[: pcfg["size"]]]
    r.placement.before_rollout()
    answers = call(engine.generate, prompts, 1, 1.0, r.cfg["algo"]["max_response_len"], use_adapter=False,
                   greedy=True)
    seqs = [prompts[s.prompt_index] + (s.token_ids or [0]) for s in answers]
    probe = ParityProbe(seqs, [len(prompts[s.prompt_index]) for s in answers], factor=pcfg["factor"],
                        abs_tol=pcfg["abs_tol"])
    engine_lp = call(engine.score, probe.sequences, probe.prompt_lens, False)
    r.placement.before_train()          # the trainer computes next: offloaded brings its base back (one_copy: KV out)
    floor = probe.measure_floor(engine_lp, call(trainer.score_tokens, probe.sequences, probe.prompt_lens, False))
    log.info("parity probe: %d sequences, floor (no adapter) mean |dlogp| = %.3e", len(seqs), floor)
    import torch
    r.probe_lora_dtype = getattr(torch, call(engine.lora_dtype).replace("torch.", ""))
    return probe


def rollout_metrics(r: Run, rewards: list[float], samples) -> dict[str, float]:
    import torch
    resp_lens = [len(s.token_ids) for s in samples]
    groups = torch.tensor(rewards).view(-1, r.cfg["algo"]["group_size"])
    return {
        "reward/mean": sum(rewards) / len(rewards),
        "reward/std": float(torch.tensor(rewards).std()) if len(rewards) > 1 else 0.0,
        "reward/mixed_groups_frac": float(((groups.max(1).values - groups.min(1).values) > 0).float().mean()),
        "response/length_mean": sum(resp_lens) / len(resp_lens), "response/length_max": max(resp_lens),
        "response/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }


def evaluate(r: Run, step: int) -> float:
    """Greedy answers to the held-out prompts; logs and returns the mean reward."""
    from rlfp8.data import batch_score
    ids = [render(r, ex) for ex in r.eval_set]
    r.placement.before_rollout()
    samples = r.placement.generate(ids, 1, 1.0, r.cfg["algo"]["max_response_len"], greedy=True)
    rewards = batch_score([s.text for s in samples], [r.eval_set[s.prompt_index].answer for s in samples],
                          r.eval_set.reward_kind)
    mean = sum(rewards) / max(len(rewards), 1)
    r.logger.log(step, {"eval/reward": mean, "eval/n": len(rewards)})
    return mean


def log_settled(r: Run, step: int) -> None:
    """settle() outside a step (a checkpoint, the end): its metrics go to the log at `step`."""
    metrics = settle(r)
    if metrics:
        r.logger.log(step, metrics)


# ---------------------------------------------------------------------------------------- the end
def finish(r: Run, eval_first: float | None) -> None:
    """Final eval, the adapter, the kernel report, the plot; shut down; print the summary."""
    from rlfp8.placement import call
    log_settled(r, r.cfg["steps"])
    eval_last = evaluate(r, r.cfg["steps"])
    final = save_final_adapter(r)
    kernels = {"trainer": call(r.placement.trainer.kernel_report), "engine": call(r.placement.engine.kernel_report),
               "engine_precision": r.cfg["engine"]["precision"]}
    (r.run_dir / "kernels.json").write_text(json.dumps(kernels, indent=2))
    plot = r.logger.finish()
    r.placement.shutdown()
    r.folder.close()

    first = sum(r.first_rewards) / len(r.first_rewards) if r.first_rewards else float("nan")
    last = sum(r.last_rewards) / len(r.last_rewards) if r.last_rewards else first
    print("\n== rlfp8 run finished in %.0f s" % (time.time() - r.t_start))
    if eval_first is not None:
        print(f"   eval reward (held-out, greedy): {eval_first:.3f} before -> {eval_last:.3f} after")
    else:
        print(f"   eval reward (held-out, greedy): {eval_last:.3f} after (resumed run)")
    print(f"   train reward (mean of first 3 steps -> last 3 steps): {first:.3f} -> {last:.3f}")
    print(f"   adapter (PEFT format): {final}")
    print(f"   plot: {plot}")
    print(f"   metrics: {r.run_dir / 'metrics.jsonl'}   config: {r.run_dir / 'config.yaml'}")
    print(f"   kernels that ran: {kernels}")


# ---------------------------------------------------------------------------------------- run folder
def save_checkpoint(r: Run, step: int) -> None:
    from rlfp8.placement import call
    from rlfp8.run_folder import driver_rng_state
    log_settled(r, step)
    r.folder.save_checkpoint(step, lambda d: call(r.placement.trainer.save_checkpoint, d),    # pair 0 writes
                             {"data": r.train_stream.state_dict(), "rng": driver_rng_state(),
                              "num_pairs": r.cfg["ray"]["num_pairs"]}, r.cfg["keep_checkpoints"])


def check_num_pairs(cfg: dict, ckpt: Path, driver_state: dict) -> None:
    """A resume runs with the checkpoint's ray.num_pairs: each pair's sampling seeds depend on it."""
    from rlfp8.config import ConfigError
    saved, now = driver_state.get("num_pairs", 1), cfg["ray"]["num_pairs"]
    if saved != now:
        raise ConfigError(f"ray.num_pairs={now}, but the checkpoint {ckpt} was written with ray.num_pairs={saved}: "
                          f"resume with ray.num_pairs={saved} (a different N samples other rollouts)")


def restore(r: Run, ckpt: Path, driver_state: dict) -> None:
    """Trainer state, data cursor, driver RNG and step from a checkpoint (metrics.jsonl was cut back to it by
    RunFolder.resume_point); the adapter synced to the engine."""
    from rlfp8.run_folder import restore_driver_rng
    r.placement.load_checkpoint(str(ckpt))
    r.train_stream.load_state_dict(driver_state["data"])
    if "rng" in driver_state:
        restore_driver_rng(driver_state["rng"])
    r.start_step = driver_state["step"]
    sync(r, r.start_step)
    log.info("resumed from %s at step %d", ckpt, r.start_step + 1)


def save_final_adapter(r: Run) -> Path:
    from rlfp8.placement import call
    final, tmp = r.run_dir / "adapter", r.run_dir / ".final"
    call(r.placement.trainer.save_checkpoint, str(tmp))
    if final.exists():
        shutil.rmtree(final)
    shutil.move(str(tmp / "adapter"), str(final))
    shutil.rmtree(tmp, ignore_errors=True)
    return final


if __name__ == "__main__":
    raise SystemExit(main())
