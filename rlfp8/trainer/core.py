"""PolicyTrainer: the FP8-base LoRA policy, its optimizer, and one GRPO/PPO update per RL step.

Design choices:
- The base comes from a base-weight source (weights.py): FP8 codes (or a 16-bit copy for the
  trainer.weights=bf16 arm), loaded and quantized one layer at a time; embeddings, norms and lm_head
  stay in the model dtype, frozen. The trainable tensors come from the adapter kind (adapters.py).
- Log-probs come from `sequence_logprobs` (chunked lm_head, recompute in backward): [B, T, V] never exists.
- Sequences are grouped into micro-batches by a token budget (padded length x rows) and into
  `mini_batches` optimizer steps per RL step. With one mini-batch and one epoch the update is
  on-policy: pi_old is the current policy, so old log-probs are the detached training log-probs and no
  extra forward pass runs. Otherwise old log-probs come from one no-grad pass first.
- The loss of a micro-batch is normalised by a denominator of the whole mini-batch
  (rlfp8.algos.aggregation_denominator), so gradient accumulation needs no re-weighting.
- train_step = forward_backward + optimizer_step per mini-batch and epoch (interface.py).
- Data parallel (ray.num_pairs > 1, data_parallel.py): the batch is this pair's share of the step's rows
  (Rollouts.row_offset / total_rows); mini-batches are taken over the whole batch's row indices, every
  denominator and batch statistic is summed over the pairs, and the gradients are summed before clipping:
  the update equals the one-pair update of the whole batch (bnpo: when the micro-batches coincide, since it
  is a mean of micro-batch means by definition).
- Non-finite gradients skip the optimizer step and are counted (train/skipped_steps).
- Engine-vs-trainer mismatch is measured on the sampled tokens before the update (pi_old vs the
  engine's log-probs), every step.
"""
from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import torch

from rlfp8 import algos
from rlfp8.kernels import dispatch
from rlfp8.profiling import phase
from .adapter_io import load_adapter, save_adapter
from .adapters import adapter_kind
from .checkpointing import LayerCheckpointing
from .data_parallel import DataParallel, tensor_checksum
from .fp8_lora import adapters_disabled
from .interface import MiniBatch, Rollouts, TrainerInterface
from .logprobs import sequence_logprobs
from .weights import make_weight_source

__all__ = ["PolicyTrainer", "Rollouts", "MiniBatch", "pick_device"]

log = logging.getLogger("rlfp8.trainer")

# loss_agg modes whose denominator counts only kept tokens / rows with algo.drop_rejected_from_denominator
KEPT_COUNT_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def pick_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


class PolicyTrainer(TrainerInterface):
    def __init__(self, model_path: str, cfg: dict, weight_source: str = "quantize", weight_handles: dict | None = None):
        """cfg: the resolved config as a plain dict; weight_source: a name in rlfp8.trainer.weights.SOURCES;
        weight_handles: the engine's exported FP8 tensors (source "map", placement=one_copy)."""
        t0 = time.time()
        self.cfg = cfg
        tcfg = cfg["trainer"]
        self.model_path = str(model_path)
        self.device = pick_device(tcfg["device"])
        self.dtype = DTYPES[cfg["model"]["dtype"]]
        dispatch.set_backend(tcfg["kernels"])
        if self.device.type == "cpu" and tcfg["num_threads"]:
            torch.set_num_threads(int(tcfg["num_threads"]))
        torch.manual_seed(int(cfg["seed"]))
        self.adapter = adapter_kind(cfg["adapter"]["type"])
        self.weights = make_weight_source(weight_source, weight_handles)
        self.model, self.replaced = self.weights.load(self.model_path, cfg, self.device, self.dtype)
        arch = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") \
            else self.model.config
        self.checkpointing = LayerCheckpointing(self.model, tcfg, self.device, self.dtype, arch.vocab_size,
                                                arch.hidden_size)
        self.model.train()
        self.params = list(self.adapter.trainable_parameters(self.model).values())
        self.optimizer = torch.optim.AdamW(self.params, lr=float(tcfg["lr"]), betas=tuple(tcfg["betas"]),
                                           weight_decay=float(tcfg["weight_decay"]), eps=1e-8)
        warmup = int(tcfg["warmup_steps"])
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0)
        self.step = 0
        self.skipped_steps = 0
        self.adapter_version = 0
        self.dp: DataParallel | None = None
        log.info("trainer ready in %.1fs: %d projections (%s base, source %s), %d trainable params, device %s",
                 time.time() - t0, len(self.replaced), tcfg["weights"], self.weights.name,
                 sum(p.numel() for p in self.params), self.device)

    # ------------------------------------------------------------------ placement
    def join_data_parallel(self, host: str, port: int, rank: int, world_size: int) -> str:
        """Join the pairs' process group (once, at set-up); returns this adapter's checksum."""
        if self.dp is not None:
            raise RuntimeError("join_data_parallel: this trainer already joined a process group")
        self.dp = DataParallel(host, port, rank, world_size, self.device)
        return self.adapter_checksum()

    def adapter_checksum(self) -> str:
        """Exact checksum of the trainable adapter tensors (data parallel: equal on every pair)."""
        return tensor_checksum(self.adapter.trainable_parameters(self.model))

    def release_base(self) -> None:
        self.weights.release(self.model, self.device)

    def restore_base(self, free_host: bool = False) -> None:
        """free_host: also return the pinned host copy to the OS (the engine's weights take its place on the host
        next: engine.release_weights)."""
        self.weights.restore(self.model, self.device, free_host=free_host)

    def _require_base(self, what: str) -> None:
        """Computing on a base that placement=offloaded moved to the host would fail deep inside the model (a
        device mismatch on a GPU) or, on a CPU, pass unnoticed: name the misordered call instead."""
        if getattr(self.weights, "offloaded", False):
            raise RuntimeError(f"trainer.{what} while the base is offloaded to the host (placement=offloaded moves "
                               f"it out while the engine generates): the placement must call restore_base first")

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
        return sequence_logprobs(self.model, mb["input_ids"], mb["attention_mask"], mb["loss_mask_full"],
                                 temperature=float(self.cfg["algo"]["temperature"]),
                                 chunk_size=int(self.cfg["trainer"]["logprob_chunk"]), entropy=entropy)

    def _plan(self, batch: Rollouts) -> list[MiniBatch]:
        """Split the rows into mini-batches of micro-batches, collate each once, and precompute the
        no-grad log-probs (pi_old when off-policy, the base for a KL term)."""
        algo_cfg, tcfg = self.cfg["algo"], self.cfg["trainer"]
        n = len(batch.input_ids)
        total = n if batch.total_rows is None else batch.total_rows      # data parallel: the whole batch's rows
        lengths = [len(s) for s in batch.input_ids]
        n_mini = max(1, min(int(tcfg["mini_batches"]), total))
        on_policy = n_mini == 1 and int(tcfg["epochs"]) == 1
        use_kl = float(algo_cfg["kl_coef"]) > 0
        need_stats = algos.needs_batch_stats(algo_cfg)     # batch-normalised weights / kept-token denominators
        minis = []
        for k in range(n_mini):
            rows = [i for i in range(n) if (batch.row_offset + i) % n_mini == k]
            minis.append((rows, [self._collate(batch, mb_rows) for mb_rows in self._micro_batches(rows, lengths)]))
        if not on_policy or use_kl or need_stats:
            with torch.no_grad():
                for mb in (mb for _, mbs in minis for mb in mbs):
                    if not on_policy or need_stats:
                        mb["old_logp"] = self._logp(mb)
                    if need_stats:
                        mb["stats"] = algos.batch_stats(algo_cfg, mb["old_logp"], mb["rollout_logp"], mb["mask"])
                    if use_kl:
                        with adapters_disabled(self.model):
                            mb["ref_logp"] = self._logp(mb)
        self._step_stats = algos.sum_stats(mb["stats"] for _, mbs in minis for mb in mbs) if need_stats else None
        if self.dp is not None and need_stats:
            self._step_stats = self.dp.sum_dict(self._step_stats)
        plan = []
        for rows, mbs in minis:
            resp_lens = torch.tensor([lengths[i] - batch.prompt_lens[i] for i in rows], dtype=torch.long)
            mini_mask = torch.arange(int(resp_lens.max()) if rows else 1)[None, :] < resp_lens[:, None]   # [b, T]
            mini_stats = algos.sum_stats(mb["stats"] for mb in mbs) if need_stats else None
            plan.append(MiniBatch(mbs, self._mini_denominator(mini_mask, len(mbs), mini_stats)))
        return plan

    def _mini_denominator(self, mini_mask: torch.Tensor, num_micro_batches: int, stats: dict | None) -> float:
        """rlfp8.algos.loss_denominator of the whole mini-batch. Data parallel: every mode's count (tokens,
        rows, rows x max_response_len, micro-batches, kept tokens / rows) is a sum over the pairs' shares; a
        share's count is never clamped (each row holds >= 1 response token), an empty share counts 0."""
        algo_cfg = self.cfg["algo"]
        max_len = int(algo_cfg["max_response_len"])
        if self.dp is None:
            return algos.loss_denominator(algo_cfg, mini_mask, max_len, num_micro_batches, stats)
        mode = algo_cfg["loss_agg"]
        local = algos.aggregation_denominator(mini_mask, mode, max_len, num_micro_batches) if len(mini_mask) else 0.0
        count = max(self.dp.sum_floats([local])[0], 1.0)
        if stats is None:
            return count
        stats = self.dp.sum_dict(stats)
        return algos.loss_denominator(algo_cfg, mini_mask, max_len, num_micro_batches, stats) \
            if algo_cfg["drop_rejected_from_denominator"] and mode in KEPT_COUNT_MODES else count

    def _policy_loss(self, mb: dict, logp: torch.Tensor, old_logp: torch.Tensor, entropy: torch.Tensor,
                     denom: float) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of one micro-batch (normalised by the mini-batch's denominator) and its metrics: one call
        into rlfp8.algos (policy loss, correction, rejection, KL, entropy bonus)."""
        loss, metrics = algos.rl_loss(self.cfg["algo"], logp, old_logp, mb["rollout_logp"], mb["advantages"],
                                      mb["mask"], denom, ref_logp=mb.get("ref_logp"), entropy=entropy,
                                      step_stats=self._step_stats)
        return loss, {k if "/" in k else f"train/{k}": v for k, v in metrics.items()}

    # ------------------------------------------------------------------ the update
    def forward_backward(self, mini_batch: MiniBatch) -> dict[str, list[float]]:
        self.optimizer.zero_grad(set_to_none=True)
        acc: dict[str, list[float]] = {}
        for mb in mini_batch.micro_batches:
            with phase("trainer/forward"):
                logp, ent = self._logp(mb, entropy=True)
                old_logp = mb["old_logp"] if "old_logp" in mb else logp.detach()
                mask = mb["mask"]
                if mini_batch.mismatch is not None:      # mismatch of pi_old vs the engine, once per sequence
                    mini_batch.mismatch.append((old_logp.detach(), mb["rollout_logp"], mask))
                loss, metrics = self._policy_loss(mb, logp, old_logp, ent, mini_batch.denominator)
            with phase("trainer/backward"):
                loss.backward()
            with phase("trainer/metrics"):
                _acc(acc, "train/tokens", int(mb["attention_mask"].sum()))
                _acc(acc, "train/loss", loss.item())
                _acc(acc, "train/entropy", float((ent.detach() * mask).sum() / mask.sum().clamp(min=1)))
                for k, v in metrics.items():
                    _acc(acc, k, v)
        return acc

    @phase("trainer/optimizer")
    def optimizer_step(self) -> dict[str, float]:
        if self.dp is not None:
            self.dp.sum_gradients(self.params)
        gn = torch.nn.utils.clip_grad_norm_(self.params, float(self.cfg["trainer"]["grad_clip"]))
        if torch.isfinite(gn):
            self.optimizer.step()
            self.scheduler.step()
        else:
            self.skipped_steps += 1
            log.warning("non-finite gradient norm (%s) at step %d: optimizer step skipped", gn.item(), self.step)
            self.optimizer.zero_grad(set_to_none=True)
        return {"train/grad_norm": float(gn), "train/skipped_steps": self.skipped_steps}

    def train_step(self, batch: Rollouts) -> dict[str, float]:
        self._require_base("train_step")
        t0 = time.time()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            self._allocated_at_start = torch.cuda.memory_allocated()
        with phase("trainer/plan"):          # micro-batches, pi_old / reference log-probs, statistics
            plan = self._plan(batch)
        with phase("trainer/checkpoint_plan"):     # trainer.gradient_checkpointing=auto: layers for this step
            checkpointing = self.checkpointing.before_step(
                [tuple(mb["input_ids"].shape) for mini in plan for mb in mini.micro_batches])
        epochs = int(self.cfg["trainer"]["epochs"])
        acc: dict[str, list[float]] = {}
        mismatch: list = []
        grad_norms = []
        for epoch in range(epochs):
            for mini in plan:
                mini.mismatch = mismatch if epoch == 0 else None
                for k, v in self.forward_backward(mini).items():
                    acc.setdefault(k, []).extend(v)
                grad_norms.append(self.optimizer_step()["train/grad_norm"])
        self.step += 1
        return {**self._step_metrics(acc, mismatch, grad_norms, epochs, time.time() - t0), **checkpointing}

    def _step_metrics(self, acc: dict, mismatch: list, grad_norms: list[float], epochs: int,
                      seconds: float) -> dict[str, float]:
        tokens = int(sum(acc.pop("train/tokens", [])))
        out = {k: sum(v) / len(v) for k, v in acc.items()}
        out["train/loss"] = sum(acc.get("train/loss", [0.0]))
        old, eng, masks = zip(*mismatch) if mismatch else ((), (), ())
        out.update(_mismatch(list(eng), list(old), list(masks), float(self.cfg["algo"]["tis_cap"])))
        out.update({"train/grad_norm": grad_norms[-1], "train/lr": self.scheduler.get_last_lr()[0],
                    "train/skipped_steps": self.skipped_steps, "train/tokens": tokens,
                    "train/tokens_per_s": tokens * epochs / max(seconds, 1e-9)})
        out.update(self.memory())
        return out

    # ------------------------------------------------------------------ adapters and checkpoints
    @phase("trainer/export")
    def export_adapter(self) -> dict:
        self.adapter_version += 1
        return {"version": self.adapter_version, "tensors": self.adapter.state_dict(self.model),
                "config": self.adapter.peft_config(self.model, self.model_path)}

    def save_checkpoint(self, ckpt_dir: str) -> None:
        d = Path(ckpt_dir)
        save_adapter(self.model, d / "adapter", self.model_path, kind=self.adapter)
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                    "step": self.step, "skipped_steps": self.skipped_steps, "adapter_version": self.adapter_version,
                    "torch_rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                    "python_rng": random.getstate()}, d / "trainer.pt")

    def load_checkpoint(self, ckpt_dir: str) -> None:
        d = Path(ckpt_dir)
        load_adapter(self.model, d / "adapter", kind=self.adapter)
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

    def release_cached_memory(self) -> float:
        """Return the allocator's cached, unused GPU blocks to the device (one_copy: the engine maps its KV cache
        back next); the GiB still reserved after (0 on a CPU)."""
        if not torch.cuda.is_available():
            return 0.0
        import gc
        gc.collect()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved() / 2**30

    def kernel_report(self) -> dict:
        return dispatch.report()

    def base_checksums(self) -> dict[str, int]:
        """Projection name -> checksum of the frozen FP8 base this trainer computes on (one_copy: the engine's
        memory); rlfp8.shared_tensors.base_checksum, the engine's function."""
        from rlfp8.shared_tensors import base_checksum
        from .fp8_lora import lora_modules
        return {n: base_checksum([m.qweight, m.weight_scale]) for n, m in lora_modules(self.model).items()}

    def memory(self) -> dict[str, float]:
        """GPU: what this process allocated (mapped one_copy tensors are the engine's: not counted), its peak in the
        last train_step, the base it owns (0 with one_copy), adapter + optimizer state, activations (peak minus
        what was allocated when the step began) and the device's free memory. CPU: {}."""
        if self.device.type != "cuda":
            return {}
        gib = 2**30
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)      # noqa: E731
        from .fp8_lora import lora_modules
        owned = [] if self.weights.name == "map" else [t for m in lora_modules(self.model).values()
                                                        for t in (m.qweight, m.weight_scale, m.weight) if t is not None]
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        peak = torch.cuda.max_memory_allocated()
        return {"memory/trainer_allocated_gib": torch.cuda.memory_allocated() / gib,
                "memory/trainer_peak_gib": peak / gib, "memory/trainer_base_gib": nbytes(owned) / gib,
                "memory/trainer_optimizer_gib": (nbytes(state) + nbytes(self.params)) / gib,
                "memory/trainer_activations_gib": max(0, peak - getattr(self, "_allocated_at_start", peak)) / gib,
                "memory/free_gib": torch.cuda.mem_get_info()[0] / gib}

    @phase("trainer/score_tokens")
    def score_tokens(self, sequences: list[list[int]], prompt_lens: list[int], use_adapter: bool = True) -> list[list[float]]:
        """Log-probs (temperature 1) of each sequence's tokens after its prompt: the parity probe's trainer side."""
        batch = Rollouts(input_ids=sequences, prompt_lens=prompt_lens,
                         rollout_logprobs=[[0.0] * (len(s) - p) for s, p in zip(sequences, prompt_lens)],
                         advantages=[0.0] * len(sequences))
        temperature = self.cfg["algo"]["temperature"]
        self.cfg["algo"]["temperature"] = 1.0
        try:
            if use_adapter:
                return self.score(batch)
            with adapters_disabled(self.model):
                return self.score(batch)
        finally:
            self.cfg["algo"]["temperature"] = temperature

    def score(self, batch: Rollouts) -> list[list[float]]:
        """Trainer log-probs of each row's response tokens (no grad): for tests and diagnostics."""
        self._require_base("score")
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
