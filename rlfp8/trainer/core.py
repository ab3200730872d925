"""PolicyTrainer: the FP8-base LoRA policy, its optimizer, and one GRPO/PPO update per RL step.

Design choices:
- The base projections are FP8 codes (or a 16-bit copy for the trainer.weights=bf16 arm), loaded and
  quantized one layer at a time; embeddings, norms and lm_head stay in the model dtype, frozen.
- Log-probs come from `sequence_logprobs` (chunked lm_head, recompute in backward): [B, T, V] never exists.
- Sequences are grouped into micro-batches by a token budget (padded length x rows) and into
  `mini_batches` optimizer steps per RL step. With one mini-batch and one epoch the update is
  on-policy: pi_old is the current policy, so old log-probs are the detached training log-probs and no
  extra forward pass runs. Otherwise old log-probs come from one no-grad pass first.
- The loss of a micro-batch is normalised by a denominator of the whole mini-batch
  (rlfp8.algos.aggregation_denominator), so gradient accumulation needs no re-weighting.
- Non-finite gradients skip the optimizer step and are counted (train/skipped_steps).
- Engine-vs-trainer mismatch is measured on the sampled tokens before the update (pi_old vs the
  engine's log-probs), every step.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rlfp8 import algos
from rlfp8.kernels import dispatch
from .adapter_io import load_adapter, save_adapter
from .fp8_lora import DEFAULT_TARGETS, adapters_disabled, apply_lora, lora_modules
from .logprobs import sequence_logprobs

log = logging.getLogger("rlfp8.trainer")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass
class Rollouts:
    """One RL batch, sequence-major. input_ids = prompt + response token ids."""
    input_ids: list[list[int]]
    prompt_lens: list[int]
    rollout_logprobs: list[list[float]]     # per response token, under the distribution sampled from
    advantages: list[float]

    def __post_init__(self):
        n = len(self.input_ids)
        for name in ("prompt_lens", "rollout_logprobs", "advantages"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Rollouts.{name} has {len(getattr(self, name))} rows, input_ids has {n}")
        for i, (ids, p, lp) in enumerate(zip(self.input_ids, self.prompt_lens, self.rollout_logprobs)):
            if len(ids) - p != len(lp) or len(lp) == 0:
                raise ValueError(f"Rollouts row {i}: {len(ids) - p} response tokens but {len(lp)} rollout log-probs")


def pick_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


class PolicyTrainer:
    def __init__(self, model_path: str, cfg: dict):
        """cfg: the resolved config as a plain dict (keys model, adapter, trainer, algo)."""
        t0 = time.time()
        self.cfg = cfg
        mcfg, acfg, tcfg = cfg["model"], cfg["adapter"], cfg["trainer"]
        self.model_path = str(model_path)
        self.device = pick_device(tcfg.get("device", "auto"))
        self.dtype = DTYPES[mcfg["dtype"]]
        dispatch.set_backend(tcfg.get("kernels", "auto"))
        if self.device.type == "cpu" and tcfg.get("num_threads", 0):
            torch.set_num_threads(int(tcfg["num_threads"]))
        torch.manual_seed(int(cfg.get("seed", 0)))

        from transformers import AutoModelForCausalLM
        # Load the 16-bit checkpoint on the CPU, then quantize/move one projection at a time.
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype, low_cpu_mem_usage=True)
        if getattr(model.get_output_embeddings(), "bias", None) is not None:
            raise NotImplementedError("lm_head with a bias is not supported by the chunked log-prob path")
        self.replaced = apply_lora(model, rank=int(acfg["rank"]), alpha=float(acfg["alpha"]),
                                   targets=acfg.get("target_modules") or DEFAULT_TARGETS,
                                   use_rslora=bool(acfg.get("use_rslora", False)), weights=tcfg["weights"],
                                   device=self.device)
        model.to(self.device)
        model.config.use_cache = False
        if tcfg.get("gradient_checkpointing", False):
            # transformers >= 5.24 renamed it; the GPU machines run 5.17
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        self.model = model
        self.params = [p for m in lora_modules(model).values() for p in (m.lora_A, m.lora_B)]
        betas = tuple(tcfg.get("betas", (0.9, 0.999)))
        self.optimizer = torch.optim.AdamW(self.params, lr=float(tcfg["lr"]), betas=betas,
                                           weight_decay=float(tcfg.get("weight_decay", 0.0)), eps=1e-8)
        warmup = int(tcfg.get("warmup_steps", 0))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0)
        self.step = 0
        self.skipped_steps = 0
        self.adapter_version = 0
        self._offloaded = False
        log.info("trainer ready in %.1fs: %d projections (%s base), %d trainable params, device %s",
                 time.time() - t0, len(self.replaced), tcfg["weights"], sum(p.numel() for p in self.params), self.device)

    # ------------------------------------------------------------------ placement
    def base_tensors(self) -> list[tuple[torch.nn.Module, str]]:
        """(module, buffer name) of every frozen tensor: what `offloaded` moves out between phases."""
        out = []
        for mod in self.model.modules():
            for name, b in mod.named_buffers(recurse=False):
                if b is not None and b.numel() > 0:
                    out.append((mod, name))
            for name, p in mod.named_parameters(recurse=False):
                if not p.requires_grad:
                    out.append((mod, name))
        return out

    def offload(self) -> None:
        """Move the frozen base to (pinned, on a GPU machine) host memory; adapters and optimizer stay."""
        if self.device.type != "cuda" or self._offloaded:
            self._offloaded = True
            return
        for mod, name in self.base_tensors():
            t = getattr(mod, name)
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            self._set(mod, name, host)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self._offloaded = True

    def onload(self) -> None:
        if self.device.type != "cuda" or not self._offloaded:
            self._offloaded = False
            return
        for mod, name in self.base_tensors():
            self._set(mod, name, getattr(mod, name).to(self.device, non_blocking=True))
        torch.cuda.synchronize()
        self._offloaded = False

    @staticmethod
    def _set(mod, name, t):
        if name in mod._parameters:
            mod._parameters[name] = torch.nn.Parameter(t, requires_grad=False)
        else:
            mod._buffers[name] = t

    # ------------------------------------------------------------------ batching
    def _micro_batches(self, rows: list[int], lengths: list[int]) -> list[list[int]]:
        """Pack row indices into micro-batches whose padded size (rows x max length) fits the budget."""
        budget = int(self.cfg["trainer"]["micro_batch_tokens"])
        order = sorted(rows, key=lambda i: -lengths[i])
        mbs, cur, cur_max = [], [], 0
        for i in order:
            new_max = max(cur_max, lengths[i])
            if cur and new_max * (len(cur) + 1) > budget:
                mbs.append(cur)
                cur, new_max = [], lengths[i]
            cur.append(i)
            cur_max = new_max
        if cur:
            mbs.append(cur)
        return mbs

    def _collate(self, batch: Rollouts, rows: list[int]) -> dict[str, torch.Tensor]:
        L = max(len(batch.input_ids[i]) for i in rows)
        B = len(rows)
        ids = torch.zeros(B, L, dtype=torch.long)
        att = torch.zeros(B, L, dtype=torch.long)
        resp = torch.zeros(B, L, dtype=torch.bool)          # response tokens (targets)
        rlp = torch.zeros(B, L - 1, dtype=torch.float32)    # rollout log-probs, aligned with targets [:, 1:]
        for j, i in enumerate(rows):
            seq, p = batch.input_ids[i], batch.prompt_lens[i]
            ids[j, :len(seq)] = torch.tensor(seq)
            att[j, :len(seq)] = 1
            resp[j, p:len(seq)] = True
            rlp[j, p - 1:len(seq) - 1] = torch.tensor(batch.rollout_logprobs[i], dtype=torch.float32)
        adv = torch.tensor([batch.advantages[i] for i in rows], dtype=torch.float32)
        d = self.device
        return {"input_ids": ids.to(d), "attention_mask": att.to(d), "loss_mask_full": resp.to(d),
                "mask": resp[:, 1:].to(d), "rollout_logp": rlp.to(d), "advantages": adv.to(d)}

    def _logp(self, mb, entropy=False):
        a = self.cfg["algo"]
        return sequence_logprobs(self.model, mb["input_ids"], mb["attention_mask"], mb["loss_mask_full"],
                                 temperature=float(a["temperature"]),
                                 chunk_size=int(self.cfg["trainer"].get("logprob_chunk", 1024)), entropy=entropy)

    # ------------------------------------------------------------------ the update
    def train_step(self, batch: Rollouts) -> dict[str, float]:
        if self._offloaded:
            self.onload()
        t0 = time.time()
        a, tcfg = self.cfg["algo"], self.cfg["trainer"]
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        n = len(batch.input_ids)
        lengths = [len(s) for s in batch.input_ids]
        n_mini = max(1, min(int(tcfg.get("mini_batches", 1)), n))
        epochs = int(tcfg.get("epochs", 1))
        minis = [list(range(n))[k::n_mini] for k in range(n_mini)]
        plan = [(mi, self._micro_batches(rows, lengths)) for mi, rows in enumerate(minis)]
        on_policy = n_mini == 1 and epochs == 1
        use_kl = float(a.get("kl_coef", 0.0)) > 0
        max_resp = int(a.get("max_response_len", max(l - p for l, p in zip(lengths, batch.prompt_lens))))

        collated: dict[tuple, dict] = {}          # micro-batch rows -> device tensors, built once per step

        def micro_batch(rows):
            key = tuple(rows)
            if key not in collated:
                collated[key] = self._collate(batch, rows)
            return key, collated[key]

        need_stats = algos.needs_batch_stats(a)     # batch-normalised weights / kept-token denominators
        old, ref, stats = {}, {}, {}
        if not on_policy or use_kl or need_stats:
            with torch.no_grad():
                for _, mbs in plan:
                    for rows in mbs:
                        key, mb = micro_batch(rows)
                        if not on_policy or need_stats:
                            old[key] = self._logp(mb)
                        if need_stats:
                            stats[key] = algos.batch_stats(a, old[key], mb["rollout_logp"], mb["mask"])
                        if use_kl:
                            with adapters_disabled(self.model):
                                ref[key] = self._logp(mb)

        step_stats = algos.sum_stats(stats.values()) if need_stats else None
        metrics_acc: dict[str, list[float]] = {}
        mism_old, mism_eng, mism_mask = [], [], []
        tokens = 0
        grad_norms = []
        for epoch in range(epochs):
            for mi, mbs in plan:
                resp_lens = torch.tensor([lengths[i] - batch.prompt_lens[i] for i in minis[mi]])
                mini_mask = torch.arange(int(resp_lens.max()))[None, :] < resp_lens[:, None]      # [b, T]
                mini_stats = algos.sum_stats(stats[tuple(r)] for r in mbs) if need_stats else None
                denom = algos.loss_denominator(a, mini_mask, max_resp, len(mbs), mini_stats)
                self.optimizer.zero_grad(set_to_none=True)
                for rows in mbs:
                    key, mb = micro_batch(rows)
                    logp, ent = self._logp(mb, entropy=True)
                    old_logp = old[key] if key in old else logp.detach()
                    mask = mb["mask"]
                    if epoch == 0:                   # mismatch of pi_old vs the engine, once per sequence
                        mism_old.append(old_logp.detach())
                        mism_eng.append(mb["rollout_logp"])
                        mism_mask.append(mask)
                    loss, lm = algos.rl_loss(a, logp, old_logp, mb["rollout_logp"], mb["advantages"], mask, denom,
                                             ref_logp=ref.get(key), entropy=ent, step_stats=step_stats)
                    loss.backward()
                    tokens += int(mb["attention_mask"].sum())
                    _acc(metrics_acc, "train/loss", loss.item())
                    _acc(metrics_acc, "train/entropy", float((ent.detach() * mask).sum() / mask.sum().clamp(min=1)))
                    for k, v in lm.items():
                        _acc(metrics_acc, k if "/" in k else f"train/{k}", v)
                gn = torch.nn.utils.clip_grad_norm_(self.params, float(tcfg.get("grad_clip", 1.0)))
                if torch.isfinite(gn):
                    self.optimizer.step()
                    self.scheduler.step()
                else:
                    self.skipped_steps += 1
                    log.warning("non-finite gradient norm (%s) at step %d: optimizer step skipped", gn.item(), self.step)
                    self.optimizer.zero_grad(set_to_none=True)
                grad_norms.append(float(gn))
        self.step += 1
        out = {k: sum(v) / len(v) for k, v in metrics_acc.items()}
        out["train/loss"] = sum(metrics_acc.get("train/loss", [0.0]))
        out.update(_mismatch(mism_eng, mism_old, mism_mask, float(a.get("tis_cap", 2.0))))
        dt = time.time() - t0
        out.update({"train/grad_norm": grad_norms[-1], "train/lr": self.scheduler.get_last_lr()[0],
                    "train/skipped_steps": self.skipped_steps, "train/tokens": tokens,
                    "train/tokens_per_s": tokens * epochs / max(dt, 1e-9)})
        if self.device.type == "cuda":
            out["memory/trainer_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return out

    # ------------------------------------------------------------------ adapters and checkpoints
    def export_adapter(self, out_dir: str) -> str:
        self.adapter_version += 1
        path = Path(out_dir) / f"v{self.adapter_version:06d}"
        save_adapter(self.model, path, self.model_path)
        return str(path)

    def save_checkpoint(self, ckpt_dir: str) -> None:
        d = Path(ckpt_dir)
        save_adapter(self.model, d / "adapter", self.model_path)
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                    "step": self.step, "skipped_steps": self.skipped_steps, "adapter_version": self.adapter_version,
                    "torch_rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                    "python_rng": random.getstate()}, d / "trainer.pt")

    def load_checkpoint(self, ckpt_dir: str) -> None:
        d = Path(ckpt_dir)
        load_adapter(self.model, d / "adapter")
        st = torch.load(d / "trainer.pt", weights_only=False)
        self.optimizer.load_state_dict(st["optimizer"])
        self.scheduler.load_state_dict(st["scheduler"])
        self.step, self.skipped_steps, self.adapter_version = st["step"], st["skipped_steps"], st["adapter_version"]
        torch.set_rng_state(st["torch_rng"])
        if st["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(st["cuda_rng"])
        random.setstate(st["python_rng"])

    def adapter_fingerprint(self) -> float:
        """A cheap scalar that changes whenever any adapter weight changes (tests, logs)."""
        with torch.no_grad():
            return float(sum((p.double() * (i + 1)).sum() for i, p in enumerate(self.params)))

    def kernel_report(self) -> dict:
        return dispatch.report()

    def score(self, batch: Rollouts) -> list[list[float]]:
        """Trainer log-probs of each row's response tokens (no grad): for tests and diagnostics."""
        out = []
        with torch.no_grad():
            for rows in self._micro_batches(list(range(len(batch.input_ids))), [len(s) for s in batch.input_ids]):
                mb = self._collate(batch, rows)
                lp = self._logp(mb)
                for j, i in enumerate(rows):
                    out.append((i, lp[j][mb["mask"][j]].tolist()))
        return [v for _, v in sorted(out)]


def _acc(d, k, v):
    d.setdefault(k, []).append(float(v))


def _mismatch(eng: list, old: list, masks: list, cap: float) -> dict[str, float]:
    if not eng:
        return {}
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts])   # noqa: E731
    m = flat(masks)
    return algos.mismatch_metrics(flat(eng)[None], flat(old)[None], m[None], tis_cap=cap)
