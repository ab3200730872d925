"""From scored arms to the report: every pair's statistics, and the floor split into its parts.

The floor is the bf16 engine vs the bf16 trainer (full KL). Two pairs of one implementation with itself
isolate the batch-dependent part: HF/HF (the trainer's bf16 forward, one padded batch vs one sequence at a
time) and vLLM/vLLM (the bf16 engine, one step for all sequences vs one per sequence). What the HF/HF pair
does not explain is attributed to the kernels (vLLM's vs HF's): KLs do not add exactly, so the shares are
an approximate split, stated as such.
"""
from __future__ import annotations

from .metrics import pair_stats


def pair_record(engine_arm, trainer_arm, samples, chunk_tokens: int) -> dict:
    """Statistics of KL(engine_arm || trainer_arm) on the samples' scored tokens."""
    stats = pair_stats(samples.num_tokens, engine_arm.rows, trainer_arm.rows, engine_arm.token_logp,
                       trainer_arm.token_logp, chunk_tokens)
    return {"engine": engine_arm.name, "trainer": trainer_arm.name, **stats,
            "engine_info": engine_arm.info, "trainer_info": trainer_arm.info}


def floor_split(pairs: list[dict], hf_pair: dict | None, vllm_pair: dict | None) -> dict:
    base = next((p for p in pairs if p["engine"] == "engine_bf16" and p["trainer"] == "trainer_bf16"), None)
    if base is None:
        return {}
    floor = {"bf16_bf16": base["full_kl_mean"], "bf16_bf16_kl_k3": base["kl_k3"]}
    if hf_pair is not None:
        floor["hf_batch_vs_single"] = hf_pair["full_kl_mean"]
        share = hf_pair["full_kl_mean"] / floor["bf16_bf16"] if floor["bf16_bf16"] > 0 else float("nan")
        floor["batch_share"] = min(1.0, share)
        floor["kernels_share"] = max(0.0, 1.0 - share)
    if vllm_pair is not None:
        floor["vllm_batch_vs_single"] = vllm_pair["full_kl_mean"]
    return floor


# issue 17 / issue 13 acceptance: the matched pair's full KL over the floor and over the W8A8 pair's
MATCHED_PAIR, FLOOR_PAIR, W8A8_PAIR = ("engine_w8a16", "trainer_fp8"), ("engine_bf16", "trainer_bf16"), \
    ("engine_w8a8", "trainer_fp8")
ACCEPTANCE = {"matched_over_floor": (FLOOR_PAIR, 1.4), "matched_over_w8a8": (W8A8_PAIR, 0.2)}


def acceptance(pairs: list[dict]) -> dict:
    """Per ratio: the pairs' full KLs, the ratio, its bound and pass/fail (null where a pair was not scored
    or the denominator is 0)."""
    kl = {(p["engine"], p["trainer"]): p["full_kl_mean"] for p in pairs}
    out = {}
    for name, (denominator, bound) in ACCEPTANCE.items():
        num, den = kl.get(MATCHED_PAIR), kl.get(denominator)
        ratio = num / den if num is not None and den else None
        out[name] = {"numerator": "/".join(MATCHED_PAIR), "denominator": "/".join(denominator),
                     "numerator_kl": num, "denominator_kl": den, "ratio": ratio, "bound": bound,
                     "passed": None if ratio is None else ratio <= bound}
    return out


def build_report(cfg: dict, samples, pairs: list[dict], trainer_arms: dict, hf_floor_arm, vllm_pair: dict | None,
                 skipped: dict, failed: dict, seconds: float) -> dict:
    d = cfg["diagnose"]
    chunk = int(d["chunk_tokens"])
    ref = trainer_arms.get("bf16")
    hf_pair = pair_record(ref, hf_floor_arm, samples, chunk) if ref is not None and hf_floor_arm is not None else None
    floor = floor_split(pairs, hf_pair, vllm_pair)
    for p in pairs:
        p["x_floor"] = p["full_kl_mean"] / floor["bf16_bf16"] if floor and floor["bf16_bf16"] > 0 else None
    return {
        "model": cfg["model"]["path"], "dtype": cfg["model"]["dtype"],
        "samples": {"sequences": len(samples.sequences), "scored_tokens": samples.num_tokens, "source": samples.source},
        "knobs": {k: d[k] for k in ("trainer_head_fp32", "engine_head_fp32", "engine_batch", "batch_invariant",
                                    "attention_backend", "engine_distribution", "chunk_tokens")},
        "kl_direction": "KL(p_engine || p_trainer), full vocabulary, mean over scored tokens",
        "pairs": pairs, "floor": floor, "acceptance": acceptance(pairs), "floor_pairs": {"hf_hf": hf_pair, "vllm_vllm": vllm_pair},
        "skipped": skipped, "failed": failed, "seconds": seconds,
    }
