"""The answerer's format and the teacher's words.

Every assistant turn begins with "The answer is X" (X one of A-D), as the paper's system prompt
demands in both modes, then the reasoning: inside <thinking></thinking> tags in the thinking
mode, as plain text in the standard one. The turn is the whole message (the paper's a_t), so a
trajectory's turn records hold the message as the `action` and its reasoning as the `reason`.

The answer extractor (`read_answer`), the rule accuracy is measured by:
1. Thinking blocks are dropped first: "<thinking>...</thinking>" (any case), an unclosed
   "<thinking>" to the end of the text, and stray tags. The answer must stand outside them (the
   system prompt says so), so an answer given only inside a block is no answer.
2. The answer is the first statement "The answer is X" (also "Answer is X", "The final answer
   is X", "Answer: X"; the words in any case, "is:" allowed), X an upper-case A, B, C or D, in
   parentheses or bold or not, and followed by no letter or digit: "The answer is Apple" and
   "The answer is a bicycle" state no letter. The first wins: the system prompt asks for the
   answer first, so a later "the answer is" is discussion (quoting a student, a revision after
   the fact).
3. A statement naming two letters, "A or B" or "A/B", hedges: no answer.
4. No statement, no answer: exact-match accuracy counts it wrong, as the paper's Base examples
   without "The answer is" line count.
"""
from __future__ import annotations

import re
from pathlib import Path

from envs.question_roles import Prompts

from .questions import LETTERS, Question

PROMPTS = Prompts(Path(__file__).parent / "prompts")

_BLOCK = re.compile(r"<thinking>.*?(?:</thinking>|\Z)", re.I | re.S)
_TAG = re.compile(r"</?thinking>", re.I)
_STATEMENT = re.compile(
    r"(?i:\b(?:the\s+)?(?:final\s+)?answer\s*(?:is\s*:?|:))\s*[*_]*\s*\(?\s*(?P<letter>[A-D])\s*\)?[*_]*(?![A-Za-z0-9])"
    r"(?P<hedge>\s*(?i:or|/)\s*\(?\s*[A-D]\s*\)?(?![A-Za-z0-9]))?"
)


def outside_thinking(text: str) -> str:
    return _TAG.sub(" ", _BLOCK.sub(" ", text))


def read_answer(text: str) -> tuple[str | None, str]:
    """(the letter the reply states, or None; why not, when None)."""
    m = _STATEMENT.search(outside_thinking(text))
    if m is None:
        inside = _STATEMENT.search(text) is not None
        return None, "the answer is stated only inside the thinking tags" if inside else "no 'The answer is X' statement (X one of A-D)"
    if m.group("hedge"):
        return None, f"the answer hedges between two letters ({' '.join(m.group(0).split())!r})"
    return m.group("letter"), ""


def thinking_blocks(text: str) -> list[str]:
    """The contents of the reply's closed thinking blocks."""
    return [m.group(1) for m in re.finditer(r"<thinking>(.*?)</thinking>", text, re.I | re.S)]


def reasoning(text: str) -> str:
    """The turn's reason: the reply outside the thinking blocks without its answer statement,
    then the blocks' contents, whitespace collapsed."""
    outside = _STATEMENT.sub(" ", outside_thinking(text), count=1)
    return " ".join(" ".join([outside, *thinking_blocks(text)]).split()).lstrip(".,;:*_ ")


def render_reply(mode: str, letter: str, reason: str) -> str:
    """A reply in the system prompt's format: the answer first, then the reasoning."""
    head = f"The answer is {letter}."
    if not reason:
        return head
    return f"{head}\n<thinking>{reason}</thinking>" if mode == "thinking" else f"{head} {reason}"


def system_prompt(mode: str) -> str:
    return PROMPTS.render("system.j2", mode=mode)


def teacher_turn(question: Question, mode: str, turn: int, turns: int) -> str:
    """The teacher's message before the answerer's turn `turn` (0-based) of `turns`: the question
    first, why other options fail second, the final answer last, and between those two (turns > 3)
    the paper's intermediate turn, numbered from 1."""
    kind = "first" if turn == 0 else "final" if turn == turns - 1 else "eliminate" if turn == 1 else "explore"
    return PROMPTS.render("teacher.j2", turn=kind, mode=mode, question=question, choices=list(zip(LETTERS, question.options)), number=turn + 1)
