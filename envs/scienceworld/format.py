"""ETO's ReAct turn for ScienceWorld: the agent writes `Thought: ...` then `Action: ...`, and the
world answers `Observation: ...`. The system prompt (prompts/agent_system.j2, in this project's
words) lists ETO's action set; the first user message is the task and what the agent sees where
it starts.

`observation_words` (the environment's option) is how much of each observation the policy's chat
shows: an observation longer than that keeps its first words and says how many were cut. The
trajectory's turn records keep every observation whole.
"""
from __future__ import annotations

import re
from pathlib import Path

from envs.question_roles import Prompts

PROMPTS = Prompts(Path(__file__).parent / "prompts")
MAX_ACTION_CHARS = 200  # the longest gold action of the short task types is under 100


class ActionParseError(ValueError):
    """A policy output that does not follow the Thought/Action format."""


def render_action(thought: str, action: str) -> str:
    return f"Thought: {thought}\nAction: {action}"


def parse_action(text: str) -> tuple[str, str]:
    """(thought, action) of "Thought: ...\\nAction: ...". The thought may span lines (whitespace
    is collapsed) and may be empty; the action is the first non-empty line after "Action:", its
    whitespace collapsed, so trailing chatter is dropped."""
    start = text.find("Thought:")
    if start < 0:
        raise ActionParseError("missing 'Thought:'")
    if text[:start].strip():
        raise ActionParseError(f"unexpected text before 'Thought:': {text[:start].strip()[:40]!r}")
    body = text[start + len("Thought:"):]
    split = body.find("Action:")
    if split < 0:
        raise ActionParseError("missing 'Action:' after the thought")
    action = next((" ".join(line.split()) for line in body[split + len("Action:"):].splitlines() if line.strip()), "")
    if not action:
        raise ActionParseError("empty action after 'Action:'")
    if len(action) > MAX_ACTION_CHARS:
        raise ActionParseError(f"action of {len(action)} characters, over {MAX_ACTION_CHARS}")
    return " ".join(body[:split].split()), action


def system_prompt(max_steps: int, simplifications: str) -> str:
    parts = set(simplifications.split(","))
    easy = "easy" in parts
    return PROMPTS.render("agent_system.j2", max_steps=max_steps, teleport=easy or "teleportAction" in parts,
                          open_containers=easy or "openContainers" in parts)


def cut(observation: str, words: int | None) -> str:
    """The observation as the chat shows it: whole, or its first `words` words and the count cut
    (the text's own line breaks kept)."""
    if words is None:
        return observation
    spans = list(re.finditer(r"\S+", observation))
    if len(spans) <= words:
        return observation
    return f"{observation[: spans[words - 1].end()]} ... ({len(spans) - words} more words)"


def first_message(description: str, observation: str, words: int | None) -> str:
    return f"{description.strip()}\nObservation: {cut(observation, words)}"


def observation_message(observation: str, words: int | None, ending: str | None = None) -> str:
    text = f"Observation: {cut(observation, words)}"
    return f"{text}\n{ending}" if ending else text


INVALID = "Invalid action"


def invalid_observation(why: str) -> str:
    """What a turn that did not follow the format observes: the world was not asked."""
    return f"{INVALID} ({why}): nothing happened. Write 'Thought: ...' then 'Action: ...'."


def ending(score: int, completed: bool, out_of_steps: bool) -> str:
    """The line after the last observation of an episode."""
    if completed and score >= 100:
        return "The task is complete: score 100 of 100."
    if score < 0:
        return "The task failed: score 0 of 100."
    if out_of_steps:
        return f"No actions left: score {score} of 100."
    return f"The task ended: score {max(score, 0)} of 100."
