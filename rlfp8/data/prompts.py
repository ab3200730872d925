"""Prompt rendering: an Example's user text -> the token ids the engine is given.

With a chat template (and use_chat_template=True) the prompt is
`[system?, user]` rendered by `tokenizer.apply_chat_template(..., add_generation_prompt=True)`;
without one it is the raw text (system prompt, if any, then a blank line, then the prompt),
tokenized with the tokenizer's own special tokens (e.g. a BOS).

Length: `render_prompt(..., max_prompt_tokens=N)` raises PromptTooLongError for a single prompt
over the limit; datasets drop such prompts with a counted warning (build_dataset / filter_by_length).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from .example import Example

log = logging.getLogger("rlfp8.data")
_warned_no_template: set[int] = set()


class PromptTooLongError(ValueError):
    """A rendered prompt is longer than max_prompt_tokens."""


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def build_messages(example: Example | str, system_prompt: str | None = None) -> list[dict[str, str]]:
    text = example.prompt if isinstance(example, Example) else str(example)
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    msgs.append({"role": "user", "content": text})
    return msgs


def prompt_text(tokenizer, example: Example | str, use_chat_template: bool = True,
                system_prompt: str | None = None) -> str:
    """The rendered prompt as text (for logs and debugging)."""
    return tokenizer.decode(render_prompt(tokenizer, example, use_chat_template, system_prompt))


def render_prompt(tokenizer, example: Example | str, use_chat_template: bool = True,
                  system_prompt: str | None = None, max_prompt_tokens: int | None = None) -> list[int]:
    """Token ids of the prompt, ending where the assistant's answer starts."""
    if use_chat_template and has_chat_template(tokenizer):
        out = tokenizer.apply_chat_template(build_messages(example, system_prompt), add_generation_prompt=True,
                                            tokenize=True, return_dict=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        if ids and isinstance(ids[0], (list, tuple)):  # some tokenizers return a batch of one
            ids = ids[0]
    else:
        if use_chat_template and id(tokenizer) not in _warned_no_template:
            _warned_no_template.add(id(tokenizer))
            log.warning("tokenizer %s has no chat template: prompts are the raw text",
                        type(tokenizer).__name__)
        text = example.prompt if isinstance(example, Example) else str(example)
        if system_prompt:
            text = f"{system_prompt}\n\n{text}"
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    ids = [int(t) for t in ids]
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        ex_id = example.id if isinstance(example, Example) else "<text>"
        raise PromptTooLongError(f"prompt {ex_id} has {len(ids)} tokens > data.max_prompt_tokens={max_prompt_tokens}")
    return ids


def render_prompts(tokenizer, examples: Iterable[Example | str], use_chat_template: bool = True,
                   system_prompt: str | None = None, max_prompt_tokens: int | None = None) -> list[list[int]]:
    return [render_prompt(tokenizer, e, use_chat_template, system_prompt, max_prompt_tokens) for e in examples]


def prompt_fits(tokenizer, example: Example | str, max_prompt_tokens: int, use_chat_template: bool = True,
                system_prompt: str | None = None) -> bool:
    return len(render_prompt(tokenizer, example, use_chat_template, system_prompt)) <= max_prompt_tokens


def filter_by_length(tokenizer, examples: Sequence[Example], max_prompt_tokens: int, use_chat_template: bool = True,
                     system_prompt: str | None = None, what: str = "prompts") -> tuple[list[Example], int]:
    """Drop examples whose rendered prompt is longer than max_prompt_tokens; returns (kept, dropped)
    and logs one warning with the count."""
    kept = [e for e in examples if prompt_fits(tokenizer, e, max_prompt_tokens, use_chat_template, system_prompt)]
    dropped = len(examples) - len(kept)
    if dropped:
        log.warning("dropped %d of %d %s longer than max_prompt_tokens=%d", dropped, len(examples), what,
                    max_prompt_tokens)
    return kept, dropped
