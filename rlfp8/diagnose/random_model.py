"""A random-weight model at a real architecture's layer shapes (rlfp8/models/<name>.json), with fewer layers,
written as an HF folder both the engine and the trainer load (so both compute on the same random weights,
unlike vLLM's load_format="dummy"), plus a word-level tokenizer covering the whole vocabulary ("t<id>")."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def word_level_tokenizer(vocab_size: int, eos_id: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=f"t{eos_id}", pad_token=f"t{eos_id}", unk_token="t0")


def random_model_folder(arch: str, layers: int, cache: Path, seed: int, device: str) -> Path:
    """cache/random-<arch>-<layers>l-seed<seed>: made once (weights drawn on `device`, saved in bfloat16)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlfp8.models import architecture_config
    out = Path(cache) / f"random-{arch}-{layers}l-seed{seed}"
    if (out / ".complete").exists():
        return out
    spec = architecture_config(arch)
    spec["num_hidden_layers"] = int(layers)
    if "layer_types" in spec:
        spec["layer_types"] = spec["layer_types"][:layers]
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(spec))
    config = AutoConfig.from_pretrained(tmp)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(tmp)
    eos = spec.get("eos_token_id") or 0
    word_level_tokenizer(int(spec["vocab_size"]), int(eos if isinstance(eos, int) else eos[0])).save_pretrained(tmp)
    (tmp / ".complete").write_text(json.dumps({"arch": arch, "layers": layers, "seed": seed}))
    tmp.rename(out)
    return out


def random_prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` token ids drawn uniformly (ids 1..V-1), seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (count, length), generator=g).tolist()
