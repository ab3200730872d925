"""Gradient checkpointing per decoder layer, sized to the memory the train phase has (trainer.gradient_checkpointing).

    true   every decoder layer recomputes its activations in backward (the least memory; verl's recipes)
    false  none does (the fastest update while it fits)
    N      the first N layers do (an integer 0..num_layers)
    auto   at each train step, the fewest first layers such that the step's largest micro-batch fits in the
           memory free at that moment (device free + torch's cached blocks, less trainer.activation_headroom_gib)

Design choices:
- Why per layer: the recompute is one more forward of every checkpointed layer (a third of the update's GEMM
  work with LoRA, which computes no base-weight gradient), and the memory one layer's saved activations take is
  known per token. With placement=one_copy and the KV cache released, most of the GPU is free while the trainer
  runs; `auto` turns it into fewer recomputes instead of leaving it idle.
- Which layers: the first N. Backward runs last layer first, so the kept (last) layers' activations are freed
  before any checkpointed layer recomputes: the recompute's transient never adds to the end-of-forward peak.
- The bytes a layer saves are measured, not modelled (`measure_saved_bytes`): one grad-enabled forward of the
  backbone at three short lengths with every layer kept, counting the storages autograd saves while each layer
  runs (saved_tensors_hooks; weights and per-call constants are the fit's constant term, an attention kernel that
  saves its probabilities its quadratic one). It
  runs once per trainer, on its device and kernels, so it sees what the FP8 linear, the attention kernel and
  the adapter kind (DoRA saves more) really keep. A checkpointed layer keeps its input: hidden_size x the
  model dtype per token.
- The result is the same update either way: a checkpointed layer's recompute runs the same kernels on the same
  inputs (tests/unit/test_checkpointing.py compares the gradients).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

log = logging.getLogger("rlfp8.trainer")

PROBE_TOKENS = (32, 64, 128)     # the lengths of the measuring forwards (one row each)


def parse_mode(value, num_layers: int | None = None):
    """trainer.gradient_checkpointing -> True | False | "auto" | int; a clear error for anything else."""
    if isinstance(value, bool) or value == "auto":
        return value
    if isinstance(value, int) and value >= 0:
        if num_layers is not None and value > num_layers:
            raise ValueError(f"trainer.gradient_checkpointing={value}: the model has {num_layers} decoder layers "
                             f"(use 0..{num_layers}, true, false or auto)")
        return value
    raise ValueError(f"trainer.gradient_checkpointing={value!r}: allowed values are true, false, auto or a number "
                     f"of decoder layers >= 0 (the first that many are checkpointed)")


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of an HF causal LM (transformers' GradientCheckpointingLayer), in order."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(body, "layers", None)
    if layers is None or not all(hasattr(layer, "gradient_checkpointing") for layer in layers):
        raise TypeError(f"{type(model).__name__}: no decoder layers with a gradient_checkpointing flag "
                        f"(transformers' GradientCheckpointingLayer) under get_decoder().layers")
    return list(layers)


def enable_checkpointing(model) -> None:
    """transformers' non-reentrant checkpointing on every layer (>= 5.24 renamed the method; the GPU machines run
    5.17); `set_checkpointed` then chooses the layers."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def set_checkpointed(layers: list[torch.nn.Module], n: int) -> None:
    """The first n layers recompute in backward, the others keep their activations."""
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i < n


def checkpointed_count(layers: list[torch.nn.Module]) -> int:
    return sum(bool(layer.gradient_checkpointing) for layer in layers)


@dataclass(frozen=True)
class SavedBytes:
    """What one decoder layer keeps for backward. Kept: per_token x tokens + per_token_sq x sum of rows' length^2
    (the second term is an attention kernel that saves its probabilities, e.g. torch's math SDPA on a CPU; ~0 for
    flash attention); checkpointed: its input hidden states, per token."""
    per_token: float
    per_token_sq: float
    checkpointed_per_token: float

    def kept(self, rows: int, length: int) -> float:
        return rows * (self.per_token * length + self.per_token_sq * length * length)

    def checkpointed(self, rows: int, length: int) -> float:
        return rows * length * self.checkpointed_per_token


def saved_bytes_by_layer(model, layers: list[torch.nn.Module], input_ids: torch.Tensor) -> list[int]:
    """Bytes autograd saves while each decoder layer runs, for one grad-enabled backbone forward of input_ids with
    every layer kept (a storage is charged once, to the first layer that saves it). Weights count too: they are
    the same at every length, so the fit in measure_saved_bytes takes them as its constant."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    flags = [layer.gradient_checkpointing for layer in layers]
    current: list[int | None] = [None]
    counted = [0] * len(layers)
    seen: set[int] = set()

    def pack(t: torch.Tensor):
        if current[0] is not None:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                counted[current[0]] += storage.nbytes()
        return t

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)))
        handles.append(layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)))
    was_training = model.training
    try:
        set_checkpointed(layers, 0)
        model.train()
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = body(input_ids=input_ids, use_cache=False).last_hidden_state
        del out                                   # drops the graph and what it saved
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
        for layer, flag in zip(layers, flags):
            layer.gradient_checkpointing = flag
    return counted


def measure_saved_bytes(model, layers: list[torch.nn.Module], device: torch.device, vocab_size: int,
                        hidden_size: int, dtype: torch.dtype) -> SavedBytes:
    """saved_bytes_by_layer at each PROBE_TOKENS length (one row); the three totals fix a + b T + c T^2 exactly
    (a: weights and per-call constants); per layer: / the layer count."""
    gen = torch.Generator().manual_seed(0)
    totals = [sum(saved_bytes_by_layer(model, layers, torch.randint(0, vocab_size, (1, t), generator=gen).to(device)))
              for t in PROBE_TOKENS]
    t = torch.tensor(PROBE_TOKENS, dtype=torch.float64)
    vander = torch.stack([torch.ones_like(t), t, t * t], dim=1)
    _, b, c = torch.linalg.solve(vander, torch.tensor(totals, dtype=torch.float64)).tolist()
    itemsize = torch.empty((), dtype=dtype).element_size()
    return SavedBytes(per_token=max(0.0, b) / len(layers), per_token_sq=max(0.0, c) / len(layers),
                      checkpointed_per_token=float(hidden_size * itemsize))


def plan_checkpointed(num_layers: int, kept_bytes: float, checkpointed_bytes: float, budget_bytes: float) -> int:
    """The fewest first layers to checkpoint so that one micro-batch's saved activations fit in budget_bytes
    (kept_bytes / checkpointed_bytes: what one layer saves for it either way): n x checkpointed + (L - n) x kept
    <= budget. All of them when even that does not fit (the out-of-memory guard then reports the plan)."""
    full = num_layers * kept_bytes
    if full <= budget_bytes:
        return 0
    gain = kept_bytes - checkpointed_bytes                # what checkpointing one more layer saves
    if gain <= 0:
        return num_layers
    return min(num_layers, math.ceil((full - budget_bytes) / gain))


def free_bytes(device: torch.device) -> float:
    """Memory this process can still take: on a GPU the device's free memory plus torch's cached, unallocated
    blocks; on a CPU the host's MemAvailable (0 if /proc/meminfo cannot be read: then everything is checkpointed)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


class LayerCheckpointing:
    """The trainer's checkpointing policy (trainer.gradient_checkpointing), applied once at set-up (true, false, N)
    or before every train step (auto)."""

    def __init__(self, model, tcfg: dict, device: torch.device, dtype: torch.dtype, vocab_size: int,
                 hidden_size: int):
        self.model, self.device, self.dtype = model, device, dtype
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.headroom = float(tcfg["activation_headroom_gib"]) * 2**30
        self.logits_bytes = 3.0 * int(tcfg["logprob_chunk"]) * vocab_size * 4     # fp32 chunks in fwd / bwd
        self.mode = tcfg["gradient_checkpointing"]
        self.layers: list[torch.nn.Module] = []
        self.saved: SavedBytes | None = None
        if self.mode is False or self.mode == 0:
            return
        self.layers = decoder_layers(model)
        self.mode = parse_mode(self.mode, len(self.layers))
        enable_checkpointing(model)
        every = self.mode is True or self.mode == "auto"        # (1 == True: no `in (True, ...)` here)
        set_checkpointed(self.layers, len(self.layers) if every else int(self.mode))

    @property
    def checkpointed(self) -> int:
        return checkpointed_count(self.layers) if self.layers else 0

    def before_step(self, micro_batch_shapes: list[tuple[int, int]]) -> dict[str, float]:
        """auto: choose the layers for this step's largest micro-batch ((rows, padded length) each); returns the
        train/ metrics."""
        if self.mode == "auto" and micro_batch_shapes:
            if self.saved is None:
                self.saved = measure_saved_bytes(self.model, self.layers, self.device, self.vocab_size,
                                                 self.hidden_size, self.dtype)
                log.info("gradient checkpointing auto: a kept layer saves %.1f KiB per token (+ %.3f KiB x length), "
                         "a checkpointed one %.1f KiB", self.saved.per_token / 1024, self.saved.per_token_sq / 1024,
                         self.saved.checkpointed_per_token / 1024)
            rows, length = max(micro_batch_shapes, key=lambda s: self.saved.kept(*s))
            kept = self.saved.kept(rows, length)
            # headroom, the lm_head chunks, and one layer's activations for backward's own buffers
            budget = free_bytes(self.device) - self.headroom - self.logits_bytes - kept
            n = plan_checkpointed(len(self.layers), kept, self.saved.checkpointed(rows, length), budget)
            if n != self.checkpointed:
                log.info("gradient checkpointing auto: %d of %d layers checkpointed for %d x %d-token micro-batches "
                         "(%.1f GiB for activations)", n, len(self.layers), rows, length, max(budget, 0) / 2**30)
            set_checkpointed(self.layers, n)
        out = {"train/checkpointed_layers": float(self.checkpointed)}
        if self.saved is not None:
            out["train/saved_kib_per_token_layer"] = self.saved.per_token / 1024
        return out
