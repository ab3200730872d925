"""Mismatch statistics of one (engine, trainer) pair on the same scored tokens.

- Full-distribution KL(p_eng || p_tr) = sum_v p_eng(v) (log p_eng(v) - log p_tr(v)) at every scored position:
  the engine samples, so the engine's distribution is the reference. Both sides hand over log-prob rows of
  a token range [start, stop) on request, so only one [chunk, V] block per side exists at a time; the rows
  are re-normalised in float64 first (a fp32 log-softmax sums to 1 only up to ~1e-7, which would otherwise
  leave KL values of identical-up-to-rounding distributions slightly negative).
- Sampled-token statistics (kl_k3, |d log p| quantiles) come from the log-probs of the scored tokens only;
  kl_k3 is rlfp8.algos.mismatch_metrics's, the statistic every training step logs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from rlfp8 import algos

RowFn = Callable[[int, int], torch.Tensor]      # (start, stop) -> log-prob rows [stop - start, V]
QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class ChunkedKL:
    """Per-token KL [n] (float64) and the row count of every chunk computed (the proof that no block
    larger than [chunk, V] was built)."""
    per_token: torch.Tensor
    chunk_rows: list[int] = field(default_factory=list)


def chunked_full_kl(n: int, engine_rows: RowFn, trainer_rows: RowFn, chunk_tokens: int) -> ChunkedKL:
    """KL(p_eng || p_tr) at each of n positions, chunk_tokens positions at a time."""
    if chunk_tokens < 1:
        raise ValueError(f"diagnose.chunk_tokens={chunk_tokens}: must be >= 1")
    out = ChunkedKL(torch.empty(n, dtype=torch.float64))
    for start in range(0, n, chunk_tokens):
        stop = min(n, start + chunk_tokens)
        lp = engine_rows(start, stop).double().log_softmax(-1)
        lq = trainer_rows(start, stop).to(lp.device).double().log_softmax(-1)
        if lp.shape != lq.shape or lp.shape[0] != stop - start:
            raise ValueError(f"chunked_full_kl: rows {start}:{stop}: engine rows {tuple(lp.shape)} vs trainer rows "
                             f"{tuple(lq.shape)} (expected [{stop - start}, V] on both sides)")
        p = lp.exp()
        terms = torch.where(p > 0, p * (lp - lq), torch.zeros_like(p))     # 0 log 0 = 0
        out.per_token[start:stop] = terms.sum(-1).cpu()
        out.chunk_rows.append(stop - start)
    return out


def token_stats(engine_logp: torch.Tensor, trainer_logp: torch.Tensor) -> dict[str, float]:
    """kl_k1 / kl_k3 / ... (algos.mismatch_metrics) and |d log p| quantiles over the scored tokens [n]."""
    if engine_logp.shape != trainer_logp.shape or engine_logp.ndim != 1:
        raise ValueError(f"token_stats: engine log-probs {tuple(engine_logp.shape)} vs trainer "
                         f"{tuple(trainer_logp.shape)}: expected two [n] tensors")
    e, t = engine_logp.double().cpu(), trainer_logp.double().cpu()
    m = algos.mismatch_metrics(e[None], t[None], torch.ones_like(e, dtype=torch.bool)[None])
    absd = (e - t).abs()
    q = torch.quantile(absd, torch.tensor(QUANTILES, dtype=torch.float64))
    return {"kl_k1": m["mismatch/kl_k1"], "kl_k3": m["mismatch/kl_k3"],
            "abs_logp_diff_mean": float(absd.mean()), "abs_logp_diff_p50": float(q[0]),
            "abs_logp_diff_p90": float(q[1]), "abs_logp_diff_p99": float(q[2]), "abs_logp_diff_max": float(absd.max())}


def pair_stats(n: int, engine_rows: RowFn, trainer_rows: RowFn, engine_logp: torch.Tensor,
               trainer_logp: torch.Tensor, chunk_tokens: int) -> dict:
    kl = chunked_full_kl(n, engine_rows, trainer_rows, chunk_tokens)
    return {"full_kl_mean": float(kl.per_token.mean()), "full_kl_max": float(kl.per_token.max()),
            "full_kl_min": float(kl.per_token.min()), "chunk_rows_max": max(kl.chunk_rows),
            **token_stats(engine_logp, trainer_logp)}
