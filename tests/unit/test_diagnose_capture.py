"""rlfp8-diagnose's engine capture finds the scored sequences in a step by their tokens: a step whose requests
the engine reordered (vLLM 0.26's GPU model runner sorts a batch by scheduled token count) gives every
sequence its own hidden rows; a step with other tokens, or a sequence missing or extra, is refused."""
from types import SimpleNamespace

import pytest
import torch

from rlfp8.diagnose import arms
from rlfp8.diagnose.arms import HiddenCapture, sequence_offsets
from rlfp8.diagnose.samples import Samples

SEQUENCES = [[5, 6, 7, 8], [5, 6, 7], [9, 1], [5, 6, 7], [2, 3, 4, 4, 4]]   # a prefix of another, a duplicate


def _flat(order: list[int]) -> list[int]:
    return [t for i in order for t in SEQUENCES[i]]


def _check_offsets(order: list[int]):
    offsets = sequence_offsets(_flat(order), SEQUENCES)
    assert sorted(offsets) == sorted(set(offsets))                      # every sequence its own place
    flat = _flat(order)
    for i, start in enumerate(offsets):
        assert flat[start:start + len(SEQUENCES[i])] == SEQUENCES[i]


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 1, 3, 0, 4], [1, 0, 3, 2, 4]])
def test_offsets_found_in_any_order(order):
    _check_offsets(order)


def test_in_order_step_gives_running_offsets():
    assert sequence_offsets(_flat([0, 1, 2, 3, 4]), SEQUENCES) == [0, 4, 7, 9, 12]


def test_length_sorted_step_like_vllm_gpu_runner():
    order = sorted(range(len(SEQUENCES)), key=lambda i: len(SEQUENCES[i]))   # stable, as sort_batch_req_ids
    _check_offsets(order)
    assert sequence_offsets(_flat(order), SEQUENCES)[2] == 0                # the shortest went first


def test_prefix_needs_backtracking():
    # [5,6,7] is tried before [5,6,7,8] at offset 0 would leave [8, ...] unplaceable: the split backtracks
    seqs = [[5, 6, 7, 8, 1], [5, 6, 7]]
    assert sequence_offsets([5, 6, 7, 8, 1, 5, 6, 7], seqs) == [0, 5]
    assert sequence_offsets([5, 6, 7, 5, 6, 7, 8, 1], seqs) == [3, 0]


def test_changed_token_is_refused():
    flat = _flat([4, 3, 2, 1, 0])
    flat[6] = 42
    with pytest.raises(RuntimeError, match="not the scored sequences in any order.*still unplaced"):
        sequence_offsets(flat, SEQUENCES)


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [0, 1, 2, 3, 4, 2]])
def test_missing_or_extra_sequence_is_refused(order):
    with pytest.raises(RuntimeError, match="missing or extra"):
        sequence_offsets(_flat(order), SEQUENCES)


def test_swapped_for_equal_length_other_sequence_is_refused():
    # same token count as the expected step, but sequence 2 ran twice and sequence 4's place holds other ids
    flat = _flat([0, 1, 2, 3]) + [9, 1, 9, 1, 4]
    with pytest.raises(RuntimeError, match="in any order"):
        sequence_offsets(flat, SEQUENCES)


# ------------------------------------------------------------------ the capture hooks and the row mapping
class _FakeEngineModel(torch.nn.Module):
    """The two modules the capture hooks (embed_tokens, norm), with a position term so a row depends on
    where its token sits in its own sequence."""

    def __init__(self, vocab=50, dim=6):
        super().__init__()
        with torch.random.fork_rng():          # seeded here without moving the suite's global RNG state
            torch.manual_seed(0)
            self.model = torch.nn.Module()
            self.model.embed_tokens = torch.nn.Embedding(vocab, dim)
            self.model.norm = torch.nn.LayerNorm(dim)
            self.position = torch.nn.Embedding(16, dim)

    def step(self, sequences: list[list[int]]) -> None:
        """One flattened step over the sequences in the given order, as an engine runs a prefill batch."""
        ids = torch.tensor([t for s in sequences for t in s])
        positions = torch.tensor([p for s in sequences for p in range(len(s))])
        with torch.no_grad():
            self.model.norm(self.model.embed_tokens(ids) + self.position(positions))

    def rows(self, sequence: list[int]) -> torch.Tensor:
        """The same arithmetic for one sequence without calling the hooked modules (the expected rows)."""
        body = self.model
        h = body.embed_tokens.weight[sequence] + self.position.weight[:len(sequence)]
        return torch.nn.functional.layer_norm(h, h.shape[-1:], body.norm.weight, body.norm.bias, body.norm.eps).detach()


def _fake_scoring(model: _FakeEngineModel, reorder):
    """arms._prompt_scoring's stand-in: runs the requests in `reorder(sequences)` order, answers in request
    order with each scored token's log-prob (a fixed function of its hidden row)."""
    def scoring(engine, sequences, full_vocab):
        model.step([sequences[i] for i in reorder(sequences)])
        outs = []
        for s in sequences:
            rows = model.rows(s)
            outs.append(SimpleNamespace(prompt_logprobs=[None] + [
                {s[t]: SimpleNamespace(logprob=float(rows[t - 1].sum()))} for t in range(1, len(s))]))
        return outs
    return scoring


@pytest.mark.parametrize("reorder", [lambda seqs: range(len(seqs)),
                                     lambda seqs: sorted(range(len(seqs)), key=lambda i: len(seqs[i])),
                                     lambda seqs: reversed(range(len(seqs)))], ids=["in_order", "by_length", "reversed"])
def test_captured_rows_belong_to_their_sequence(monkeypatch, reorder):
    model = _FakeEngineModel()
    samples = Samples([list(s) for s in SEQUENCES], [2, 1, 1, 2, 3], "test")
    monkeypatch.setattr(arms, "_prompt_scoring", _fake_scoring(model, reorder))
    capture = HiddenCapture(model)
    try:
        hidden, vllm_logp = arms._captured_hidden(None, capture, samples, one_at_a_time=False)
    finally:
        capture.close()
    expected = torch.cat([model.rows(s)[p - 1:len(s) - 1] for s, p in zip(samples.sequences, samples.prompt_lens)])
    assert hidden.shape == (samples.num_tokens, 6)
    assert torch.allclose(hidden, expected, atol=1e-6)
    assert torch.allclose(hidden.sum(-1), vllm_logp, atol=1e-5)      # the rows match vLLM's per-token answers


def test_capture_refuses_a_step_with_other_tokens(monkeypatch):
    model = _FakeEngineModel()
    samples = Samples([list(s) for s in SEQUENCES], [1] * len(SEQUENCES), "test")

    def corrupted(engine, sequences, full_vocab):
        model.step([[(t + 1) % 50 if i == 3 else t for t in s] for i, s in enumerate(sequences)])
        return []
    monkeypatch.setattr(arms, "_prompt_scoring", corrupted)
    capture = HiddenCapture(model)
    try:
        with pytest.raises(RuntimeError, match="from offset 9 .*indices \\[3, 4\\]"):
            arms._captured_hidden(None, capture, samples, one_at_a_time=False)
    finally:
        capture.close()
