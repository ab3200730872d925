"""Example: one prompt and its reference answer (shared by tasks.py and prompts.py, importing neither)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    id: str
    prompt: str  # the user message text
    answer: str  # reference answer (integer string for arithmetic; LaTeX / plain for math)
