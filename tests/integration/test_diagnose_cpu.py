"""rlfp8-diagnose on the CPU: the chunked full-vocabulary KL against a direct torch computation (and its
[chunk, V] bound), the engine's captured distribution against vLLM's own full-vocabulary log-probs, and the
CLI end to end on the tiny model (table, JSON, PNG; the FP8 trainer's weight rounding shows over the floor)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlfp8.diagnose.metrics import chunked_full_kl, pair_stats, token_stats

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ the chunked KL (no vLLM)
def _rows_fn(logits: torch.Tensor, chunk: int, asked: list):
    """Row function over a [n, V] table that refuses any range longer than `chunk` rows."""
    def rows(start, stop):
        assert stop - start <= chunk, f"asked for {stop - start} rows at once (chunk {chunk})"
        asked.append((start, stop))
        return logits[start:stop].float().log_softmax(-1)
    return rows


@pytest.mark.parametrize("n,chunk", [(37, 8), (16, 16), (5, 64)])
def test_chunked_full_kl_equals_direct_kl_and_stays_in_chunks(n, chunk):
    torch.manual_seed(n)
    vocab = 301
    a = torch.randn(n, vocab, dtype=torch.float64) * 3
    b = a + 0.2 * torch.randn(n, vocab, dtype=torch.float64)
    a[0, :7] = float("-inf")                  # the engine gives some tokens probability 0: 0 log 0 = 0
    asked_e, asked_t = [], []
    kl = chunked_full_kl(n, _rows_fn(a, chunk, asked_e), _rows_fn(b, chunk, asked_t), chunk)
    p, lq = a.softmax(-1), b.log_softmax(-1)
    direct = (torch.special.xlogy(p, p) - p * lq).sum(-1)                     # sum p log p - sum p log q, fp64
    assert torch.allclose(kl.per_token, direct, rtol=1e-5, atol=1e-9)       # fp32 rows vs fp64 math
    assert (kl.per_token > 0).all() and torch.isfinite(kl.per_token).all()
    assert kl.chunk_rows == [min(chunk, n - s) for s in range(0, n, chunk)] and max(kl.chunk_rows) <= chunk
    assert asked_e == asked_t == [(s, min(n, s + chunk)) for s in range(0, n, chunk)]


def test_identical_distributions_give_zero_kl_and_stats():
    logits = torch.randn(9, 50)
    rows = lambda s, e: logits[s:e].log_softmax(-1)          # noqa: E731
    lp = torch.full((9,), -1.0)
    stats = pair_stats(9, rows, rows, lp, lp.clone(), 4)
    assert stats["full_kl_mean"] == 0.0 and stats["kl_k3"] == 0.0 and stats["abs_logp_diff_max"] == 0.0
    assert stats["chunk_rows_max"] == 4


def test_token_stats_against_hand_values():
    e = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    t = torch.tensor([-1.5, -2.0, -0.25, -1.0])
    s = token_stats(e, t)
    log_r = (t - e).double()
    assert math.isclose(s["kl_k3"], float((log_r.exp() - 1 - log_r).mean()), rel_tol=1e-12)
    assert s["abs_logp_diff_max"] == 2.0 and s["abs_logp_diff_p50"] == pytest.approx(0.375)
    with pytest.raises(ValueError, match="expected two"):
        token_stats(e, t[:3])


def test_mismatched_row_shapes_are_an_error():
    rows_a = lambda s, e: torch.zeros(e - s, 10)             # noqa: E731
    rows_b = lambda s, e: torch.zeros(e - s, 11)             # noqa: E731
    with pytest.raises(ValueError, match=r"rows 0:4"):
        chunked_full_kl(4, rows_a, rows_b, 8)


# ------------------------------------------------------------------ vLLM: capture vs vLLM's full-vocab log-probs
@pytest.mark.slow
def test_captured_engine_distribution_equals_vllm_full_vocabulary(tmp_path):
    """The hooked hidden states through the engine's compute_logits reproduce vLLM's prompt_logprobs=-1 rows."""
    pytest.importorskip("vllm")
    from rlfp8.config import compose_dict
    from rlfp8.diagnose.arms import score_engine_capture, score_engine_full_vocab
    from rlfp8.diagnose.cli import engine_overrides, started_engine
    from rlfp8.diagnose.samples import Samples
    from rlfp8.trainer.hf_models import make_tiny_qwen3
    folder = make_tiny_qwen3(tmp_path / "tiny", seed=3)
    cfg = compose_dict(["recipe=diagnose", "model=tiny", "diagnose.engine_distribution=vllm_full",
                        "engine.max_model_len=128"])
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 400, (k,), generator=g).tolist() for k in (9, 14, 6)]
    samples = Samples(seqs, [4, 5, 2], "random tokens")
    with started_engine(str(folder), cfg, engine_overrides(cfg, sum(map(len, seqs)))) as engine:
        full = score_engine_full_vocab(engine, samples, "full", one_at_a_time=False)
        for single in (False, True):
            cap = score_engine_capture(engine, samples, "capture", one_at_a_time=single, chunk_tokens=4)
            n = samples.num_tokens
            assert torch.allclose(cap.rows(0, n), full.rows(0, n), atol=1e-5, rtol=0)
            assert cap.info["capture_vs_vllm_logp_max_abs"] < 1e-5
            assert torch.equal(cap.token_logp, full.token_logp) or torch.allclose(cap.token_logp, full.token_logp,
                                                                                    atol=1e-5)


# ------------------------------------------------------------------ the CLI end to end
def _diagnose(*args, tmp):
    env = {**os.environ, "RLFP8_CACHE": str(tmp / "cache"), "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "rlfp8.diagnose", "model=tiny", "model.dtype=float32", "algo.max_response_len=16",
           *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("diagnose")
    out = tmp / "out"
    r = _diagnose(f"diagnose.out_dir={out}", "diagnose.engines=[bf16,w8a16,w8a8_vllm]", "diagnose.trainers=[bf16,fp8]",
                  "diagnose.num_prompts=4", "diagnose.chunk_tokens=32", tmp=tmp)
    return tmp, out, r


@pytest.mark.slow
def test_diagnose_cli_tiny(first_run):
    _, out, r = first_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "full KL" in r.stdout and "floor (engine bf16 / trainer bf16" in r.stdout
    report = json.loads((out / "report.json").read_text())
    assert (out / "report.png").stat().st_size > 1000 and (out / "samples.json").exists()
    assert "rlfp8.diagnose" in report["command"] or "diagnose" in report["command"], report["command"]
    assert report["versions"]["vllm"][0].isdigit() and report["versions"]["gpu"] == "cpu", report["versions"]
    assert "w8a8_vllm" in report["skipped"]["engines"] and "CUDA" in report["skipped"]["engines"]["w8a8_vllm"]
    pairs = {(p["engine"], p["trainer"]): p for p in report["pairs"]}
    assert set(pairs) == {(e, t) for e in ("engine_bf16", "engine_w8a16") for t in ("trainer_bf16", "trainer_fp8")}
    for p in pairs.values():
        assert math.isfinite(p["full_kl_mean"]) and p["full_kl_min"] >= -1e-12 and p["kl_k3"] >= 0
        assert p["chunk_rows_max"] <= 32 and p["engine_info"]["capture_vs_vllm_logp_max_abs"] < 1e-4
    floor = pairs[("engine_bf16", "trainer_bf16")]["full_kl_mean"]
    assert pairs[("engine_bf16", "trainer_fp8")]["full_kl_mean"] > 100 * max(floor, 1e-12)    # weight rounding
    assert pairs[("engine_w8a16", "trainer_fp8")]["full_kl_mean"] < 1e-6                     # matched: same codes
    assert report["floor"]["bf16_bf16"] == floor and "hf_batch_vs_single" in report["floor"]
    assert report["floor_pairs"]["vllm_vllm"]["full_kl_mean"] >= 0
    acc = report["acceptance"]                  # no w8a8 engine scored: that ratio is reported as not measurable
    assert acc["matched_over_floor"]["numerator_kl"] == pairs[("engine_w8a16", "trainer_fp8")]["full_kl_mean"]
    assert acc["matched_over_w8a8"]["ratio"] is None and "matched_over_w8a8: " in r.stdout
    assert "not measurable (not scored)" in r.stdout


@pytest.mark.slow
def test_diagnose_cli_rescores_saved_samples_with_a_knob(first_run):
    """The same tokens again from the samples file, one knob changed (fp32 model: the fp32 head changes ~nothing)."""
    tmp, out, r = first_run
    assert r.returncode == 0
    first = {(p["engine"], p["trainer"]): p for p in json.loads((out / "report.json").read_text())["pairs"]}
    r2 = _diagnose(f"diagnose.out_dir={tmp / 'again'}", f"diagnose.samples={out}", "diagnose.engines=[bf16]",
                   "diagnose.trainers=[fp8]", "diagnose.trainer_head_fp32=true", tmp=tmp)
    assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-3000:]
    again = json.loads((tmp / "again" / "report.json").read_text())
    assert again["samples"]["source"].startswith("file ") and again["knobs"]["trainer_head_fp32"] is True
    assert again["pairs"][0]["full_kl_mean"] == pytest.approx(first[("engine_bf16", "trainer_fp8")]["full_kl_mean"],
                                                              rel=1e-3)


# ------------------------------------------------------------------ the random real-shape model (small stand-in here)
def test_random_model_folder_loads_with_its_tokenizer(tmp_path, monkeypatch):
    """The folder rlfp8-diagnose writes for diagnose.random_model: HF loads it, the word-level tokenizer covers
    the vocabulary, the layer count is diagnose.random_layers (a small Qwen3 spec stands in for qwen3_8b)."""
    import rlfp8.models
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfp8.diagnose.random_model import random_model_folder, random_prompts
    spec = {**rlfp8.models.architecture_config("qwen3_8b"), "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300,
            "bos_token_id": 1, "eos_token_id": 2}
    monkeypatch.setattr(rlfp8.models, "architecture_config", lambda name: dict(spec))
    folder = random_model_folder("qwen3_8b", 3, tmp_path, seed=0, device="cpu")
    assert random_model_folder("qwen3_8b", 3, tmp_path, seed=0, device="cpu") == folder      # made once
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.num_hidden_layers == 3 and model.config.vocab_size == 300
    tok = AutoTokenizer.from_pretrained(folder)
    ids = random_prompts(300, 2, 5, seed=1)
    assert ids == random_prompts(300, 2, 5, seed=1) and all(0 < t < 300 for row in ids for t in row)
    assert tok(tok.decode(ids[0]), add_special_tokens=False).input_ids == ids[0] and tok.eos_token_id == 2
