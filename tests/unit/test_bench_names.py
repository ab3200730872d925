"""A bench script runs with bench/ first on sys.path (Python puts the script's folder there), so a script named
like an installed module shadows it for everything the script imports: bench/kernels.py did this to the
`kernels` package transformers imports, and peft failed to import. No bench/ or bench/lab/ script may share a
name with an importable top-level module."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def shadowed(scripts):
    """{script: origin of the installed module of the same name} for the scripts that would shadow one."""
    found = {}
    for p in scripts:
        spec = importlib.util.find_spec(p.stem)
        if spec is not None and Path(spec.origin or "").resolve() != p.resolve():
            found[str(p)] = spec.origin
    return found


def test_no_bench_script_shadows_an_installed_module():
    scripts = sorted(ROOT.glob("bench/*.py")) + sorted(ROOT.glob("bench/lab/*.py"))
    assert any(p.stem == "kernel_bench" for p in scripts)
    assert not shadowed(scripts), f"bench scripts shadow installed modules (rename them): {shadowed(scripts)}"


def test_the_check_flags_a_clash(tmp_path):
    clash, fine = tmp_path / "json.py", tmp_path / "rlfp8_no_such_module_here.py"
    clash.write_text(""), fine.write_text("")
    assert list(shadowed([clash, fine])) == [str(clash)]
