"""The QA teacher's tasks: four-option multiple-choice questions, each with its answer key and,
per option, the fact that settles it.

A question's `facts[i]` is a true statement about option i (why it is right, or why it fails) and
`false_facts[i]` the false statement a wrong answer about it relies on. The scripted answerers
write them (policies.py) and the oracle judge looks for them in the replies (judge.py): they are
what "sound reasoning" means here, checked exactly.

The paper's datasets (ARC, MMLU, OpenBookQA, SciQ, CoSQL, MathDial) cannot be downloaded here, so
the questions are generated from data the project ships (generators.py), or read from a user's
JSONL file (mcq_file.py). Either way a split's tasks come in a fixed order: the generators'
questions taken in turn, so the first few (limit_tasks) cover several generators.
"""
from __future__ import annotations

from dataclasses import dataclass

LETTERS = ("A", "B", "C", "D")
SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class Question:
    id: str  # the trajectory's task_id: "<source>-<split>-<k>"
    split: str
    source: str  # the generator (or "file") that made it
    question: str
    options: tuple[str, str, str, str]
    answer: str  # the key, one of LETTERS
    instruction: str  # the dataset-specific line of the teacher's first turn (the paper's ARC: "This question is from a science exam.")
    facts: tuple[str, str, str, str]
    false_facts: tuple[str, str, str, str]
    objects: tuple[str, ...]  # what the question is about (objects, cities, car models, a problem): disjoint across splits

    @property
    def key(self) -> int:
        return LETTERS.index(self.answer)

    def option(self, letter: str) -> str:
        return self.options[LETTERS.index(letter)]


def check_question(q: Question) -> None:
    """ValueError naming what is wrong: four distinct non-empty options, a key among A-D, one
    fact and one false fact per option, none empty."""
    if len(q.options) != 4 or any(not o.strip() for o in q.options):
        raise ValueError(f"{q.id}: expected four non-empty options, got {list(q.options)}")
    if len({" ".join(o.lower().split()) for o in q.options}) != 4:
        raise ValueError(f"{q.id}: two options are the same: {list(q.options)}")
    if q.answer not in LETTERS:
        raise ValueError(f"{q.id}: answer {q.answer!r} is not one of {', '.join(LETTERS)}")
    for name in ("facts", "false_facts"):
        values = getattr(q, name)
        if len(values) != 4 or any(not v.strip() for v in values):
            raise ValueError(f"{q.id}: expected one non-empty {name[:-1].replace('_', ' ')} per option")
