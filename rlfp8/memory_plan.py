"""The GPU memory plan of a run: memory/* metrics per phase, and an out-of-memory error in any phase turned into
a message that shows the plan (what each part took when last measured) and the config keys that size it.

Phases: setup (engine start: weights + KV cache; trainer start: its base), rollout (engine: weights, KV cache,
activations), train (trainer: base, adapter + optimizer, activations; one_copy: the engine's KV released),
sync (adapter to the engine). Metrics are `memory/<phase>/<name>_gib`, from engine.memory() and
trainer.memory() (GPU only: CPU runs log none). Imports no role: the driver (train.py) uses it.
"""
from __future__ import annotations

from contextlib import contextmanager

# what sizes memory in each phase (config keys, most effective first)
SIZING_KEYS = {
    "setup": ("engine.kv_cache_memory_gb", "engine.gpu_memory_utilization", "engine.max_model_len",
              "engine.max_num_seqs", "engine.precision", "trainer.weights", "placement.name"),
    "rollout": ("engine.max_num_seqs", "engine.max_model_len", "engine.kv_cache_memory_gb",
                "engine.gpu_memory_utilization", "data.prompts_per_step", "algo.group_size", "algo.max_response_len"),
    "train": ("trainer.micro_batch_tokens", "trainer.gradient_checkpointing", "trainer.activation_headroom_gib",
              "trainer.logprob_chunk", "engine.release_kv", "engine.release_weights", "adapter.rank",
              "placement.name", "engine.kv_cache_memory_gb"),
    "sync": ("adapter.rank", "adapter.target_modules", "engine.kv_cache_memory_gb"),
}
# vLLM's messages when the KV cache cannot be sized (it raises ValueError, not torch.OutOfMemoryError)
OOM_MESSAGES = ("out of memory", "no available memory for the cache blocks", "available kv cache memory",
                "larger than the available kv cache", "less than desired gpu memory utilization",
                "cuda_error_out_of_memory")


class OutOfMemoryPlanError(RuntimeError):
    """An out-of-memory error, re-raised with the memory plan and the keys that size it."""


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.OutOfMemoryError or vLLM's KV-cache-too-small ValueError, also wrapped (Ray: .cause, __cause__)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if type(exc).__name__ == "OutOfMemoryError":
            return True
        if any(m in str(exc).lower() for m in OOM_MESSAGES):
            return True
        exc = getattr(exc, "cause", None) or exc.__cause__ or exc.__context__
    return False


def phase_metrics(phase: str, memory: dict[str, float]) -> dict[str, float]:
    """memory/<name> -> memory/<phase>/<name>."""
    return {f"memory/{phase}/{k.removeprefix('memory/')}": v for k, v in memory.items()}


def _value(cfg: dict, key: str):
    node = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return "(unset)"
        node = node[part]
    return node


def plan_message(phase: str, cfg: dict, measured: dict[str, float], error: BaseException | None = None) -> str:
    """The plan: the error, the last measured memory/* per phase, then the keys sizing `phase` with their values."""
    lines = [f"out of memory in phase '{phase}' (placement={_value(cfg, 'placement.name')}, "
             f"engine.precision={_value(cfg, 'engine.precision')}, trainer.weights={_value(cfg, 'trainer.weights')})"]
    if error is not None:
        first = next((line for line in str(getattr(error, "cause", None) or error).splitlines() if line.strip()), "")
        lines.append(f"error: {type(getattr(error, 'cause', None) or error).__name__}: {first[:400]}")
    lines.append("memory plan, last measured (GiB):")
    if measured:
        lines += [f"  {k.removeprefix('memory/')}: {v:.2f}" for k, v in sorted(measured.items())
                  if isinstance(v, (int, float))]
    else:
        lines.append("  nothing measured yet (the error came before the first step)")
    planned = _planned(cfg)
    if planned:
        lines.append("planned (rough, rlfp8.memory_plan.estimate, GiB): " +
                     ", ".join(f"{k} {v:.1f}" for k, v in planned.items()))
    keys = SIZING_KEYS.get(phase, SIZING_KEYS["setup"])
    lines.append(f"config keys that size '{phase}': " + ", ".join(f"{k}={_value(cfg, k)}" for k in keys))
    lines.append("lower one of them (or trainer.gradient_checkpointing=true, engine.release_kv=true with "
                 "placement=one_copy) and run again")
    return "\n".join(lines)


def _planned(cfg: dict) -> dict[str, float]:
    """estimate() from the resolved model folder's config.json; {} when there is none (yet)."""
    import json
    from pathlib import Path
    folder = _value(cfg, "model.resolved_path")
    try:
        return estimate(cfg, json.loads((Path(str(folder)) / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return {}


@contextmanager
def on_out_of_memory(phase: str, cfg: dict, measured: dict[str, float]):
    """Within: an out-of-memory error becomes OutOfMemoryPlanError(plan_message(...)); others pass unchanged."""
    try:
        yield
    except OutOfMemoryPlanError:
        raise
    except BaseException as e:   # noqa: BLE001 - Ray wraps the actor's error; the type test is is_out_of_memory
        if not is_out_of_memory(e):
            raise
        raise OutOfMemoryPlanError(plan_message(phase, cfg, measured, e)) from e


def estimate(cfg: dict, arch: dict) -> dict[str, float]:
    """A rough plan (GiB) from the config and the model's HF config dict, before anything runs: engine FP8
    projections (1 byte per weight; a bf16 engine 2) and its other tensors, the KV cache (engine.kv_cache_memory_gb,
    else what the whole batch needs), and the trainer's base (0 with one_copy), its other tensors and an upper
    estimate of its activations per micro-batch. `peak` is the largest of what is resident at once in rollout (an
    offloaded base on the host), train (the KV cache unless released, the engine's weights unless released) and,
    with engine.release_weights, the moment between them when both bases are on the device."""
    gib, h, inter, layers = 2**30, arch["hidden_size"], arch["intermediate_size"], arch["num_hidden_layers"]
    kv_heads = arch["num_key_value_heads"]
    head_dim = arch.get("head_dim") or h // arch["num_attention_heads"]
    elem = 4 if cfg["model"]["dtype"] == "float32" else 2
    proj = projection_params(arch)
    dense = arch["vocab_size"] * h * (1 if arch.get("tie_word_embeddings") else 2) * elem
    eng_bytes = 1 if cfg["engine"]["precision"] in ("w8a16", "w8a8", "w8a8_vllm") else elem
    ecfg, tcfg = cfg["engine"], cfg["trainer"]
    seqs = min(int(ecfg["max_num_seqs"]), int(cfg["data"]["prompts_per_step"]) * int(cfg["algo"]["group_size"]))
    kv_need = seqs * int(ecfg["max_model_len"]) * 2 * layers * kv_heads * head_dim * elem
    kv = float(ecfg["kv_cache_memory_gb"]) * gib if ecfg["kv_cache_memory_gb"] else kv_need
    one_copy = cfg["placement"]["name"] == "one_copy"
    trainer_base = 0 if one_copy else proj * (1 if tcfg["weights"] == "fp8" else elem)
    # a random model's embeddings/lm_head are mapped from the engine too with one_copy (rlfp8/trainer/weights.py)
    trainer_dense = 0 if one_copy and str(cfg["model"]["path"]).startswith("random:") else dense
    per_layer_token = (16 * h + 6 * inter) * 2                  # saved bf16 activations of one decoder layer
    tokens = int(tcfg["micro_batch_tokens"])
    # checkpointed layers keep their input (h per token), the others everything; auto plans at run time from what is
    # free then, so its estimate is the floor (every layer checkpointed): what must fit for the step to run at all
    gc = tcfg["gradient_checkpointing"]
    n_ckpt = layers if gc is True or gc == "auto" else (0 if gc is False else min(int(gc), layers))
    saved = n_ckpt * h * 2 + (layers - n_ckpt) * per_layer_token + (per_layer_token if n_ckpt else 0)
    acts = tokens * saved + 3 * int(tcfg["logprob_chunk"]) * arch["vocab_size"] * 4
    adapter = adapter_params(cfg, arch)
    plan = {"engine_weights": (proj * eng_bytes + dense) / gib, "kv_cache": kv / gib, "kv_cache_needed": kv_need / gib,
            "trainer_base": trainer_base / gib, "trainer_dense": trainer_dense / gib, "trainer_activations": acts / gib,
            # the adapter in fp32 with its gradient and AdamW's two moments; the engine's slot in the model dtype
            "trainer_optimizer": adapter * 16 / gib, "engine_lora": adapter * elem / gib}
    released = kv_released_while_training(cfg)
    weights_out = bool(ecfg["release_weights"])
    base = plan["trainer_base"] + plan["trainer_dense"]
    offloaded = cfg["placement"]["name"] == "offloaded"          # its base waits on the host while the engine runs
    rollout = plan["engine_weights"] + plan["kv_cache"] + (0 if offloaded else base)
    train = ((0 if weights_out else plan["engine_weights"]) + (0 if released else plan["kv_cache"]) + base
             + plan["trainer_activations"])
    # engine.release_weights: between the phases both bases are on the device (no KV cache, no activations)
    between = plan["engine_weights"] + base if weights_out else 0.0
    plan["peak"] = max(rollout, train, between)
    return plan


def kv_released_while_training(cfg: dict) -> bool:
    """engine.release_kv resolved from the config alone (auto = on for placement=one_copy or with
    engine.release_weights); rlfp8.rollout.engine.kv_release_enabled adds that it needs a GPU."""
    value = cfg["engine"]["release_kv"]
    if value == "auto":
        return cfg["placement"]["name"] == "one_copy" or bool(cfg["engine"]["release_weights"])
    return bool(value)


def projection_shapes(arch: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each of one decoder layer's seven projections, from the model's HF config dict."""
    h, inter, heads = arch["hidden_size"], arch["intermediate_size"], arch["num_attention_heads"]
    head_dim = arch.get("head_dim") or h // heads
    q, kv = heads * head_dim, arch["num_key_value_heads"] * head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
            "up_proj": (h, inter), "down_proj": (inter, h)}


def projection_params(arch: dict) -> int:
    """Weights of every layer's projections (the part rlfp8 quantizes)."""
    return arch["num_hidden_layers"] * sum(i * o for i, o in projection_shapes(arch).values())


def adapter_params(cfg: dict, arch: dict) -> int:
    """Trainable LoRA parameters: adapter.rank x (in + out features) of every adapted projection of every layer."""
    in_out = projection_shapes(arch)
    per_layer = sum(sum(in_out[m]) for m in cfg["adapter"]["target_modules"] if m in in_out)
    return int(cfg["adapter"]["rank"]) * per_layer * arch["num_hidden_layers"]
