"""HOPE's REASON/QUESTION action format (App. G.2), shared by the question-asking games
(TwentyQuestions, GuessMyCity): a reason, then the one question or guess the turn plays."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    reason: str
    question: str


class ActionParseError(ValueError):
    """A policy output that does not follow the REASON/QUESTION format."""


def render_action(reason: str, question: str) -> str:
    return f"REASON: {reason}\nQUESTION: {question}"


def split_reason(text: str, field: str, error: type[ValueError] = ActionParseError) -> tuple[str, str]:
    """(reason, rest) of "REASON: ...\\n<field>: ...": the reason with its whitespace collapsed,
    the text after `field:` as it is. Shared by the two-field actions (QUESTION here, persuasion's
    MESSAGE); `error` is the action format's own error class."""
    start = text.find("REASON:")
    if start < 0:
        raise error("missing 'REASON:'")
    if text[:start].strip():
        raise error(f"unexpected text before 'REASON:': {text[:start].strip()[:40]!r}")
    body = text[start + len("REASON:"):]
    split = body.find(f"{field}:")
    if split < 0:
        raise error(f"missing '{field}:' after the reason")
    return " ".join(body[:split].split()), body[split + len(field) + 1:]


def parse_action(text: str) -> Action:
    """Parse "REASON: ...\\nQUESTION: ...". The reason may span lines (whitespace is collapsed);
    the question is the first non-empty line after QUESTION:, so trailing chatter is dropped."""
    reason, rest = split_reason(text, "QUESTION")
    question = next((line for line in (line.strip() for line in rest.splitlines()) if line), "")
    if not question:
        raise ActionParseError("empty question after 'QUESTION:'")
    return Action(reason=reason, question=question)


class ReasonQuestionActions:
    """The environment interface's action format (envs/base.py) for a game played in this format;
    listed before Environment among a game's bases."""

    def render_action(self, reason: str, action: str) -> str:
        return render_action(reason, action)

    def parse_action(self, text: str) -> tuple[str, str]:
        action = parse_action(text)
        return action.reason, action.question
