"""Rewards: 1.0 when a response's final answer matches the reference, else 0.0.

kind "arithmetic": the LAST number in the response (thousands commas and a leading minus allowed;
"12.0" counts as 12) equals the integer answer.
kind "math": math-verify. The gold answer is parsed as "\\boxed{answer}" (as is when it already
holds \\boxed or $...$); the response with math-verify's default extraction (boxed answers
first, then the last LaTeX / plain expression); then `verify(gold, pred)`. Any exception or
timeout scores 0.0.

Threads: math-verify's timeouts use signal.alarm, which only works in the main thread of the
main interpreter. In the main thread we keep its timeouts (MATH_TIMEOUT_S per parse / compare);
in any other thread (a thread pool, a threaded Ray actor) we pass parsing_timeout=None and
timeout_seconds=None, which turns the signal machinery off. There a pathological input is not
interrupted; responses are cut to their last MAX_RESPONSE_CHARS characters to bound the work.
"""
from __future__ import annotations

import functools
import logging
import re
import threading
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation

log = logging.getLogger("rlfp8.data")

REWARD_KINDS = ("arithmetic", "math")
MATH_TIMEOUT_S = 5
MAX_RESPONSE_CHARS = 8000

# A number: optional sign (only when the '-' does not follow a word character or ')', so that
# "5-3" is 5 and 3), thousands groups "1,234,567" or plain digits, optional decimals.
_NUM_RE = re.compile(r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_SCI_RE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)[eE]([+-]?\d+)(?![\w.])")


def last_number(text: str) -> Decimal | None:
    """The last number in text, as a Decimal (None when there is none)."""
    text = text.replace("\u2212", "-")  # unicode minus
    nums = _NUM_RE.findall(text)
    if not nums:
        return None
    try:
        return Decimal(nums[-1].replace(",", ""))
    except InvalidOperation:
        return None


def score_arithmetic(response: str, answer: str) -> float:
    pred = last_number(response)
    try:
        gold = Decimal(str(answer).strip().replace(",", "").replace("\u2212", "-"))
    except InvalidOperation:
        return 0.0
    return 1.0 if pred is not None and pred == gold else 0.0


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _timeouts() -> int | None:
    """math-verify's timeout to use here: signal-based in the main thread, off elsewhere."""
    return MATH_TIMEOUT_S if _in_main_thread() else None


def _sci_to_latex(s: str) -> str:
    """'4.5e33' -> '4.5\\times 10^{33}' (math-verify reads 4.5e33 as 4.5*e*33)."""
    return _SCI_RE.sub(lambda m: f"{m.group(1)}\\times 10^{{{m.group(2)}}}", s)


@functools.lru_cache(maxsize=65536)
def _parse_gold(answer: str, timeout: int | None):
    from math_verify import parse

    a = _sci_to_latex(answer.strip())
    delimited = "\\boxed" in a or re.search(r"(?<!\\)\$", a) is not None  # an escaped \\$ is a dollar sign
    candidates = [a] if delimited else [f"\\boxed{{{a}}}", f"${a}$", a]
    for cand in candidates:
        gold = parse(cand, parsing_timeout=timeout)
        if gold:
            return gold
    return []


def score_math(response: str, answer: str) -> float:
    try:
        from math_verify import parse, verify

        timeout = _timeouts()
        gold = _parse_gold(str(answer), timeout)
        if not gold:
            log.debug("math-verify could not parse the gold answer %r", answer)
            return 0.0
        pred = parse(_sci_to_latex(response[-MAX_RESPONSE_CHARS:]), parsing_timeout=timeout)
        if not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0
    except Exception:  # noqa: BLE001 - a reward never crashes the run
        log.debug("math-verify failed on %r vs %r", response[-200:], answer, exc_info=True)
        return 0.0


def score(response: str, answer: str, kind: str) -> float:
    """1.0 if the response's final answer equals `answer`, else 0.0 (see the module docstring)."""
    if kind == "arithmetic":
        return score_arithmetic(response, answer)
    if kind == "math":
        return score_math(response, answer)
    raise ValueError(f"unknown reward kind {kind!r}; allowed: {', '.join(REWARD_KINDS)}")


def batch_score(responses: Sequence[str], answers: Sequence[str], kind: str) -> list[float]:
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    if kind not in REWARD_KINDS:
        raise ValueError(f"unknown reward kind {kind!r}; allowed: {', '.join(REWARD_KINDS)}")
    return [score(r, a, kind) for r, a in zip(responses, answers)]
