"""Architectures of real models, kept in the repo as HF config.json files, for random-weight runs at real
shapes (timing and memory): model.path=random:<arch>, where <arch> is a file stem here (random:qwen3_8b) or the
path of a config.json-style file (a scaled-down architecture in a test). rlfp8.trainer.hf_models makes the
model folder (config + tokenizer, no weights); the engine loads it with vLLM's load_format="dummy"."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RANDOM_PREFIX = "random:"
ARCHITECTURES = tuple(sorted(p.stem for p in HERE.glob("*.json")))
REQUIRED_KEYS = ("architectures", "hidden_size", "num_hidden_layers", "vocab_size")


def is_random(model_path: str) -> bool:
    """model.path=random:<arch>: random weights in a real architecture's shape."""
    return str(model_path).startswith(RANDOM_PREFIX)


def _arch_file(arch: str) -> Path:
    if arch in ARCHITECTURES:
        return HERE / f"{arch}.json"
    p = Path(arch).expanduser()
    if p.suffix == ".json" and p.is_file():
        return p
    raise ValueError(f"model.path=random:{arch}: unknown architecture; known: {list(ARCHITECTURES)} "
                     f"(rlfp8/models/*.json) or random:<path to a config.json-style file>")


def architecture_config(arch: str) -> dict:
    """The HF config dict of `arch` (a stem in rlfp8/models or a .json path); errors name model.path."""
    path = _arch_file(arch)
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"model.path=random:{arch}: {path} is not valid JSON (line {e.lineno}: {e.msg})") from None
    missing = [k for k in REQUIRED_KEYS if k not in config]
    if missing:
        raise ValueError(f"model.path=random:{arch}: {path} lacks {missing} (an HF config.json is expected)")
    return config


def architecture_stem(arch: str) -> str:
    """A cache-folder name for `arch`: its stem and a hash of its content (an edited file gets a new folder)."""
    path = _arch_file(arch)
    return f"{path.stem}-{hashlib.sha1(path.read_bytes()).hexdigest()[:8]}"


def random_model_folder(name: str, out: str | Path) -> Path:
    """A folder holding only `name`'s config (vLLM with load_format="dummy" and skip_tokenizer_init=True:
    bench/serve.py). Runs use model.path=random:<name>, which adds a tokenizer."""
    import shutil
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(_arch_file(name), out / "config.json")
    return out
