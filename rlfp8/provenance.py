"""What a result file records about where it came from: the command line, the package versions, the GPU."""
from __future__ import annotations

import platform
import shlex
import sys


def versions(modules: tuple[str, ...] = ("torch", "triton", "vllm", "transformers", "ray")) -> dict:
    out = {"python": platform.python_version()}
    for mod in modules:
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:          # recorded, not fatal: the JSON says what was missing
            out[mod] = f"unavailable ({type(e).__name__})"
    try:
        import torch
        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:
        out["gpu"] = "unknown"
    return out


def command() -> str:
    """This process's command line as one could type it again."""
    return " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
