"""The parity probe beside the next rollout (engine.parity_probe.overlap): the sync starts both sides' scoring
and returns without waiting; settle() (before the next update, a checkpoint, the end) waits and checks. The
order each actor sees is what makes it safe: the trainer scores before offloaded moves its base out, and
one_copy's base checksums are started at the sync and compared at settle."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray

from rlfp8 import train
from rlfp8.parity import ParityError, ParityProbe
from rlfp8.placement.offloaded import Offloaded
from rlfp8.placement.one_copy import BaseWrittenError, OneCopy
from rlfp8.placement.pairs import Pairs


class FakeRef:
    def __init__(self, log, name, value):
        self.log, self.name, self.value = log, name, value


class FakeMethod:
    def __init__(self, log, name, results):
        self.log, self.name, self.results = log, name, results

    def remote(self, *a, **k):
        self.log.append(f"start {self.name}")
        return FakeRef(self.log, self.name, self.results.get(self.name.split(".")[1]))

    def __call__(self, *a, **k):         # the placements' call(method) in this process
        self.log.append(f"call {self.name}")
        return self.results.get(self.name.split(".")[1])


class FakeActor:
    def __init__(self, log, role, **results):
        self._log, self._role, self._results = log, role, results

    def __getattr__(self, name):
        return FakeMethod(self._log, f"{self._role}.{name}", self._results)


@pytest.fixture
def fake_ray(monkeypatch):
    """ray.get resolves FakeRefs (logging the wait); call(method) runs the fake in this process."""
    def get(x):
        if isinstance(x, list):
            return [get(v) for v in x]
        x.log.append(f"wait {x.name}")
        return x.value
    monkeypatch.setattr(ray, "get", get)
    import rlfp8.placement.base as base_mod
    import rlfp8.placement.offloaded as offloaded_mod
    import rlfp8.placement.one_copy as one_copy_mod
    for mod in (base_mod, offloaded_mod, one_copy_mod):
        monkeypatch.setattr(mod, "call", lambda m, *a, **k: m(*a, **k))
    import rlfp8.rollout.adapter_slots as slots_mod
    monkeypatch.setattr(slots_mod, "expected_checksums", lambda update, dtype: {"q_proj": 1.0})


def _run(log, placement_cls, overlap, trainer_lp=-0.5, base_checksums=None):
    engine = FakeActor(log, "engine", score=[[-0.5, -0.5]], slot_checksums={"q_proj": 1.0},
                       set_adapter=None, base_checksums={"q": 1})
    trainer = FakeActor(log, "trainer", score_tokens=[[trainer_lp, -0.5]], export_adapter={"version": 1},
                        base_checksums=base_checksums or {"q": 1})
    p = placement_cls.__new__(placement_cls)
    p.cfg = {"placement": {"checksum_every": 1}}
    p.engine, p.trainer = engine, trainer
    if placement_cls is OneCopy:
        p.kv_released, p.syncs, p.pending_base, p.checksum = False, 0, None, {"q": 1}
    pairs = Pairs.__new__(Pairs)
    pairs.cfg, pairs.num_pairs, pairs.pairs = {}, 1, [p]
    probe = ParityProbe([[1, 2, 3, 4]], [2], factor=4.0, abs_tol=1e-3, floor=1e-3)
    cfg = {"engine": {"parity_probe": {"every": 1, "overlap": overlap}}}
    return SimpleNamespace(cfg=cfg, placement=pairs, probe=probe, probe_lora_dtype=None, pending_probe=None)


def test_with_overlap_the_sync_starts_the_probe_and_settle_checks_it(fake_ray):
    log = []
    r = _run(log, OneCopy, overlap=True)
    assert train.sync(r, 1) == {}
    assert [e for e in log if e.startswith("wait")] == ["wait engine.set_adapter", "wait trainer.export_adapter"]
    assert log.index("start engine.score") < log.index("start engine.base_checksums")
    assert log.index("start trainer.score_tokens") < log.index("start trainer.base_checksums")
    log.clear()
    metrics = train.settle(r)
    assert metrics["parity/version"] == 1.0 and metrics["parity/slot_families_wrong"] == 0.0
    assert metrics["parity/logp_diff_mean"] == 0.0
    assert "wait engine.base_checksums" in log and "wait trainer.score_tokens" in log
    assert r.pending_probe is None and train.settle(r) == {}          # settled once


def test_without_overlap_the_sync_settles_at_once(fake_ray):
    log = []
    r = _run(log, OneCopy, overlap=False)
    metrics = train.sync(r, 1)
    assert metrics["parity/version"] == 1.0 and "wait trainer.score_tokens" in log


def test_a_failed_probe_raises_at_settle_not_at_the_sync(fake_ray):
    log = []
    r = _run(log, OneCopy, overlap=True, trainer_lp=-3.0)
    train.sync(r, 4)
    with pytest.raises(ParityError, match="adapter version 1 \\(step 4\\)"):
        train.settle(r)


def test_a_written_base_raises_at_settle(fake_ray):
    log = []
    r = _run(log, OneCopy, overlap=True, base_checksums={"q": 2})
    train.sync(r, 1)
    with pytest.raises(BaseWrittenError, match="after 1 syncs \\(trainer\\)"):
        train.settle(r)


def test_offloaded_trainer_scores_before_its_base_goes_out(fake_ray):
    """The trainer actor runs its calls in order: score_tokens must be queued before release_base."""
    log = []
    r = _run(log, Offloaded, overlap=True)
    train.sync(r, 1)
    assert log.index("start trainer.score_tokens") < log.index("call trainer.release_base")


def test_the_trainer_refuses_to_compute_on_an_offloaded_base():
    from rlfp8.trainer.core import PolicyTrainer
    t = PolicyTrainer.__new__(PolicyTrainer)
    t.weights = SimpleNamespace(offloaded=True)
    with pytest.raises(RuntimeError, match="trainer.score while the base is offloaded"):
        t.score(None)
    with pytest.raises(RuntimeError, match="trainer.train_step while the base is offloaded"):
        t.train_step(None)
