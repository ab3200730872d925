"""bench/step_profile.py's accounting: a call's Ray overhead is its driver wall time minus its actor's phases,
and the rows add up to the step."""

import pytest

from tests.bench_scripts import load_bench_script



@pytest.fixture(scope="module")
def step_profile():
    return load_bench_script("step_profile")


def test_breakdown_charges_ray_overhead_and_adds_up(step_profile):
    engine = {"engine/generate": {"s": 2.0, "n": 1}, "engine/outputs": {"s": 0.25, "n": 1},
              "engine/score": {"s": 0.5, "n": 1}}
    trainer = {"trainer/forward": {"s": 1.0, "n": 4}, "trainer/backward": {"s": 1.5, "n": 4}}
    driver = {"driver/reward": {"s": 0.1, "n": 1}, "driver/log": {"s": 0.3, "n": 1}}
    calls = {"generate": {"s": 2.5, "n": 1}, "train_step": {"s": 2.75, "n": 1}, "score": {"s": 0.5, "n": 1},
             "memory": {"s": 0.2, "n": 1}}
    rows, beside = step_profile.breakdown(7.0, driver, calls, engine, trainer)
    assert beside == {}
    assert rows["ray:generate"] == pytest.approx(0.25)
    assert rows["ray:train_step"] == pytest.approx(0.25)
    assert rows["ray:score"] == pytest.approx(0.0)
    assert rows["driver:driver/log"] == pytest.approx(0.1)          # the memory() call inside it is its own row
    assert rows["call:memory"] == pytest.approx(0.2)
    assert sum(rows.values()) == pytest.approx(7.0)
    assert rows["unaccounted"] == pytest.approx(7.0 - 2.0 - 0.25 - 0.5 - 1.0 - 1.5 - 0.1 - 0.1 - 0.25 - 0.25 - 0.2)


def test_overlapped_rows_stay_outside_the_step_sum(step_profile):
    """With engine.parity_probe.overlap the trainer's probe scoring runs beside the next rollout: reported, but
    not subtracted from the step (else 'unaccounted' would go negative by its time)."""
    engine = {"engine/generate": {"s": 2.0, "n": 1}}
    trainer = {"trainer/forward": {"s": 1.0, "n": 1}, "trainer/score_tokens": {"s": 0.75, "n": 1}}
    calls = {"generate": {"s": 2.0, "n": 1}, "train_step": {"s": 1.0, "n": 1}}
    driver = {"driver/probe_wait": {"s": 0.05, "n": 1}}
    rows, beside = step_profile.breakdown(3.5, driver, calls, engine, trainer, step_profile.OVERLAPPED)
    assert beside == {"trainer:trainer/score_tokens": 0.75}
    assert "trainer:trainer/score_tokens" not in rows
    assert rows["unaccounted"] == pytest.approx(3.5 - 2.0 - 1.0 - 0.05)
    rows, beside = step_profile.breakdown(3.5, driver, calls, engine, trainer)        # overlap off: in the step
    assert beside == {} and rows["trainer:trainer/score_tokens"] == 0.75


def test_phase_timer_adds_up_repeated_phases_and_resets():
    from rlfp8 import profiling
    profiling.take_phase_times()
    for _ in range(3):
        with profiling.phase("x"):
            pass

    @profiling.phase("y")
    def f(a):
        return a + 1
    assert f(1) == 2
    got = profiling.take_phase_times()
    assert got["x"]["n"] == 3 and got["y"]["n"] == 1 and got["x"]["s"] >= 0
    assert profiling.take_phase_times() == {}
