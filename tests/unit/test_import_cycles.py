"""No import cycle inside rlfp8/: the graph of intra-package imports (module-level and function-level, read
with ast, nothing imported) has no strongly connected component of more than one module."""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "rlfp8"
# cycles outside rlfp8/kernels that another branch removes (issue 12 item 1-5); listed, not hidden
KNOWN_ELSEWHERE = {frozenset({"rlfp8.data.prompts", "rlfp8.data.tasks"})}


def _modules() -> dict[str, Path]:
    mods = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _imports(name: str, path: Path, mods: dict) -> set[str]:
    """The rlfp8 modules `name` imports anywhere in its body (a `from X import y` counts X.y when it is a
    module, else X)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in mods}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if sub in mods else target)
    return {m for m in out if m in mods and m != name}


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[frozenset]:
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
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_function_level_and_relative_imports():
    g = import_graph()
    assert "rlfp8.kernels.gemm_triton" in g["rlfp8.kernels.gemm"]          # inside the dispatcher function
    assert "rlfp8.kernels.fp8_ref" in g["rlfp8.kernels.fp8_triton"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]


def test_no_import_cycle_inside_kernels():
    found = [sorted(c) for c in cycles(import_graph()) if any(m.startswith("rlfp8.kernels") for m in c)]
    assert not found, f"import cycles involving rlfp8/kernels: {found}"


def test_no_import_cycle_in_rlfp8():
    found = cycles(import_graph())
    unknown = [sorted(c) for c in found if c not in KNOWN_ELSEWHERE]
    assert not unknown, f"import cycles in rlfp8/: {unknown}"
    if found:
        pytest.xfail(f"cycles another branch removes (issue 12): {[sorted(c) for c in found]}")


def test_kernels_import_no_engine_model_or_ray():
    """rlfp8/kernels knows no engine: no vLLM, Ray or transformers import, no import of the roles above it."""
    banned = ("vllm", "ray", "transformers", "rlfp8.rollout", "rlfp8.trainer", "rlfp8.placement", "rlfp8.train",
              "rlfp8.data", "rlfp8.algos")
    found = []
    for f in (PKG / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{f.name}: {n}" for n in names if any(n == b or n.startswith(b + ".") for b in banned)]
    assert not found, found
