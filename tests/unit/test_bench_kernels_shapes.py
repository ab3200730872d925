"""bench/kernels.py --shape: the decoder layer's projections come from the architecture's config (the 8B literal the
benchmark always used, the 32B shape for issue 14's placements), and a tuning run at one shape keeps another
shape's tuned entries (the table is one file per GPU)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import kernels as kb  # noqa: E402


def test_projection_shapes_from_the_architecture_configs():
    assert kb.projection_shapes("qwen3_8b") == kb.PROJ        # the literal every committed 8B result used
    p32 = kb.projection_shapes("qwen3_32b")
    assert p32 == {"qkv": (5120, (8192, 1024, 1024)), "o": (8192, (5120,)), "gate_up": (5120, (25600, 25600)),
                   "down": (25600, (5120,))}
    assert kb.table_ks(kb.PROJ) == {4096, 12288, 6144, 24576}
    assert not kb.table_ks(p32) & kb.table_ks(kb.PROJ)         # disjoint keys: the shapes never share an entry


def test_a_tuning_run_keeps_other_shapes_entries_and_with_tune_keys_the_untouched_ones():
    old = {"w8a16|64|4096|narrow": 1, "w8a16|64|12288|narrow": 2, "w8a16T|4611686018427387904|6144|narrow": 3,
           "w8a16|64|5120|narrow": 4}
    ks32 = kb.table_ks(kb.projection_shapes("qwen3_32b"))
    new32 = {"w8a16|64|5120|wide"}
    assert kb.kept_entries(old, new32, None, ks32) == {k: v for k, v in old.items() if k != "w8a16|64|5120|narrow"}
    assert kb.kept_entries(old, new32, "w8a16\\|64\\|5120\\|wide", ks32) == old
    ks8 = kb.table_ks(kb.PROJ)                                 # a full 8B retune replaces the 8B keys only
    assert kb.kept_entries(old, {"w8a16|64|4096|narrow"}, None, ks8) == {"w8a16|64|5120|narrow": 4}


def test_out_defaults_by_shape_and_the_readme_table_stays_8b(capsys):
    assert kb._args([]).out.endswith("bench/results/kernels_h200.json")
    assert kb._args(["--shape", "qwen3_32b"]).out.endswith("bench/results/kernels_qwen3_32b_h200.json")
    with pytest.raises(SystemExit):
        kb._args(["--shape", "qwen3_32b", "--update-readme"])
    assert "--update-readme" in capsys.readouterr().err
