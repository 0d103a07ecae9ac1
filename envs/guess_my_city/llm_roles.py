"""GuessMyCity roles played by an LLM: their prompts (Jinja2 files in prompts/, in our own words
after HOPE's and HR's structure and the GuessMyCity prompts of HOPE's code) and the parsers of
what is this game's own, the simulator's free-text answers; the parsers every question game
shares are in envs/question_roles.py."""
from __future__ import annotations

import re
from collections.abc import Iterable

from envs import question_roles

from .cities import normalize
from .format import PROMPTS

chat = PROMPTS.chat
template_hash = PROMPTS.hash

MAX_ANSWER_CHARS = 300  # "a few words": one or two sentences


def named(text: str, words: Iterable[str]) -> str | None:
    """The first of `words` (names of the city, its country) that `text` says, as whole words
    after normalisation, or None."""
    said = normalize(text)
    return next((w for w in words if re.search(rf"(?<!\w){re.escape(normalize(w))}(?!\w)", said)), None)


def read_answer(text: str, hidden: Iterable[str]) -> str:
    """An answer about the secret city: one short text that names none of the `hidden` words (the
    city's names and its country: HOPE's simulator must not reveal them unless guessed)."""
    answer = " ".join(text.split())
    if not answer:
        raise ValueError("empty answer")
    if len(answer) > MAX_ANSWER_CHARS:
        raise ValueError(f"answer of {len(answer)} characters, over {MAX_ANSWER_CHARS}")
    if (word := named(answer, hidden)) is not None:
        raise ValueError(f"the answer names {word!r}, which the player must find")
    return answer


def parse_simulator(text: str, hidden: Iterable[str]) -> str:
    """HOPE's simulator reply, "REASON: ..." then "ANSWER: ...": the answer is the first
    non-empty line after ANSWER:, so trailing chatter is dropped (the reason may name the city;
    the player never sees it)."""
    question_roles.no_echo(text)
    start = text.find("ANSWER:")
    if start < 0:
        raise ValueError("missing 'ANSWER:'")
    lines = [line for line in text[start + len("ANSWER:"):].splitlines() if line.strip()]
    return read_answer(lines[0] if lines else "", hidden)


def parse_continuation(text: str, start: int, max_turns: int) -> list[tuple[str, str]]:
    """The forward model's continuation (question_roles.parse_continuation), each answer a
    non-empty text; whether it names the city is judged as the game replays it."""
    return question_roles.parse_continuation(text, start, max_turns, lambda said: said or None, "<answer>")

