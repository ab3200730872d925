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


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in _files()}
    graph = {}
    for name, path in modules.items():
        deps = {m for _, m in _imports(path) if m in modules and m != name}
        graph[name] = {d for d in deps if not (path.name == "__init__.py" and d.startswith(name + "."))}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_outside_kernels():
    cycles = [c for c in _cycles(_graph()) if not all(m.startswith("rlfp8.kernels") for m in c)]
    assert not cycles, cycles


def test_the_checks_see_imports():
    g = _graph()
    assert "rlfp8.data.prompts" in g["rlfp8.data.tasks"] and "rlfp8.trainer.core" in g["rlfp8.trainer.actor"]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
