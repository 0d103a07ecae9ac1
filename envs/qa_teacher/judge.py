"""The judge: the paper's five criteria and Overall, each 0 to 10; the reward is Overall / 10.

The LLM judge's reply is read by RUBRIC (envs/rubric.py): Overall is parsed, never recomputed,
since a judge's holistic score need not be the mean of the five (the paper's own judge departs
from it); the label stage keeps the mean of the five beside it as a check.

The oracle judge (`judge`) scores a transcript against the answer key and each option's fact and
false fact (questions.py) by these rules. A statement counts as made when its words appear in a
reply, in order, case, punctuation and spacing aside (the scripted answerers write them so; an
LLM paraphrasing them is the LLM judge's to score). K is the key, "the final answer" the final
turn's letter (format.read_answer), "justified" that the final reply states K's fact.
- Accuracy (moving toward the correct answer): final answer K: 10 less 5 x the share of earlier
  turns that did not state K (10 to 5); otherwise 2 if an earlier turn stated K (it moved away),
  else 0.
- Reasoning ability (logical, clear, precise): 2 per option whose fact is stated anywhere, +2 if
  justified, -4 per option whose false fact is stated anywhere; within 0 to 10.
- Comprehensiveness (key concepts explained, the other options addressed): 10 x the share of
  the three distractors whose fact is stated anywhere, rounded.
- Pedagogical value (does each turn help someone learn): 10 x the share of turns that do what
  their teacher turn asked, rounded: the first states a fact; a middle one states a distractor's
  fact and is not a repeat of an earlier reply; the final one states a letter and is justified.
  In the thinking mode a turn must also hold a thinking block, as every teacher turn asks.
- Confidence calibration: 10 if the final answer is K and justified, 6 if K unjustified, 3 if
  there is no final answer (none stated, or a hedge), 0 if it is wrong.
- Overall (holistic): the mean of the five to one decimal, held on the side of 5 that the final
  answer puts it: at least 5 when it is K, at most 4 when not. A conversation that ends on the
  wrong answer is never a good one, and the reward's 0.5 then tells right from wrong (`won`).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from envs.rubric import Rubric

from .format import read_answer, thinking_blocks
from .questions import Question

CRITERIA = ("Accuracy", "Reasoning ability", "Comprehensiveness", "Pedagogical value", "Confidence calibration", "Overall")
RUBRIC = Rubric(CRITERIA)
VERSION = "qa-teacher-judge-v1"


def normal(text: str) -> str:
    """Lower case, tags gone, every run of characters other than letters, digits and $ one space."""
    text = re.sub(r"</?thinking>", " ", text, flags=re.I).lower()
    return " " + " ".join(re.sub(r"[^0-9a-z$]+", " ", text).split()) + " "


def states(reply: str, sentence: str) -> bool:
    return normal(sentence) in normal(reply)


@dataclass(frozen=True)
class Verdict:
    scores: dict[str, float]  # the five criteria and Overall
    letters: tuple[str | None, ...]  # each turn's stated letter
    correct: bool  # the final answer is the key: exact-match accuracy

    @property
    def reward(self) -> float:
        return self.scores["Overall"] / 10

    def mean_of_five(self) -> float:
        return sum(self.scores[c] for c in CRITERIA[:-1]) / 5


def judge(q: Question, replies: Sequence[str], thinking: bool) -> Verdict:
    """The oracle judge's scores of a finished conversation's replies (module docstring)."""
    if not replies:
        raise ValueError("no replies to judge")
    letters = tuple(read_answer(r)[0] for r in replies)
    key, final = q.answer, letters[-1]
    correct = final == key
    k, distractors = q.key, [i for i in range(4) if i != q.key]
    said = [{i for i in range(4) if states(r, q.facts[i])} for r in replies]
    anywhere = set().union(*said)
    false = {i for i in range(4) if any(states(r, q.false_facts[i]) for r in replies)}
    justified = k in said[-1]

    earlier = letters[:-1]
    if correct:
        accuracy = 10 - 5 * (sum(x != key for x in earlier) / len(earlier) if earlier else 0)
    else:
        accuracy = 2 if key in earlier else 0
    reasoning_ = min(10, max(0, 2 * len(anywhere) + 2 * justified - 4 * len(false)))
    comprehensive = round(10 * len(anywhere & set(distractors)) / 3)
    seen = [normal(r) for r in replies]
    done = []
    for t, reply in enumerate(replies):
        if t == 0:
            ok = bool(said[0])
        elif t == len(replies) - 1:
            ok = letters[t] is not None and justified
        else:
            ok = bool(said[t] & set(distractors)) and seen[t] not in seen[:t]
        done.append(ok and (not thinking or bool(thinking_blocks(reply))))
    pedagogy = round(10 * sum(done) / len(replies))
    if correct:
        confidence = 10 if justified else 6
    else:
        confidence = 3 if final is None else 0
    five = [accuracy, reasoning_, comprehensive, pedagogy, confidence]
    overall = round(sum(five) / 5, 1)
    overall = max(5.0, overall) if correct else min(4.0, overall)
    scores = dict(zip(CRITERIA, [float(round(x, 1)) for x in five] + [overall]))
    return Verdict(scores, letters, correct)


def describe(q: Question, v: Verdict) -> str:
    """One line a label's reason and a summary carry."""
    final = v.letters[-1] or "none"
    told = ", ".join(f"{c} {v.scores[c]:g}" for c in CRITERIA[:-1])
    return f"final answer {final}, key {q.answer} ({'right' if v.correct else 'wrong'}); Overall {v.scores['Overall']:g} ({told})"
