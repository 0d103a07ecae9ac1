"""The policy's chat format: system prompt and per-turn user messages (Jinja2 templates in
`prompts/`); the action format is HOPE's REASON/QUESTION (envs/reason_question.py)."""
from __future__ import annotations

from pathlib import Path

from envs.question_roles import Prompts
from envs.reason_question import Action, ActionParseError, parse_action, render_action  # noqa: F401  the action format

from .game import MAX_TURNS

PROMPTS = Prompts(Path(__file__).parent / "prompts")


def system_prompt(max_turns: int = MAX_TURNS, candidates: list[str] | None = None) -> str:
    return PROMPTS.render("agent_system.j2", max_turns=max_turns, candidates=candidates)


def observation_message(answer: str | None, turn: int, max_turns: int, known: str = "") -> str:
    """The user message before action number `turn` (0-based); `answer` is None before the first.
    `known`: what all the answers so far established (observation: known), else empty."""
    return PROMPTS.render("observation.j2", answer=answer, turn=turn, max_turns=max_turns, finished=False, known=known)


def final_message(answer: str, success: bool) -> str:
    """The user message after the last action of an episode."""
    return PROMPTS.render("observation.j2", answer=answer, finished=True, success=success, known="")
