"""rlfp8-train: one RL run from a Hydra recipe.

    rlfp8-train recipe=quickstart                       # the embedded default (CPU-capable)
    rlfp8-train recipe=quickstart model=tiny steps=3    # any key can be overridden
    rlfp8-train ... resume=true run_dir=runs/my-run     # continue after a crash (its config.yaml is the config)
    rlfp8-train ... --debug                             # errors with their traceback (also debug=true)

Each step: rollout (engine samples algo.group_size answers per prompt, with their log-probs) ->
reward -> group advantages -> train (one GRPO update of the adapter) -> sync (the new adapter goes
to the engine). Design choices:
- The driver holds the tokenizer, the prompt stream and the rewards; the actors hold the model.
- Metrics of every step go to metrics.jsonl, W&B and the console; the resolved config sits next to
  them (config.yaml). A held-out eval (greedy, one answer per prompt) runs before training, every
  `eval_every` steps and at the end.
- Checkpoints (adapter in PEFT format, optimizer, RNG, data cursor, step) every `save_every` steps
  and at the end; `resume=true run_dir=...` continues from the latest complete one. The run folder
  (lock, config on resume, checkpoints, scratch) is rlfp8.run_folder.RunFolder's.
- The engine samples step s from seeds that depend only on (seed, s): a resumed run repeats the
  uninterrupted one.
- Mistakes a user can fix (config, data, run folder, model path) exit 2 with one line.
"""
from __future__ import annotations

import json
import logging
import shutil
import sys
import time
import traceback
from pathlib import Path

log = logging.getLogger("rlfp8")


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
    from rlfp8.run_folder import RunFolder
    try:
        folder, cfg = RunFolder.start(argv)
        return run(cfg, folder)
    except _user_errors() as e:
        return _report_user_error(e, debug)


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
    import torch
    from tqdm import tqdm

    from rlfp8 import algos
    from rlfp8.data import batch_score, build_dataset, render_prompt
    from rlfp8.config import ConfigError, prompt_token_limit
    from rlfp8.logger import RunLogger
    from rlfp8.placement import Placement
    from rlfp8.run_folder import driver_rng_state, restore_driver_rng, step_seed
    from rlfp8.trainer.core import Rollouts
    from rlfp8.trainer.hf_models import resolve_model

    t_start = time.time()
    run_dir = folder.path
    resume_from, driver_state = folder.resume_point()

    try:
        model_path = str(resolve_model(cfg["model"]["path"], cfg.get("cache_dir"), seed=cfg["seed"]))
    except (OSError, ValueError, ImportError, RuntimeError) as e:
        if not str(e).startswith("model"):       # resolve_model's own messages name model.path
            raise
        raise ConfigError(str(e)) from e
    cfg["model"]["resolved_path"] = model_path
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dcfg = {k: v for k, v in cfg["data"].items() if k != "prompts_per_step"}
    dcfg.setdefault("seed", cfg["seed"])
    dcfg["max_prompt_tokens"] = prompt_token_limit(cfg)
    train_stream, eval_set = build_dataset(dcfg, tokenizer=tokenizer)
    render = lambda ex: render_prompt(tokenizer, ex, cfg["data"]["use_chat_template"], cfg["data"]["system_prompt"])  # noqa: E731

    logger = RunLogger(run_dir, config=cfg, wandb_mode=cfg["logger"]["wandb"]["mode"],
                       project=cfg["logger"]["wandb"]["project"], name=cfg["logger"]["wandb"]["name"] or run_dir.name,
                       resume=resume_from is not None)
    placement = Placement(cfg, model_path)
    import ray
    engine, trainer = placement.engine, placement.trainer
    adapter_root = folder.scratch_dir()

    a = cfg["algo"]
    start_step = 0
    if resume_from is not None:
        ray.get(trainer.call.remote("load_checkpoint", str(resume_from)))
        train_stream.load_state_dict(driver_state["data"])
        if "rng" in driver_state:
            restore_driver_rng(driver_state["rng"])
        start_step = driver_state["step"]
        path = ray.get(trainer.call.remote("export_adapter", str(adapter_root)))
        ray.get(engine.call.remote("set_adapter", path))
        log.info("resumed from %s at step %d", resume_from, start_step + 1)

    def evaluate(step: int) -> float:
        ids = [render(ex) for ex in eval_set]
        samples = ray.get(engine.call.remote("generate", ids, 1, 1.0, a["max_response_len"], greedy=True))
        rewards = batch_score([s.text for s in samples], [eval_set[s.prompt_index].answer for s in samples],
                              eval_set.reward_kind)
        r = sum(rewards) / max(len(rewards), 1)
        logger.log(step, {"eval/reward": r, "eval/n": len(rewards)})
        return r

    eval_first = evaluate(start_step) if start_step == 0 else None
    first_rewards, last_rewards = [], []
    bar = tqdm(range(start_step, cfg["steps"]), desc="rl", unit="step", initial=start_step, total=cfg["steps"],
               dynamic_ncols=True, file=sys.stderr)
    for step in bar:
        t0 = time.time()
        bar.set_description(f"step {step + 1}: rollout")
        examples = train_stream.next_batch(cfg["data"]["prompts_per_step"])
        prompt_ids = [render(ex) for ex in examples]
        samples = ray.get(engine.call.remote("generate", prompt_ids, a["group_size"], a["temperature"],
                                             a["max_response_len"], top_p=cfg["engine"]["top_p"],
                                             top_k=cfg["engine"]["top_k"], seed=step_seed(cfg["seed"], step)))
        t_roll = time.time() - t0
        rewards = batch_score([s.text for s in samples], [examples[s.prompt_index].answer for s in samples],
                              train_stream.reward_kind)
        adv = algos.compute_advantages(torch.tensor(rewards), a["group_size"], a["advantage"], a["std_eps"])
        batch = Rollouts(input_ids=[prompt_ids[s.prompt_index] + s.token_ids for s in samples],
                         prompt_lens=[len(prompt_ids[s.prompt_index]) for s in samples],
                         rollout_logprobs=[s.logprobs for s in samples], advantages=adv.tolist())
        bar.set_description(f"step {step + 1}: train")
        t1 = time.time()
        metrics = placement.train(batch)
        t_train = time.time() - t1
        bar.set_description(f"step {step + 1}: sync")
        t2 = time.time()
        path = ray.get(trainer.call.remote("export_adapter", str(adapter_root)))
        ray.get(engine.call.remote("set_adapter", path))
        _prune_adapters(adapter_root, keep=path)
        placement.after_sync()
        t_sync = time.time() - t2
        resp_lens = [len(s.token_ids) for s in samples]
        reward_mean = sum(rewards) / len(rewards)
        groups = torch.tensor(rewards).view(-1, a["group_size"])
        metrics.update({
            "reward/mean": reward_mean, "reward/std": float(torch.tensor(rewards).std()) if len(rewards) > 1 else 0.0,
            "reward/mixed_groups_frac": float(((groups.max(1).values - groups.min(1).values) > 0).float().mean()),
            "response/length_mean": sum(resp_lens) / len(resp_lens), "response/length_max": max(resp_lens),
            "response/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
            "time/rollout": t_roll, "time/train": t_train, "time/sync": t_sync, "time/step": time.time() - t0,
            "rollout/tokens_per_s": sum(resp_lens) / max(t_roll, 1e-9),
            "data/prompts_dropped": train_stream.num_dropped,
        })
        metrics.update(ray.get(engine.call.remote("memory")))
        logger.log(step + 1, metrics)
        (first_rewards if step < start_step + 3 else last_rewards).append(reward_mean)
        last_rewards = last_rewards[-3:]
        bar.set_postfix(reward=f"{reward_mean:.3f}", kl_k3=f"{metrics.get('mismatch/kl_k3', 0):.2e}")
        done = step + 1 == cfg["steps"]
        if cfg["eval_every"] and (step + 1) % cfg["eval_every"] == 0 and not done:
            bar.set_description(f"step {step + 1}: eval")
            evaluate(step + 1)
        if done or (cfg["save_every"] and (step + 1) % cfg["save_every"] == 0):
            bar.set_description(f"step {step + 1}: checkpoint")
            folder.save_checkpoint(step + 1, lambda d: ray.get(trainer.call.remote("save_checkpoint", d)),
                                   {"data": train_stream.state_dict(), "rng": driver_rng_state()},
                                   cfg["keep_checkpoints"])
    bar.close()

    eval_last = evaluate(cfg["steps"])
    final = run_dir / "adapter"
    ray.get(trainer.call.remote("save_checkpoint", str(run_dir / ".final")))
    if final.exists():
        shutil.rmtree(final)
    shutil.move(str(run_dir / ".final" / "adapter"), str(final))
    shutil.rmtree(run_dir / ".final", ignore_errors=True)
    kernels = ray.get(trainer.call.remote("kernel_report"))
    (run_dir / "kernels.json").write_text(json.dumps(kernels, indent=2))
    plot = logger.finish()
    placement.shutdown()
    folder.close()

    first = sum(first_rewards) / len(first_rewards) if first_rewards else float("nan")
    last = sum(last_rewards) / len(last_rewards) if last_rewards else first
    print("\n== rlfp8 run finished in %.0f s" % (time.time() - t_start))
    if eval_first is not None:
        print(f"   eval reward (held-out, greedy): {eval_first:.3f} before -> {eval_last:.3f} after")
    else:
        print(f"   eval reward (held-out, greedy): {eval_last:.3f} after (resumed run)")
    print(f"   train reward (mean of first 3 steps -> last 3 steps): {first:.3f} -> {last:.3f}")
    print(f"   adapter (PEFT format): {final}")
    print(f"   plot: {plot}")
    print(f"   metrics: {run_dir / 'metrics.jsonl'}   config: {run_dir / 'config.yaml'}")
    print(f"   kernels that ran: {kernels}")
    return 0


def _prune_adapters(root: Path, keep: str) -> None:
    for p in root.glob("v*"):
        if str(p) != keep:
            shutil.rmtree(p, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
