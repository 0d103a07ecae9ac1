"""The policy's chat format: system prompt and per-turn user messages (Jinja2 templates in
`prompts/`); the action format is HOPE's REASON/QUESTION (envs/reason_question.py)."""
from __future__ import annotations

from pathlib import Path

from envs.question_roles import Prompts

PROMPTS = Prompts(Path(__file__).parent / "prompts")


def system_prompt(max_turns: int, candidates: list[str] | None) -> str:
    return PROMPTS.render("agent_system.j2", max_turns=max_turns, candidates=candidates)


def observation_message(answer: str | None, turn: int, max_turns: int) -> str:
    """The user message before question number `turn` (0-based); `answer` is None before the first."""
    return PROMPTS.render("observation.j2", answer=answer, turn=turn, max_turns=max_turns, finished=False)


def final_message(answer: str, success: bool) -> str:
    """The user message after the last question of an episode."""
    return PROMPTS.render("observation.j2", answer=answer, finished=True, success=success)
