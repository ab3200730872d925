"""Log-probabilities of sampled tokens without ever holding the full [B, T, V] logits.

The final hidden states of the response positions are gathered first ([n, D], n = response tokens),
then the lm_head + temperature + log-softmax runs over chunks of `chunk_size` rows. The autograd
Function saves only the hidden states and recomputes each chunk's logits in backward, so the peak
extra memory is one [chunk, V] block in fp32, in forward and backward alike.

    z = (h @ W^T) / T ;  logp = z[y] - logsumexp(z) ;  d logp / dz = onehot(y) - softmax(z)
    H = logsumexp(z) - sum(p z) ;  d H / dz = -p (z - sum(p z))      (p = softmax(z))

The entropy has a gradient (the entropy bonus, algo.entropy_coeff); backward adds its term only
when the entropy reaches the loss.

The lm_head weight is frozen (only adapters train), so backward produces dh only.
"""
from __future__ import annotations

import torch


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    # h [c, D] model dtype, weight [V, D] -> fp32 logits [c, V] (bf16 GEMM, fp32 softmax as vLLM does)
    z = torch.nn.functional.linear(h, weight).float()
    return z / temperature if temperature != 1.0 else z


class ChunkedTokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_size: int, want_entropy: bool):
        # hidden [n, D], weight [V, D], targets [n] int64 -> logp [n] fp32, entropy [n] fp32
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        ent = hidden.new_zeros(n, dtype=torch.float32)
        for s in range(0, n, chunk_size):
            z = _chunk_logits(hidden[s:s + chunk_size], weight, temperature)
            lse = torch.logsumexp(z, dim=-1)
            logp[s:s + chunk_size] = z.gather(1, targets[s:s + chunk_size, None])[:, 0] - lse
            if want_entropy:
                p = torch.softmax(z, dim=-1)
                ent[s:s + chunk_size] = lse - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)          # dlogp / dent arrive as None when unused
        if not want_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, dlogp, dent):
        hidden, weight, targets = ctx.saved_tensors
        T, c = ctx.temperature, ctx.chunk_size
        if dlogp is None and dent is None:
            return None, None, None, None, None, None
        dh = torch.empty_like(hidden)
        for s in range(0, hidden.shape[0], c):
            z = _chunk_logits(hidden[s:s + c], weight, T)
            p = torch.softmax(z, dim=-1)                                     # [c, V]
            dz = torch.zeros_like(p)
            if dlogp is not None:
                dz = -p
                dz.scatter_add_(1, targets[s:s + c, None], torch.ones_like(dz[:, :1]))
                dz *= dlogp[s:s + c, None]
            if dent is not None:
                dz -= p * (z - (p * z).sum(-1, keepdim=True)) * dent[s:s + c, None]
            dz /= T
            dh[s:s + c] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
        return dh, None, None, None, None, None


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   chunk_size: int = 1024, entropy: bool = False):
    """logp [n] (and entropy [n]) of `targets` under softmax((hidden @ weight^T) / temperature)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0 (greedy decoding has no log-probs to train on)")
    logp, ent = ChunkedTokenLogProbs.apply(hidden, weight, targets, float(temperature), int(chunk_size), entropy)
    return (logp, ent) if entropy else logp


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                      temperature: float = 1.0, chunk_size: int = 1024, entropy: bool = False):
    """Log-probs of input_ids[:, 1:] at the positions where loss_mask[:, 1:] is set.

    input_ids, attention_mask, loss_mask: [B, L] (right-padded). Returns logp [B, L-1] fp32 (zeros off
    the mask) and, if asked, entropy [B, L-1]. Only the masked rows reach the lm_head.
    """
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    hidden = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state  # [B, L, D]
    sel = loss_mask[:, 1:].bool()                                            # [B, L-1]
    h = hidden[:, :-1][sel]                                                  # [n, D]
    tgt = input_ids[:, 1:][sel]                                              # [n]
    lm_head = model.get_output_embeddings()
    res = token_logprobs(h, lm_head.weight, tgt, temperature, chunk_size, entropy)
    lp, ent = res if entropy else (res, None)
    out = hidden.new_zeros(sel.shape, dtype=torch.float32).masked_scatter(sel, lp)
    if entropy:
        return out, hidden.new_zeros(sel.shape, dtype=torch.float32).masked_scatter(sel, ent)
    return out
