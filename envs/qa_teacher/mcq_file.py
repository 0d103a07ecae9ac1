"""A user's own multiple-choice questions: a JSONL file, one question a line.

    {"question": "...", "options": ["...", "...", "...", "..."], "answer": "B"}

Required: `question` (text), `options` (four distinct texts, as a list or as {"A": ..., "D": ...}),
`answer` (the key's letter, A to D). Optional: `id` (the task id; else "file-<split>-<line>"),
`split` (train, val or test; else drawn by a hash of the question's text in the proportions of
the environment's split sizes, so a line keeps its split however the file is reordered),
`instruction` (the teacher's dataset line), and `facts` / `false_facts` (four statements each,
one per option, that the oracle judge looks for: why each option is right or wrong, and what a
wrong answer would claim). Without them each option's fact is "<letter>. <option>: the right
answer." or "...: wrong.", so the oracle judge scores the answer and which options a dialogue
settled, not why.

The environment's tasks are read when it is made, with no stage to quarantine rows into, so a
bad line stops it as `retrosight import --on-error raise` does: "FILE:LINE: field 'X': reason".
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .questions import LETTERS, SPLITS, Question, check_question

KEYS = ("id", "question", "options", "answer", "split", "instruction", "facts", "false_facts")
MAX_CHARS = 4000  # a question or option a teacher would read out in one turn


class MCQFileError(ValueError):
    """The file, or one of its lines, is not a question; the message names the line and field."""


class _Bad(Exception):
    def __init__(self, field: str, reason: str):
        super().__init__(f"field '{field}': {reason}")


def _text(row: dict, field: str, required: bool = True) -> str | None:
    value = row.get(field)
    if value is None:
        if required:
            raise _Bad(field, "missing")
        return None
    if not isinstance(value, str):
        raise _Bad(field, f"expected text, got {type(value).__name__}")
    if not value.strip():
        raise _Bad(field, "empty")
    if len(value) > MAX_CHARS:
        raise _Bad(field, f"{len(value)} characters, over {MAX_CHARS}")
    return " ".join(value.split())


def _four(row: dict, field: str, required: bool) -> tuple[str, str, str, str] | None:
    value = row.get(field)
    if value is None and not required:
        return None
    if isinstance(value, dict):
        if sorted(value) != list(LETTERS):
            raise _Bad(field, f"keys {sorted(value)}, expected {list(LETTERS)}")
        value = [value[k] for k in LETTERS]
    if not isinstance(value, list):
        raise _Bad(field, "missing" if value is None else f"expected a list of four texts, got {type(value).__name__}")
    if len(value) != 4:
        raise _Bad(field, f"{len(value)} entries, expected 4")
    return tuple(_text({f"{field}[{i}]": v}, f"{field}[{i}]") for i, v in enumerate(value))  # type: ignore[return-value]


def share_split(text: str, shares: dict[str, int]) -> str:
    """A split drawn by the hash of `text`, in proportion to `shares`."""
    u = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64 * sum(shares.values())
    for split in SPLITS:
        if u < shares[split]:
            return split
        u -= shares[split]
    return SPLITS[-1]


def _question(row: object, line: int, shares: dict[str, int]) -> Question:
    if not isinstance(row, dict):
        raise _Bad("(line)", f"expected a JSON object, got {type(row).__name__}")
    unknown = sorted(set(row) - set(KEYS))
    if unknown:
        raise _Bad(unknown[0], f"unknown field (expected fields from: {', '.join(KEYS)})")
    question = _text(row, "question")
    options = _four(row, "options", True)
    answer = row.get("answer")
    if not isinstance(answer, str) or answer.strip().upper() not in LETTERS:
        raise _Bad("answer", "missing" if answer is None else f"{answer!r} is not one of {', '.join(LETTERS)}")
    answer = answer.strip().upper()
    split = _text(row, "split", required=False) or share_split(question, shares)
    if split not in SPLITS:
        raise _Bad("split", f"{split!r} is not one of {', '.join(SPLITS)}")
    facts, false = _four(row, "facts", False), _four(row, "false_facts", False)
    if (facts is None) != (false is None):
        raise _Bad("facts" if facts is None else "false_facts", "give facts and false_facts together, or neither")
    if facts is None:
        right = [L == answer for L in LETTERS]
        facts = tuple(f"{L}. {o}: {'the right answer' if r else 'wrong'}." for L, o, r in zip(LETTERS, options, right))
        false = tuple(f"{L}. {o}: {'wrong' if r else 'the right answer'}." for L, o, r in zip(LETTERS, options, right))
    q = Question(_text(row, "id", required=False) or f"file-{split}-{line:04d}", split, "file", question, options, answer,
                 _text(row, "instruction", required=False) or "", facts, false, (question,))
    try:
        check_question(q)
    except ValueError as e:
        raise _Bad("options", str(e).split(": ", 1)[1]) from None
    return q


def load_mcq_file(path: str | Path, shares: dict[str, int]) -> dict[str, list[Question]]:
    """Every split's questions from the file, in file order; MCQFileError naming the line and
    field of the first bad line, or a question or id that appears twice."""
    path = Path(path)
    if not path.is_file():
        raise MCQFileError(f"{path}: no such file")
    out: dict[str, list[Question]] = {s: [] for s in SPLITS}
    seen_ids: dict[str, int] = {}
    seen_text: dict[str, int] = {}
    with path.open("rb") as f:
        lines = [(n, raw) for n, raw in enumerate(f, start=1) if raw.strip()]
    if not lines:
        raise MCQFileError(f"{path}: empty file: no questions")
    for n, raw in lines:
        try:
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise _Bad("(line)", f"not JSON: {e}") from None
            q = _question(row, n, shares)
            if (first := seen_ids.setdefault(q.id, n)) != n:
                raise _Bad("id", f"{q.id!r} is the id of line {first} too")
            if (first := seen_text.setdefault(" ".join(q.question.lower().split()), n)) != n:
                raise _Bad("question", f"the same question as line {first}")
        except _Bad as e:
            raise MCQFileError(f"{path}:{n}: {e}") from None
        out[q.split].append(q)
    return out
