"""rlfp8-train: one RL run from a Hydra recipe.

    rlfp8-train recipe=quickstart                       # the embedded default (CPU-capable)
    rlfp8-train recipe=quickstart model=tiny steps=3    # any key can be overridden
    rlfp8-train ... resume=true run_dir=runs/my-run     # continue after a crash

Each step: rollout (engine samples algo.group_size answers per prompt, with their log-probs) ->
reward -> group advantages -> train (one GRPO update of the adapter) -> sync (the new adapter goes
to the engine). Design choices:
- The driver holds the tokenizer, the prompt stream and the rewards; the actors hold the model.
- Metrics of every step go to metrics.jsonl, W&B and the console; the resolved config sits next to
  them (config.yaml). A held-out eval (greedy, one answer per prompt) runs before training, every
  `eval_every` steps and at the end.
- Checkpoints (adapter in PEFT format, optimizer, RNG, data cursor, step) every `save_every` steps
  and at the end; `resume=true run_dir=...` continues from the latest complete one.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

log = logging.getLogger("rlfp8")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("httpx", "filelock", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from rlfp8.config import ConfigError, compose, to_dict
    try:
        cfg = to_dict(compose(argv))
    except ConfigError as e:
        print(f"rlfp8-train: config error: {e}", file=sys.stderr)
        return 2
    return run(cfg)


def _run_dir(cfg: dict) -> Path:
    if cfg.get("run_dir"):
        return Path(cfg["run_dir"]).expanduser().resolve()
    return (Path("runs") / f"{cfg['recipe']}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckdir = run_dir / "checkpoints"
    done = sorted(p for p in ckdir.glob("step_*") if (p / "COMPLETE").exists()) if ckdir.exists() else []
    return done[-1] if done else None


def run(cfg: dict) -> int:
    import torch
    from tqdm import tqdm

    from rlfp8 import algos
    from rlfp8.data import batch_score, build_dataset, render_prompt
    from rlfp8.logger import RunLogger
    from rlfp8.placement import Placement
    from rlfp8.trainer.core import Rollouts
    from rlfp8.trainer.hf_models import resolve_model

    t_start = time.time()
    run_dir = _run_dir(cfg)
    cfg["run_dir"] = str(run_dir)
    resume_from = None
    if cfg["resume"]:
        resume_from = latest_checkpoint(run_dir)
        if resume_from is None:
            print(f"rlfp8-train: resume=true but {run_dir}/checkpoints holds no complete checkpoint", file=sys.stderr)
            return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    log.info("run folder: %s", run_dir)

    model_path = str(resolve_model(cfg["model"]["path"], cfg.get("cache_dir"), seed=cfg["seed"]))
    cfg["model"]["resolved_path"] = model_path
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dcfg = {k: v for k, v in cfg["data"].items() if k != "prompts_per_step"}
    dcfg.setdefault("seed", cfg["seed"])
    train_stream, eval_set = build_dataset(dcfg, tokenizer=tokenizer)
    render = lambda ex: render_prompt(tokenizer, ex, cfg["data"]["use_chat_template"], cfg["data"]["system_prompt"])  # noqa: E731

    logger = RunLogger(run_dir, config=cfg, wandb_mode=cfg["logger"]["wandb"]["mode"],
                       project=cfg["logger"]["wandb"]["project"], name=cfg["logger"]["wandb"]["name"] or run_dir.name,
                       resume=resume_from is not None)
    placement = Placement(cfg, model_path)
    import ray
    engine, trainer = placement.engine, placement.trainer
    adapter_root = _ram_dir(run_dir)

    a = cfg["algo"]
    start_step = 0
    if resume_from is not None:
        state = json.loads((resume_from / "driver.json").read_text())
        ray.get(trainer.call.remote("load_checkpoint", str(resume_from)))
        train_stream.load_state_dict(state["data"])
        start_step = state["step"]
        logger.truncate_after(start_step)
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
                                             top_k=cfg["engine"]["top_k"]))
        t_roll = time.time() - t0
        rewards = batch_score([s.text for s in samples], [examples[s.prompt_index].answer for s in samples],
                              train_stream.reward_kind)
        adv = algos.compute_advantages(torch.tensor(rewards), a["group_size"], a["advantage"], a["std_eps"],
                                       a["scale_rewards"])
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
            _save_checkpoint(run_dir, step + 1, trainer, train_stream, cfg["keep_checkpoints"])
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
    shutil.rmtree(adapter_root, ignore_errors=True)

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


def _ram_dir(run_dir: Path) -> Path:
    """Adapters travel to the engine through a RAM-backed folder when there is one."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK) else run_dir
    d = base / f"rlfp8-{os.getpid()}-{run_dir.name}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _prune_adapters(root: Path, keep: str) -> None:
    for p in root.glob("v*"):
        if str(p) != keep:
            shutil.rmtree(p, ignore_errors=True)


def _save_checkpoint(run_dir: Path, step: int, trainer, stream, keep: int) -> None:
    import ray
    d = run_dir / "checkpoints" / f"step_{step:06d}"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    ray.get(trainer.call.remote("save_checkpoint", str(d)))
    (d / "driver.json").write_text(json.dumps({"step": step, "data": stream.state_dict()}))
    (d / "COMPLETE").write_text(time.strftime("%Y-%m-%d %H:%M:%S"))      # written last: the marker of a whole one
    done = sorted(p for p in d.parent.glob("step_*") if (p / "COMPLETE").exists())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
