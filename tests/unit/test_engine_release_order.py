"""The engine's memory around training under two_copies and offloaded (rlfp8/placement/base.py's engine_out /
engine_back): engine.release_kv frees the KV cache while the trainer runs; engine.release_weights (verl's colocated
recipe, vLLM-owned weights) also moves the weights to the host, in an order that keeps one 16-bit copy on the host
at a time and the KV cache mapped again before the sync's parity probe. Also the config rules around it."""
from __future__ import annotations

import pytest

from rlfp8 import config
from rlfp8.placement import base as base_mod
from rlfp8.placement import offloaded as offloaded_mod
from rlfp8.placement.offloaded import Offloaded
from rlfp8.placement.two_copies import TwoCopies


class Actor:
    """Logs 'role.method(args)' for every call; answers the release flags."""
    def __init__(self, log, role, **answers):
        self._log, self._role, self._answers = log, role, answers

    def __getattr__(self, name):
        def method(*args):
            self._log.append(f"{self._role}.{name}" + (f"{args}" if args else ""))
            return self._answers.get(name)
        return method


@pytest.fixture(autouse=True)
def direct_calls(monkeypatch):
    for mod in (base_mod, offloaded_mod):
        monkeypatch.setattr(mod, "call", lambda m, *a: m(*a))


def _placement(cls, log, kv, weights):
    p = cls.__new__(cls)
    p.cfg = {}
    p.engine = Actor(log, "engine", kv_release_enabled=kv, weights_release_enabled=weights)
    p.trainer = Actor(log, "trainer")
    p.after_setup()
    return p


def _one_step(p, log):
    log.clear()
    p.before_rollout()
    log.append("-- generate")
    p.before_train()
    log.append("-- train_step")
    p.after_train()
    log.append("-- sync + probe")
    p.after_sync()
    return list(log)


def test_offloaded_with_the_engine_asleep_keeps_one_copy_on_the_host_and_kv_back_before_the_sync():
    log = []
    p = _placement(Offloaded, log, kv=True, weights=True)
    assert log == ["engine.kv_release_enabled", "engine.weights_release_enabled", "trainer.release_base"]
    for _ in range(2):
        assert _one_step(p, log) == [
            "-- generate",
            "engine.release_kv",                  # KV out: room for the trainer's base next to the engine's weights
            "trainer.restore_base(True,)",        # base onto the device, its pinned host pages returned
            "engine.release_weights",             # ...then the engine's weights take the host
            "-- train_step",
            "trainer.release_cached_memory",      # the activations' blocks first (the H200's 32B run ran out here)
            "engine.resume_weights",              # weights back (their host pages returned): the slot is among them
            "trainer.release_base",               # the trainer's base to the host, off the device before the KV
            "engine.resume_kv",                   # mapped before the sync's probe scores on the engine
            "-- sync + probe",
            "trainer.release_base"]               # already out: the weight source makes it a no-op
        assert not (p.kv_released or p.weights_released)


def test_offloaded_without_releases_is_unchanged_and_kv_only_keeps_the_base_for_the_probe():
    log = []
    p = _placement(Offloaded, log, kv=False, weights=False)
    assert _one_step(p, log) == ["-- generate", "trainer.restore_base(False,)", "-- train_step", "-- sync + probe",
                                 "trainer.release_base"]
    p = _placement(Offloaded, log, kv=True, weights=False)
    assert _one_step(p, log) == ["-- generate", "engine.release_kv", "trainer.restore_base(False,)", "-- train_step",
                                 "trainer.release_cached_memory", "engine.resume_kv", "-- sync + probe",
                                 "trainer.release_base"]        # the base leaves after the probe scored on it


def test_two_copies_releases_what_the_engine_was_started_for():
    log = []
    p = _placement(TwoCopies, log, kv=False, weights=False)
    assert _one_step(p, log) == ["-- generate", "-- train_step", "-- sync + probe"]
    p = _placement(TwoCopies, log, kv=True, weights=True)
    assert _one_step(p, log) == ["-- generate", "engine.release_kv", "engine.release_weights", "-- train_step",
                                 "trainer.release_cached_memory", "engine.resume_weights", "engine.resume_kv",
                                 "-- sync + probe"]


def test_a_released_engine_is_brought_back_before_a_rollout_that_follows_a_skipped_update():
    """A step whose update was skipped (no after_train) must not generate on a released engine."""
    log = []
    p = _placement(Offloaded, log, kv=True, weights=True)
    p.before_train()
    log.clear()
    p.before_rollout()
    assert log == ["trainer.release_cached_memory", "engine.resume_weights", "trainer.release_base",
                   "engine.resume_kv"]


def test_engine_refuses_work_while_its_weights_are_on_the_host():
    from rlfp8.rollout.engine import RolloutEngine
    eng = RolloutEngine.__new__(RolloutEngine)
    eng.kv_released, eng.weights_released = False, True
    for call_it, what in ((lambda: eng.generate([[1, 2]], 1, 1.0, 4), "generate"),
                          (lambda: eng.score([[1, 2, 3]], [1]), "score"),
                          (lambda: eng.set_adapter({"version": 1}), "set_adapter")):
        with pytest.raises(RuntimeError, match=f"engine.{what} while the weights are released to the host"):
            call_it()
    eng.weights_release, eng.kv_released, eng.weights_released = True, False, False
    with pytest.raises(RuntimeError, match="release the KV cache first"):
        eng.release_weights()


@pytest.mark.parametrize("overrides, message", [
    (["engine.release_weights=true", "engine.precision=w8a16", "placement=two_copies"],
     "engine.release_weights=True engine.precision=w8a16: (rlfp8's engines keep their FP8 weights outside"),
    (["engine.release_weights=true", "engine.precision=bf16", "engine.release_kv=false", "placement=two_copies"],
     "engine.release_weights=True engine.release_kv=False"),
    (["engine.release_weights=true", "engine.precision=bf16", "placement=offloaded", "trainer.weights=bf16"],
     "engine.release_weights=true with placement=offloaded needs engine.parity_probe.every=0"),
])
def test_release_weights_config_rules(monkeypatch, overrides, message):
    monkeypatch.setattr(config, "cuda_available", lambda: True)
    with pytest.raises(config.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config.compose_dict(overrides)


def test_release_weights_composes_on_a_gpu_and_is_refused_without_one(monkeypatch):
    ok = ["engine.release_weights=true", "engine.precision=bf16", "placement=offloaded", "trainer.weights=bf16",
          "engine.parity_probe.every=0"]
    monkeypatch.setattr(config, "cuda_available", lambda: True)
    cfg = config.compose_dict(ok)
    assert cfg["engine"]["release_weights"] is True and cfg["engine"]["release_kv"] == "auto"
    from rlfp8.memory_plan import kv_released_while_training
    assert kv_released_while_training(cfg)                 # auto: on with the weights (the same sleep mode)
    monkeypatch.setattr(config, "cuda_available", lambda: False)
    with pytest.raises(config.ConfigError, match="needs a CUDA GPU"):
        config.compose_dict(ok)
