"""rlfp8-diagnose: the engine-trainer mismatch of every (engine precision, trainer arm) pair on one fixed set
of samples (full-vocabulary KL, sampled-token k3, |d log p| quantiles), and the bf16/bf16 floor split into
batch-dependent numerics and kernels. Entry point: rlfp8.diagnose.cli.main (see its docstring)."""
from .cli import main

__all__ = ["main"]
