"""QA teacher roles played by an LLM: the judge (the paper's rubric), the summarizer and the
hindsight proposer, their prompts (prompts/, our words) and the parsers of their replies.

There is no LLM simulator: the teacher is scripted in the paper's reasoning setting. Every parser
raises ValueError saying what is wrong, so the caller samples again and in the end records why.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from envs.base import Counterfactual, Request
from envs.question_roles import parse_summary, proposal_items

from .format import PROMPTS, read_answer, reasoning, teacher_turn, thinking_blocks
from .judge import RUBRIC
from .questions import LETTERS, Question

TEMPLATES = {"judge": ("judge.j2", "teacher.j2"), "summarizer": ("summary.j2", "teacher.j2"), "proposer": ("proposer.j2", "teacher.j2")}
ECHO_MARKS = ("=== CONVERSATION ===", "Rate it in the format", "Summarize it in one paragraph", "Write up to")


def no_echo(text: str) -> None:
    mark = next((m for m in ECHO_MARKS if m in text), None)
    if mark:
        raise ValueError(f"the output repeats the prompt ({mark!r})")


def choices(q: Question) -> str:
    return ", ".join(f"{L}. {o}" for L, o in zip(LETTERS, q.options))


def transcript(q: Question, mode: str, turns_total: int, turns: Sequence[Mapping]) -> str:
    """The conversation so far, "Teacher:" and "Assistant:" turns; the replies whole, thinking
    included (the judge's justifications read the reasoning), and the teacher's next message
    after a prefix that stops before the end."""
    lines = []
    for t, turn in enumerate(turns):
        lines += [f"Teacher: {teacher_turn(q, mode, t, turns_total)}", f"Assistant: {turn['action']}"]
    if len(turns) < turns_total:
        lines.append(f"Teacher: {teacher_turn(q, mode, len(turns), turns_total)}")
    return "\n\n".join(lines)


def judge_request(q: Question, mode: str, turns_total: int, turns: Sequence[Mapping]) -> Request[dict[str, float]]:
    def parse(text: str) -> dict[str, float]:
        no_echo(text)
        return RUBRIC.parse(text)

    return Request(PROMPTS.chat("judge.j2", question=q, choices=choices(q), transcript=transcript(q, mode, turns_total, turns)), parse)


def summary_request(q: Question, mode: str, turns_total: int, turns: Sequence[Mapping]) -> Request[str]:
    def parse(text: str) -> str:
        no_echo(text)
        return parse_summary(text)

    return Request(PROMPTS.chat("summary.j2", question=q, choices=choices(q), transcript=transcript(q, mode, turns_total, turns)), parse)


def counterfactual(reply: str, rationale: str) -> Counterfactual:
    return Counterfactual(reply, " ".join(reply.split()), reasoning(reply), rationale)


def proposer_request(q: Question, mode: str, turns_total: int, prefix: Sequence[Mapping], n: int, summary: str) -> Request[list[Counterfactual]]:
    prompt = PROMPTS.chat("proposer.j2", n=n, mode=mode, question=q, choices=choices(q), summary=summary,
                          transcript=transcript(q, mode, turns_total, prefix))

    def parse(text: str) -> list[Counterfactual]:
        """Each proposal's reply must state a letter outside its thinking, and in the thinking
        mode reason inside a block: what the answerer's format asks of a turn."""
        no_echo(text)
        out = []
        for i, (item, fields) in enumerate(proposal_items(text, n, ("teacher_reason", "reply"))):
            reply = item["reply"].strip()
            letter, why = read_answer(reply)
            if letter is None:
                raise ValueError(f"proposal {i}: {why}")
            if mode == "thinking" and not thinking_blocks(reply):
                raise ValueError(f"proposal {i}: no <thinking></thinking> block, which the thinking mode asks of every reply")
            out.append(counterfactual(reply, fields["teacher_reason"]))
        return out

    return Request(prompt, parse)


def proposal_reply(proposals: Sequence[Counterfactual]) -> str:
    """The reply the proposer's parser reads back as `proposals` (the distilled proposer's target)."""
    if not proposals:
        raise ValueError("no proposals to write a reply of")
    items = [{"teacher_reason": p.rationale, "reply": p.text} for p in proposals]
    return "```json\n" + json.dumps(items, ensure_ascii=False) + "\n```"
