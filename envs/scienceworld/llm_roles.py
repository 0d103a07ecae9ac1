"""ScienceWorld's roles played by an LLM: the summarizer's and the proposer's prompts (prompts/,
in this project's words after HOPE's structure) and their parsers, and the proposer's reply
format, which the distilled proposer (tasks/proposer.py) learns from the oracle's proposals.

Both prompts show the task's description and its gold path (the hidden state the oracle roles
use too) and the episode as numbered actions and observations, each observation cut as the
policy's chat cuts it (`observation_words`). A proposal is `{"teacher_reason", "thought",
"action"}`: the thought and the action make the agent's turn (format.render_action), the
teacher's reason is hindsight and stays out of it.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from envs.base import Counterfactual, Request
from envs.question_roles import parse_summary, proposal_items

from .format import MAX_ACTION_CHARS, PROMPTS, cut, parse_action, render_action

chat = PROMPTS.chat
TEMPLATES = {"summarizer": ("summary.j2",), "proposer": ("proposer.j2",)}
ECHO_MARKS = ("## Gold path", "## Episode", "## Summary of the whole episode", "Reply with", "What should the agent do now?")
HINDSIGHT = ("gold path",)  # what an agent's thought cannot know


def template_hash(role: str) -> str:
    if role not in TEMPLATES:
        raise NotImplementedError(f"ScienceWorld has no LLM {role} prompt (its LLM roles: {', '.join(TEMPLATES)})")
    return PROMPTS.hash(*TEMPLATES[role])


def no_echo(text: str) -> None:
    if mark := next((m for m in ECHO_MARKS if m in text), None):
        raise ValueError(f"the output repeats the prompt ({mark!r})")


def episode(turns: Sequence[Mapping], words: int | None) -> str:
    """The turns as the prompts show them: "Action k: ..." then "Observation k: ..."."""
    return "\n".join(f"Action {i + 1}: {t['action']}\nObservation {i + 1}: {cut(str(t['observation']), words)}" for i, t in enumerate(turns))


def summary_request(description: str, gold: Sequence[str], turns: Sequence[Mapping], outcome: str, max_steps: int, words: int | None) -> Request[str]:
    prompt = chat("summary.j2", description=description, gold=list(gold), episode=episode(turns, words), outcome=outcome, max_steps=max_steps)

    def parse(text: str) -> str:
        no_echo(text)
        return parse_summary(text)

    return Request(prompt, parse)


def parse_proposals(text: str, n: int) -> list[Counterfactual]:
    """Up to n proposals; each action one line the agent's format reads back as it is, each
    thought free of what only hindsight knows."""
    no_echo(text)
    out = []
    for i, (item, fields) in enumerate(proposal_items(text, n, ("teacher_reason", "thought", "action"))):
        if "\n" in item["action"].strip() or len(fields["action"]) > MAX_ACTION_CHARS:
            raise ValueError(f"proposal {i}: the action is not one line of at most {MAX_ACTION_CHARS} characters")
        if said := next((w for w in HINDSIGHT if w in fields["thought"].lower()), None):
            raise ValueError(f"proposal {i}: the thought mentions the {said}, which the agent never sees")
        thought, action = fields["thought"], fields["action"]
        if parse_action(render_action(thought, action)) != (thought, action):  # "Action:" inside the thought
            raise ValueError(f"proposal {i}: the thought and the action do not read back as one turn")
        out.append(Counterfactual(render_action(thought, action), action, thought, fields["teacher_reason"]))
    return out


def proposer_request(description: str, gold: Sequence[str], prefix: Sequence[Mapping], n: int, summary: str, max_steps: int,
                     words: int | None) -> Request[list[Counterfactual]]:
    prompt = chat("proposer.j2", description=description, gold=list(gold), episode=episode(prefix, words), n=n, summary=summary,
                  step=len(prefix), max_steps=max_steps)
    return Request(prompt, lambda text: parse_proposals(text, n))


def proposal_reply(proposals: Sequence[Counterfactual]) -> str:
    """The reply parse_proposals reads back as `proposals`, one line in a ```json block."""
    if not proposals:
        raise ValueError("no proposals to write a reply of")
    items = [{"teacher_reason": p.rationale, "thought": p.reason, "action": p.action} for p in proposals]
    return "```json\n" + json.dumps(items, ensure_ascii=False) + "\n```"
