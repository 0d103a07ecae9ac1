"""TwentyQuestions roles played by an LLM: their prompts (Jinja2 files in prompts/, in our own
words after HOPE's and HR's structure) and the parsers of what is this game's own, the yes/no
answers; the parsers every question game shares are in envs/question_roles.py."""
from __future__ import annotations

import re

from envs import question_roles

from .format import PROMPTS

chat = PROMPTS.chat
template_hash = PROMPTS.hash


def _yes_no_unknown(text: str) -> str | None:
    m = re.match(r"(yes|no|unknown)\b", text, re.I)
    return m.group(1).lower() if m else None


def parse_continuation(text: str, start: int, max_turns: int) -> list[tuple[str, str]]:
    """The forward model's continuation (question_roles.parse_continuation), each question
    answered yes, no or unknown."""
    return question_roles.parse_continuation(text, start, max_turns, _yes_no_unknown, "yes|no")


# ---- simulator (the answerer, as an LLM) ----


def parse_yes_no(text: str) -> str:
    words = re.findall(r"[a-z]+", text.strip().lower())
    if not words or words[0] not in ("yes", "no"):
        raise ValueError(f"expected yes or no, got {text.strip()[:40]!r}")
    return words[0]
