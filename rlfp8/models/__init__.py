"""Architectures of real models, kept in the repo as HF config.json files, for random-weight runs at real
shapes (timing and memory; vLLM's load_format="dummy"). `random_model_folder(name, out)` writes a folder holding
only that config, which vLLM loads with dummy weights and skip_tokenizer_init=True."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARCHITECTURES = tuple(sorted(p.stem for p in HERE.glob("*.json")))


def architecture_config(name: str) -> dict:
    if name not in ARCHITECTURES:
        raise ValueError(f"architecture {name!r}: allowed values are {list(ARCHITECTURES)} (rlfp8/models/*.json)")
    return json.loads((HERE / f"{name}.json").read_text())


def random_model_folder(name: str, out: str | Path) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / f"{name}.json", out / "config.json")
    return out
