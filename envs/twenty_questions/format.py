"""The policy's chat format: system prompt, per-turn user messages, and HOPE's REASON/QUESTION
action format (App. G.2) with its parser. The texts are Jinja2 templates in `prompts/`."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jinja2

from .game import MAX_TURNS

_TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).parent / "prompts"),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    autoescape=False,
)


@dataclass(frozen=True)
class Action:
    reason: str
    question: str


class ActionParseError(ValueError):
    """A policy output that does not follow the REASON/QUESTION format."""


def render_action(reason: str, question: str) -> str:
    return f"REASON: {reason}\nQUESTION: {question}"


def parse_action(text: str) -> Action:
    """Parse "REASON: ...\\nQUESTION: ...". The reason may span lines (whitespace is collapsed);
    the question is the first non-empty line after QUESTION:, so trailing chatter is dropped."""
    start = text.find("REASON:")
    if start < 0:
        raise ActionParseError("missing 'REASON:'")
    if text[:start].strip():
        raise ActionParseError(f"unexpected text before 'REASON:': {text[:start].strip()[:40]!r}")
    body = text[start + len("REASON:"):]
    split = body.find("QUESTION:")
    if split < 0:
        raise ActionParseError("missing 'QUESTION:' after the reason")
    lines = [line.strip() for line in body[split + len("QUESTION:"):].splitlines()]
    question = next((line for line in lines if line), "")
    if not question:
        raise ActionParseError("empty question after 'QUESTION:'")
    return Action(reason=" ".join(body[:split].split()), question=question)


def system_prompt(max_turns: int = MAX_TURNS, candidates: list[str] | None = None) -> str:
    return _render("agent_system.j2", max_turns=max_turns, candidates=candidates)


def observation_message(answer: str | None, turn: int, max_turns: int) -> str:
    """The user message before action number `turn` (0-based); `answer` is None before the first."""
    return _render("observation.j2", answer=answer, turn=turn, max_turns=max_turns, finished=False)


def final_message(answer: str, success: bool) -> str:
    """The user message after the last action of an episode."""
    return _render("observation.j2", answer=answer, finished=True, success=success)


def _render(name: str, **context: object) -> str:
    return _TEMPLATES.get_template(name).render(**context).strip()
