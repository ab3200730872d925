"""Where the config files live (a leaf module: config.py and data/ both read conf/ through it).

RLFP8_CONF_DIR / RLFP8_RECIPES_DIR point at a copy of conf/ or recipes/ elsewhere (tests, installs).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = Path(os.environ.get("RLFP8_CONF_DIR", REPO / "conf"))
RECIPES_DIR = Path(os.environ.get("RLFP8_RECIPES_DIR", REPO / "recipes"))


def group_defaults(group_file: str) -> dict[str, Any]:
    """The keys and defaults of one flat conf/ file without a defaults list (e.g. "data/common")."""
    from omegaconf import OmegaConf
    path = CONF_DIR / f"{group_file}.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{path}: config file not found (RLFP8_CONF_DIR={CONF_DIR})")
    out = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if "defaults" in out:
        raise ValueError(f"{path}: group_defaults reads flat files only; this one has a defaults list")
    return out
