"""The persuader's action format, REASON then MESSAGE (HOPE's two-field shape, the message being
what the donor hears), and the policy's chat: system prompt and per-turn user messages
(Jinja2 templates in prompts/)."""
from __future__ import annotations

from pathlib import Path

from envs.question_roles import Prompts
from envs.reason_question import split_reason

PROMPTS = Prompts(Path(__file__).parent / "prompts")
MAX_MESSAGE_CHARS = 1000  # a message a donor would read in one turn


class ActionParseError(ValueError):
    """A persuader's output that does not follow the REASON/MESSAGE format."""


def render_action(reason: str, message: str) -> str:
    return f"REASON: {reason}\nMESSAGE: {message}"


def parse_action(text: str) -> tuple[str, str]:
    """(reason, message) of "REASON: ...\\nMESSAGE: ...". Both may span lines (whitespace is
    collapsed); the message must say something and fit in MAX_MESSAGE_CHARS."""
    reason, rest = split_reason(text, "MESSAGE", ActionParseError)
    message = " ".join(rest.split())
    if not message:
        raise ActionParseError("empty message after 'MESSAGE:'")
    if len(message) > MAX_MESSAGE_CHARS:
        raise ActionParseError(f"message of {len(message)} characters, over {MAX_MESSAGE_CHARS}")
    return reason, message


def system_prompt(max_turns: int) -> str:
    return PROMPTS.render("agent_system.j2", max_turns=max_turns)


def observation_message(said: str | None, turn: int, max_turns: int, finished: bool = False, donation: float | None = None) -> str:
    """The user message before message number `turn` (0-based), or after the last one."""
    return PROMPTS.render("observation.j2", said=said, turn=turn, max_turns=max_turns, finished=finished, donation=donation)


def invalid_observation(why: str) -> str:
    """What the turn records when the action did not follow the format: the donor heard nothing."""
    return f"Invalid action ({why}): the donor heard nothing. Write REASON: ... then MESSAGE: ..."


def final_message(said: str, donation: float | None) -> str:
    """The user message after the last turn of a conversation."""
    return PROMPTS.render("observation.j2", said=said, turn=0, max_turns=0, finished=True, donation=donation)
