"""The import rules of docs/ARCHITECTURE.md, enforced on the source with ast (no imports run):
the trainer knows no vLLM and no engine, the engine no trainer (the placement joins them), algos and
kernels know neither, and rlfp8 has no import cycle outside kernels/."""
import ast
from pathlib import Path

import pytest

RLFP8 = Path(__file__).resolve().parents[2] / "rlfp8"

# package folder -> module prefixes it must never import (at module level or inside a function)
FORBIDDEN = {
    "trainer": ("vllm", "rlfp8.rollout", "rlfp8.placement", "ray"),
    "rollout": ("rlfp8.trainer", "rlfp8.placement"),
    "algos": ("vllm", "ray", "rlfp8.trainer", "rlfp8.rollout", "rlfp8.placement", "rlfp8.kernels"),
    "kernels": ("vllm", "ray", "rlfp8.trainer", "rlfp8.rollout", "rlfp8.placement", "rlfp8.algos", "transformers"),
    "data": ("vllm", "ray", "rlfp8.trainer", "rlfp8.rollout", "rlfp8.placement", "rlfp8.config"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(RLFP8.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file; relative imports resolved."""
    pkg = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.append((node.lineno, mod))
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]   # `from pkg import module`
    return out


def _files():
    return sorted(RLFP8.rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_nothing_it_must_not(package):
    bad = []
    for path in (RLFP8 / package).rglob("*.py"):
        for line, mod in _imports(path):
            if any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN[package]):
                bad.append(f"{path.relative_to(RLFP8.parent)}:{line} imports {mod}")
    assert not bad, "\n".join(bad)


# Import cycles anywhere in rlfp8/: tests/unit/test_import_cycles.py (one graph builder, not two).


def test_the_checks_see_imports():
    imports = {m for _, m in _imports(next(p for p in _files() if p.name == "actor.py" and p.parent.name == "trainer"))}
    assert "rlfp8.trainer.core" in imports
