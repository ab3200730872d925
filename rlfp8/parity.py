"""The parity probe: after an adapter sync, does the engine compute with the trainer's adapter?

Two checks, both cheap, run every `engine.parity_probe.every` syncs:
1. Slot contents: per projection family (q_proj ... down_proj), the checksum of what the engine's LoRA slot
   holds equals the checksum of the update the trainer sent, cast as the engine stores it (exact: the same
   cast on both sides). A difference names the family that did not receive the weights.
2. Arithmetic: the engine scores a fixed probe batch (token sequences fixed at set-up) and the trainer scores
   the same tokens; the mean |log p_engine - log p_trainer| must stay within `factor` x the pair's own floor
   (the same statistic measured once without any adapter, at set-up) + `abs_tol`. The floor makes the bound
   follow the precision pair: ~1e-6 for the matched engine in fp32, bf16-level for a bf16 engine.
A failure raises ParityError with the adapter version, the step and what differed; the run stops (verl
#3516 is this failure, shipped silently).
"""
from __future__ import annotations

from dataclasses import dataclass, field


class ParityError(RuntimeError):
    pass


def mean_abs_diff(a: list[list[float]], b: list[list[float]]) -> tuple[float, float]:
    diffs = [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    if not diffs:
        raise ValueError("parity probe: no tokens to compare")
    return sum(diffs) / len(diffs), max(diffs)


@dataclass
class ParityProbe:
    sequences: list[list[int]]
    prompt_lens: list[int]
    factor: float
    abs_tol: float
    floor: float = float("nan")
    history: list[dict] = field(default_factory=list)

    def measure_floor(self, engine_logprobs: list[list[float]], trainer_logprobs: list[list[float]]) -> float:
        """Mismatch of this engine/trainer pair without any adapter (the precision's own floor), from both
        sides' scores of the probe batch with the adapter off."""
        self.floor, _ = mean_abs_diff(engine_logprobs, trainer_logprobs)
        return self.floor

    @property
    def bound(self) -> float:
        return self.factor * self.floor + self.abs_tol

    def check(self, *, version: int, step: int, engine_logprobs: list[list[float]],
              trainer_logprobs: list[list[float]], engine_checksums: dict[str, float],
              expected_checksums: dict[str, float]) -> dict[str, float]:
        """Both sides' scores of the probe batch with the new adapter (the RL loop takes them at once) and the
        engine's slot checksums against the ones the update implies; ParityError when either is off."""
        bad = sorted(k for k in set(engine_checksums) | set(expected_checksums)
                     if engine_checksums.get(k) != expected_checksums.get(k))
        mean, mx = mean_abs_diff(engine_logprobs, trainer_logprobs)
        metrics = {"parity/logp_diff_mean": mean, "parity/logp_diff_max": mx, "parity/bound": self.bound,
                   "parity/floor": self.floor, "parity/slot_families_wrong": float(len(bad))}
        self.history.append({"step": step, "version": version, **metrics})
        if bad or mean > self.bound:
            raise ParityError(self._message(version, step, bad, engine_checksums, expected_checksums, mean, mx))
        return metrics

    def _message(self, version, step, bad, got, want, mean, mx) -> str:
        lines = [f"parity probe failed after adapter version {version} (step {step}):"]
        for k in bad:
            lines.append(f"  {k}: the engine's LoRA slot holds checksum {got.get(k)!r}, the trainer sent {want.get(k)!r}")
        verdict = "exceeds" if mean > self.bound else "within"
        lines.append(f"  mean |log p_engine - log p_trainer| on the probe batch = {mean:.3e} (max {mx:.3e}), {verdict} "
                     f"the bound {self.bound:.3e} = engine.parity_probe.factor {self.factor} x floor {self.floor:.3e} "
                     f"+ engine.parity_probe.abs_tol {self.abs_tol}")
        if not bad:
            lines.append("  the slot holds the trainer's weights: the engine's computation with the adapter differs "
                         "(see the engine's kernel report)")
        return "\n".join(lines)
