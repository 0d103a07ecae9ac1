"""The policy's chat format: system prompt and per-turn user messages (Jinja2 templates in
`prompts/`); the action format is HOPE's REASON/QUESTION (envs/reason_question.py)."""
from __future__ import annotations

from pathlib import Path

import jinja2

from envs.reason_question import Action, ActionParseError, parse_action, render_action  # noqa: F401  the action format

from .game import MAX_TURNS

_TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).parent / "prompts"),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    autoescape=False,
)


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
