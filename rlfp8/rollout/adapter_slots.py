"""In-place adapter updates of vLLM's resident LoRA slot, and per-family checksums of what the slot holds.

An update is the trainer's adapter as plain tensors: {"version": int, "tensors": {PEFT key: tensor},
"config": PEFT adapter_config dict}. It is written into the slot vLLM assigned to rlfp8's adapter, in place
(same addresses: CUDA graphs and vLLM's kernel pointer caches stay valid), cast the way the trainer's forward
casts (A -> lora dtype; s·B in fp32, then -> lora dtype), and into vLLM's CPU copy of the adapter too, so an
eviction and re-activation can never bring back older weights.

Checksums are per HF projection name (q_proj, ..., down_proj): the sum over layers of the slot's A and |B|
entries in float64. `expected_checksums(update, dtype)` computes the same numbers from the update itself, so
a mismatch says which projection family did not receive the trainer's weights.
"""
from __future__ import annotations

import math

import torch

PREFIX = "base_model.model."
MAGNITUDE = ".lora_magnitude_vector"          # PEFT's DoRA magnitude key suffix (m [N] per module)


def is_magnitude_key(key: str) -> bool:
    return key.endswith(MAGNITUDE) or key.endswith(MAGNITUDE + ".weight")


def lora_part(update: dict) -> dict:
    """The update without DoRA's magnitudes and flag: what vLLM's own loader accepts (it rejects DoRA)."""
    cfg = {k: v for k, v in update["config"].items() if k != "use_dora"}
    return {**update, "config": cfg, "tensors": {k: v for k, v in update["tensors"].items() if not is_magnitude_key(k)}}


def lora_scaling(config: dict) -> float:
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def cast_like_trainer(update: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """PEFT key -> tensor as the engine stores it: lora_A in `dtype`, lora_B scaled then cast."""
    s = lora_scaling(update["config"])
    out = {}
    for key, t in update["tensors"].items():
        if is_magnitude_key(key):
            continue
        if key.endswith(".lora_B.weight"):
            out[key] = (t.to(torch.float32) * s).to(dtype)
        elif key.endswith(".lora_A.weight"):
            out[key] = t.to(dtype)
        else:
            raise KeyError(f"adapter update: unexpected tensor {key!r} (LoRA updates hold lora_A / lora_B)")
    return out


def _sub_names(module_name: str, packed: dict[str, list[str]]) -> tuple[str, list[str]]:
    parent, _, last = module_name.rpartition(".")
    return parent, packed.get(last, [last])


def linear_modules(manager) -> dict:
    """vLLM's linear LoRA layers (stacked A/B per slice); embeddings and the logits processor are not adapted."""
    return {n: m for n, m in manager.modules.items() if isinstance(getattr(m, "lora_a_stacked", None), tuple)}


def write_slot(manager, lora_id: int, update: dict) -> None:
    """Overwrite the slot (and vLLM's CPU copy) of adapter `lora_id` with `update`, in place."""
    slot = manager.lora_index_to_id.index(lora_id)
    modules = linear_modules(manager)
    dtype = next(iter(modules.values())).lora_a_stacked[0].dtype
    cast = cast_like_trainer(update, dtype)
    used = set()
    cpu_model = manager._registered_adapters[lora_id]
    for name, module in modules.items():
        parent, subs = _sub_names(name, manager.packed_modules_mapping)
        a_list, b_list = [], []
        for sub in subs:
            ka, kb = f"{PREFIX}{parent}.{sub}.lora_A.weight", f"{PREFIX}{parent}.{sub}.lora_B.weight"
            a_list.append(cast.get(ka))
            b_list.append(cast.get(kb))
            used.update(k for k in (ka, kb) if k in cast)
        if all(a is None for a in a_list):
            module.reset_lora(slot)
            continue
        _check_shapes(name, module, a_list, b_list)
        module.reset_lora(slot)
        for i, (a, b) in enumerate(zip(a_list, b_list)):
            if a is not None:
                module.lora_a_stacked[i][slot, 0, : a.shape[0], : a.shape[1]].copy_(a)
                module.lora_b_stacked[i][slot, 0, : b.shape[0], : b.shape[1]].copy_(b)
        _write_cpu_copy(cpu_model, name, a_list, b_list)
        _write_dora_scale(name, module, slot, parent, subs, update)
    unknown = sorted(set(cast) - used)
    if unknown:
        raise KeyError(f"adapter update v{update['version']}: tensors for modules the engine does not adapt: "
                       f"{unknown[:4]} (vLLM LoRA modules: {sorted(modules)[:4]}...)")


def _write_dora_scale(name, module, slot, parent, subs, update) -> None:
    """DoRA: g = m / ||W + sBA||_row per output column from the engine's own FP8 codes (bit-identical to the
    trainer's) and the update's fp32 masters, the trainer's arithmetic; K2's epilogue applies it."""
    t = update["tensors"]
    keys = [next((k for k in (f"{PREFIX}{parent}.{sub}{MAGNITUDE}", f"{PREFIX}{parent}.{sub}{MAGNITUDE}.weight")
                  if k in t), None) for sub in subs]
    if all(k is None for k in keys):
        if hasattr(module, "rlfp8_dora_g"):
            module.rlfp8_dora_g[slot] = 1.0
        return
    if not getattr(module, "rlfp8_dora_active", False):
        raise ValueError(f"adapter update v{update['version']}: a DoRA adapter (adapter.type=dora) needs rlfp8's "
                         f"engine kernels (engine.precision=w8a16 or w8a8) started for DoRA (adapter.type=dora); {name} is not")
    from rlfp8.kernels.dora import dora_column_scale
    base, s = module.base_layer, lora_scaling(update["config"])
    dev = base.weight.device
    start = 0
    for sub, key, width in zip(subs, keys, module.output_slices):
        rows = slice(start, start + width)
        start += width
        if key is None:
            module.rlfp8_dora_g[slot, rows] = 1.0
            continue
        A = t[f"{PREFIX}{parent}.{sub}.lora_A.weight"].to(dev, torch.float32)
        B = t[f"{PREFIX}{parent}.{sub}.lora_B.weight"].to(dev, torch.float32)
        g = dora_column_scale(t[key].to(dev, torch.float32), base.weight[rows], base.weight_scale[rows], A, B, s)
        module.rlfp8_dora_g[slot, rows].copy_(g)


def _check_shapes(name, module, a_list, b_list) -> None:
    for i, (a, b) in enumerate(zip(a_list, b_list)):
        if a is None:
            continue
        slot_a, slot_b = module.lora_a_stacked[i].shape, module.lora_b_stacked[i].shape
        if a.shape[0] > slot_a[2] or a.shape[1] != slot_a[3] or b.shape[0] != slot_b[2] or b.shape[1] > slot_b[3]:
            raise ValueError(f"adapter update: {name} slice {i}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                             f"the engine's slot A {tuple(slot_a)} / B {tuple(slot_b)} (adapter.rank vs the "
                             "engine's max_lora_rank)")


def _write_cpu_copy(cpu_model, name: str, a_list, b_list) -> None:
    weights = cpu_model.loras.get(name)
    if weights is None:
        return
    a_dst = weights.lora_a if isinstance(weights.lora_a, list) else [weights.lora_a]
    b_dst = weights.lora_b if isinstance(weights.lora_b, list) else [weights.lora_b]
    for dst_a, dst_b, a, b in zip(a_dst, b_dst, a_list, b_list):
        if a is not None and dst_a is not None:
            dst_a.copy_(a)
            dst_b.copy_(b)


def slot_checksums(manager, lora_id: int) -> dict[str, float]:
    """HF projection name -> sum over layers of the slot's A and |B| (float64)."""
    slot = manager.lora_index_to_id.index(lora_id)
    out: dict[str, float] = {}
    for name, module in linear_modules(manager).items():
        _, subs = _sub_names(name, manager.packed_modules_mapping)
        for i, sub in enumerate(subs):
            a = module.lora_a_stacked[i][slot].double()
            b = module.lora_b_stacked[i][slot].double()
            out[sub] = out.get(sub, 0.0) + float(a.sum() + b.abs().sum())
    return out


def expected_checksums(update: dict, dtype: torch.dtype) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, t in cast_like_trainer(update, dtype).items():
        sub = key.split(".")[-3]
        v = t.double().sum() if key.endswith(".lora_A.weight") else t.double().abs().sum()
        out[sub] = out.get(sub, 0.0) + float(v)
    return out
