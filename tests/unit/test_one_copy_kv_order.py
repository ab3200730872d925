"""one_copy with KV release: the engine's KV cache is mapped back as soon as the update is done, so the sync's
parity probe (engine.score) never runs on a released cache (the H200 Qwen3-8B run failed there inside vLLM's
block-table write), and the trainer returns its cached blocks first."""
from __future__ import annotations

import pytest

from rlfp8.placement import one_copy as one_copy_mod
from rlfp8.placement import pairs as pairs_mod
from rlfp8.placement.one_copy import OneCopy
from rlfp8.placement.pairs import Pairs


class FakeMethod:
    def __init__(self, log, name, result=None):
        self.log, self.name, self.result = log, name, result

    def __call__(self, *a, **k):
        self.log.append(self.name)
        return self.result


class FakeActor:
    def __init__(self, log, role, **results):
        self._log, self._role, self._results = log, role, results

    def __getattr__(self, name):
        return FakeMethod(self._log, f"{self._role}.{name}", self._results.get(name))


@pytest.fixture
def direct_calls(monkeypatch):
    """call(method, *args) runs the fake method in this process (no Ray)."""
    monkeypatch.setattr(one_copy_mod, "call", lambda m, *a, **k: m(*a, **k))
    monkeypatch.setattr(pairs_mod, "call", lambda m, *a, **k: m(*a, **k))


def _one_copy(log, release_kv=True):
    p = OneCopy.__new__(OneCopy)
    p.cfg = {"placement": {"checksum_every": 0}}
    p.engine = FakeActor(log, "engine", base_checksums={"q": 1}, kv_release_enabled=release_kv)
    p.trainer = FakeActor(log, "trainer", base_checksums={"q": 1}, train_step={"loss": 0.0})
    p.after_setup()
    log.clear()
    return p


def _pairs(placement):
    ps = Pairs.__new__(Pairs)
    ps.cfg, ps.num_pairs, ps.pairs = {}, 1, [placement]
    return ps


def test_kv_is_mapped_back_after_the_update_before_the_sync(direct_calls):
    log = []
    p = _one_copy(log)
    ps = _pairs(p)
    ps.before_rollout()
    ps.before_train()
    ps.train_step(batch=None)
    assert log == ["engine.release_kv", "trainer.train_step", "trainer.release_cached_memory", "engine.resume_kv"]
    assert not p.kv_released
    log.clear()
    ps.before_rollout()                 # already mapped: nothing to do before the next rollout
    assert log == []


def test_without_kv_release_the_hooks_call_nothing(direct_calls):
    log = []
    ps = _pairs(_one_copy(log, release_kv=False))
    ps.before_train()
    ps.train_step(batch=None)
    ps.before_rollout()
    assert log == ["trainer.train_step"]


def test_the_hooks_are_timed_as_weight_moves(direct_calls, monkeypatch):
    """Pairs times each phase hook (time/moves/<hook>, their sum time/moves) and take_move_times resets them:
    bench/placements.py reads them as the step's weight moves (KV out / back here, offloaded's base in / out)."""
    clock = iter(range(0, 100, 1))
    monkeypatch.setattr(pairs_mod.time, "perf_counter", lambda: float(next(clock)))
    ps = _pairs(_one_copy([]))
    ps.before_rollout()                 # 0 -> 1
    ps.before_train()                   # 2 -> 3
    ps.train_step(batch=None)           # after_train: 4 -> 5
    ps.after_sync()                     # 6 -> 7
    ps.before_train()                   # 8 -> 9: accumulates
    assert ps.take_move_times() == {"time/moves/before_rollout": 1.0, "time/moves/before_train": 2.0,
                                    "time/moves/after_train": 1.0, "time/moves/after_sync": 1.0, "time/moves": 5.0}
    assert ps.take_move_times() == {"time/moves": 0.0}


def test_engine_refuses_to_score_on_a_released_cache():
    from rlfp8.rollout.engine import RolloutEngine
    eng = RolloutEngine.__new__(RolloutEngine)
    eng.kv_released = True
    with pytest.raises(RuntimeError, match="engine.score while the KV cache is released"):
        eng.score([[1, 2, 3]], [1])
    with pytest.raises(RuntimeError, match="engine.generate while the KV cache is released"):
        eng.generate([[1, 2]], 1, 1.0, 4)


def test_packed_tensors_round_trip_as_one_buffer(tmp_path):
    """An adapter update pickles as one buffer per dtype and comes back equal, key order kept; a saved
    folder of views is written (safetensors refuses shared storage otherwise); GPU tensors are refused."""
    import pickle

    import torch

    from rlfp8.peft_format import PackedTensors, read_adapter_folder, write_adapter_folder
    t = {f"m{i}.lora_{ab}.weight": torch.randn(3 + i, 4) for i in range(5) for ab in "AB"}
    t["m0.lora_magnitude_vector"] = torch.randn(7, dtype=torch.float64)
    t["m1.extra"] = torch.randn(5, dtype=torch.float64).to(torch.bfloat16)
    flat = torch.cat([v.reshape(-1) for k, v in t.items() if v.dtype == torch.float32])
    packed = PackedTensors.from_flat([k for k in t if t[k].dtype == torch.float32],
                                     [tuple(v.shape) for v in t.values() if v.dtype == torch.float32], flat)
    packed["m0.lora_magnitude_vector"] = t["m0.lora_magnitude_vector"]
    packed["m1.extra"] = t["m1.extra"]
    back = pickle.loads(pickle.dumps(packed))
    assert list(back) == list(packed)
    assert all(torch.equal(back[k], packed[k]) and back[k].dtype == packed[k].dtype for k in packed)
    storages = {back[k].untyped_storage().data_ptr() for k in back if back[k].dtype == torch.float32}
    assert len(storages) == 1
    assert back["m1.extra"].dtype == torch.bfloat16
    write_adapter_folder(tmp_path / "a", back, {"r": 4})
    _, loaded = read_adapter_folder(tmp_path / "a")
    assert all(torch.equal(loaded[k], back[k]) for k in back)
    bad = PackedTensors({"x": torch.zeros(2, device="meta")})
    with pytest.raises(ValueError, match="x is on meta"):
        pickle.dumps(bad)


def test_the_probe_floor_is_scored_by_the_trainer_after_before_train(direct_calls, monkeypatch):
    """make_probe: the engine generates and scores, then the placement's before_train (offloaded: the trainer's
    base comes back from the host; the H200 study's bf16/offloaded runs failed scoring on a host-resident
    embedding), then the trainer scores."""
    from types import SimpleNamespace

    from rlfp8 import train
    log = []

    class Placement:
        engine = FakeActor(log, "engine", generate=[SimpleNamespace(prompt_index=0, token_ids=[5, 6])],
                           score=[[-0.5, -0.25]], lora_dtype="torch.float32")
        trainer = FakeActor(log, "trainer", score_tokens=[[-0.5, -0.5]])

        def before_rollout(self):
            log.append("placement.before_rollout")

        def before_train(self):
            log.append("placement.before_train")
    import rlfp8.placement as placement_pkg
    monkeypatch.setattr(placement_pkg, "call", lambda m, *a, **k: m(*a, **k))
    monkeypatch.setattr(train, "render", lambda r, ex: [1, 2, 3])
    r = SimpleNamespace(cfg={"engine": {"parity_probe": {"every": 1, "size": 1, "factor": 4.0, "abs_tol": 1e-3}},
                             "algo": {"max_response_len": 2}}, eval_set=["x"], placement=Placement())
    probe = train.make_probe(r)
    assert log == ["placement.before_rollout", "engine.generate", "engine.score", "placement.before_train",
                   "trainer.score_tokens", "engine.lora_dtype"]
    assert probe.floor == pytest.approx(0.125)
