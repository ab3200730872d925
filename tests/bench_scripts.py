"""Load a bench/ script as a module for its CPU tests (bench/ is scripts, not a package). Never by putting bench/
on sys.path: a script named like an installed module shadows it (bench/kernels.py hid transformers' `kernels`)."""
import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench_script(stem: str):
    """bench/<stem>.py as module `bench_<stem>`, registered in sys.modules (dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(f"bench_{stem}", BENCH / f"{stem}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
