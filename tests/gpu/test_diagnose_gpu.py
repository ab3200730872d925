"""GPU tier for rlfp8-diagnose (marked gpu): the CLI on SmolLM2-135M and on a random model at Qwen3-8B's layer
shapes, every engine precision x trainer arm, each run in its own process; reports go to bench/results/.

    python -m pytest tests/gpu/test_diagnose_gpu.py -m gpu -v -s

What must hold (the measured ratios are the result, in the JSON; only what cannot differ is asserted): every
pair present and finite, none failed, the captured engine distribution agrees with vLLM's returned log-probs,
and the FP8 trainer against the bf16 engine sits above the bf16/bf16 floor (weight rounding shows).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
RUNS = {"smollm2": [], "qwen3_8b_shape": ["diagnose.random_model=qwen3_8b", "diagnose.random_layers=4"]}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_diagnose_on_the_gpu(name):
    out = ROOT / "bench" / "results" / f"diagnose_{name}_h200"
    cmd = [sys.executable, "-m", "rlfp8.diagnose", f"diagnose.out_dir={out}", *RUNS[name]]
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
                       timeout=900)
    print(r.stdout[-6000:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    report = json.loads((out / "report.json").read_text())
    assert not report["failed"] and not report["skipped"]["engines"] and not report["skipped"]["trainers"]
    pairs = {(p["engine"], p["trainer"]): p for p in report["pairs"]}
    assert len(pairs) == 8
    for p in pairs.values():
        assert math.isfinite(p["full_kl_mean"]) and p["full_kl_min"] >= -1e-9
        assert p["engine_info"]["capture_vs_vllm_logp_mean_abs"] < 1e-3     # max: bf16 ulps of another GEMM shape
    assert pairs[("engine_bf16", "trainer_fp8")]["full_kl_mean"] > report["floor"]["bf16_bf16"]
