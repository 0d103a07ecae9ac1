"""ScienceWorld's oracle hindsight roles, grounded in what the simulator knows of a task: its
description, the room the agent starts in, and the gold path (the expert's: the simulator's gold
action sequence, its door openings left out where the doors start open, policies.expert_path).
They read a trajectory's turn records (action, observation, reward) and never ask the world again.

- The walk along the gold path (`walk`): the agent's room is the start room, then the room of
  each move the world confirmed ("You move to the X." / "You teleport to the X."). Its place on
  the gold path is the next gold action: a turn whose action is that one moves it on, unless the
  world did not take it (a text off the Thought/Action format, or "No known action matches that
  input."); and after every turn the gold moves the agent's room makes needless are passed (in
  the run of moves at that place, those up to the last one into the room it stands in). So a
  teleport straight to where the gold path goes counts as its walk there.
- summarizer (HOPE's pi_sum): the task and its description; how many of the gold path's actions
  the agent got through and where it first left the path (the first turn that did not move it
  on: its action and the gold one); the score's progress (each step where the score the episode
  credits changed: ScienceWorld's subgoals reached, or a failing focus taking them back); the
  turns off the format, the actions the simulator did not understand, repeated actions; the
  outcome (completed at 100, ended by the simulator before the step limit (a focus on the wrong
  thing), or out of steps at its score, with the gold path's next action).
- proposer (HOPE's pi_H): the gold path's next action at the agent's place; when the agent is not
  in the room the gold path is in there and the world lets it teleport (`easy` or
  `teleportAction`), a teleport instead, to that room, or to the gold move's room when the next
  action is a move: a gold action played from another room is not understood, and walking back
  may need doors the gold path never opened. One proposal a state; none when the action taken
  there is the one proposed, or the gold path is played out. The thought is the expert's
  templated one (policies.thought), what an agent could think without hindsight; the rationale
  says what hindsight knows (the gold path's progress, the rooms).
- controller (HR): the turns where the action taken was not the proposer's, those whose step lost
  score (a failing focus) first, then in order; each with the proposer's replacement.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from envs.base import Counterfactual

from .format import INVALID, render_action
from .policies import expert_path, thought

VERSIONS = {"summarizer": "scienceworld-summary-1", "proposer": "scienceworld-proposer-1", "controller": "scienceworld-proposer-1"}
NOT_UNDERSTOOD = "No known action matches that input."
_MOVED = re.compile(r"You (?:move|teleport) to the (.+?)\.")
_ROOM = re.compile(r"This (?:room|.*? location) is called the (.+?)\.")
_MOVE = re.compile(r"(?:go|teleport) to (.+)", re.IGNORECASE)


@dataclass(frozen=True)
class Known:
    """What the simulator tells of a task before any action: the hidden state the roles use."""

    task_id: str
    description: str  # the task's own words, as the agent's first message shows them
    start: str | None  # the room the agent starts in (from the first observation)
    gold: tuple[str, ...]  # the path the expert plays (its door openings left out where doors are open)
    teleport: bool  # the world offers "teleport to LOC"


def known(task_id: str, description: str, first: str, gold: Sequence[str], doors_open: bool, teleport: bool) -> Known:
    m = _ROOM.search(first)
    return Known(task_id, " ".join(description.split()), m.group(1) if m else None,
                 tuple(" ".join(a.split()) for a in expert_path(list(gold), doors_open)), teleport)


def taken(turn: Mapping) -> bool:
    """The world took the turn's action: it followed the format and the simulator understood it."""
    observation = str(turn["observation"])
    return not observation.startswith(INVALID) and not observation.startswith(NOT_UNDERSTOOD)


def same(a: str, b: str) -> bool:
    return " ".join(a.lower().split()) == " ".join(b.lower().split())


def _past_travel(k: Known, i: int, here: str | None) -> int:
    j = i
    while j < len(k.gold) and (m := _MOVE.fullmatch(k.gold[j])):
        if here is not None and m.group(1).lower() == here.lower():
            i = j + 1
        j += 1
    return i


def walk(k: Known, turns: Sequence[Mapping]) -> tuple[list[int], str | None]:
    """The agent's place on the gold path (the index of its next gold action) before each turn and
    after the last, and the room it stands in after the turns (module docstring)."""
    here = k.start
    i = _past_travel(k, 0, here)
    places = [i]
    for t in turns:
        if taken(t) and i < len(k.gold) and same(t["action"], k.gold[i]):
            i += 1
        if m := _MOVED.match(str(t["observation"])):
            here = m.group(1)
        i = _past_travel(k, i, here)
        places.append(i)
    return places, here


def gold_room(k: Known, i: int) -> str | None:
    """The room the gold path is in before its action number i."""
    for a in reversed(k.gold[:i]):
        if m := _MOVE.fullmatch(a):
            return m.group(1)
    return k.start


@dataclass(frozen=True)
class Proposal:
    action: str
    thought: str
    rationale: str

    def counterfactual(self) -> Counterfactual:
        return Counterfactual(render_action(self.thought, self.action), self.action, self.thought, self.rationale)


def propose(k: Known, prefix: Sequence[Mapping], original: str | None = None) -> Proposal | None:
    """The proposer's rule (module docstring) at the state after `prefix`, or None."""
    places, here = walk(k, prefix)
    i = places[-1]
    if i >= len(k.gold):
        return None
    gold, there = k.gold[i], gold_room(k, i)
    if k.teleport and here is not None and there is not None and here.lower() != there.lower():
        move = _MOVE.fullmatch(gold)
        action = f"teleport to {move.group(1) if move else there}"
        why = (f"The agent is in the {here} but the gold path of {k.task_id} is in the {there} at its action {i + 1} of "
               f"{len(k.gold)} ('{gold}'): {'a teleport makes that move' if move else 'it must go back there first'}.")
    else:
        action = gold
        why = f"The gold path of {k.task_id} has {len(k.gold)} actions; the agent had got through {i} of them, and the next is '{gold}'."
    if original is not None and same(original, action):
        return None
    return Proposal(action, thought(action), why)


def critique(k: Known, turns: Sequence[Mapping], top: int) -> list[tuple[int, Proposal]]:
    """HR's controller: the `top` turns to improve, each with the proposer's replacement."""
    places = []
    for j, t in enumerate(turns):
        p = propose(k, turns[:j], t["action"])
        if p is not None:
            places.append((float(t.get("reward", 0.0)), j, p))
    places.sort(key=lambda x: (x[0] >= 0, x[1]))  # lost score first, then in order
    return [(j, p) for _, j, p in places[:top]]


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def summarize(k: Known, turns: Sequence[Mapping], success: bool, step_limit: int) -> str:
    """The summarizer's paragraph (module docstring)."""
    out = [f"Task {k.task_id}: {k.description}"]
    places, _ = walk(k, turns)
    i = places[-1]
    path = f"The gold path takes {len(k.gold)} actions; the agent got through {i} of them"
    off = next((j for j in range(len(turns)) if places[j + 1] == places[j] < len(k.gold)), None)
    if off is not None:
        t = turns[off]
        said = "a turn off the Thought/Action format" if str(t["observation"]).startswith(INVALID) else f"'{t['action']}'"
        path += f", and first left it at step {off + 1} with {said} where the gold path does '{k.gold[places[off]]}'"
    out.append(path + ".")

    points, changes = 0, []
    for j, t in enumerate(turns):
        after = points + round(100 * float(t.get("reward", 0.0)))
        if after != points:
            changes.append(f"{'rose' if after > points else 'fell'} to {after} at step {j + 1} ({t['action']})")
        points = after
    out.append(f"Its score {'; '.join(changes)}." if changes else "Its score never rose above 0.")

    invalid = sum(str(t["observation"]).startswith(INVALID) for t in turns)
    unknown = sum(str(t["observation"]).startswith(NOT_UNDERSTOOD) for t in turns)
    seen: dict[str, int] = {}
    for t in turns:
        if taken(t):
            key = " ".join(t["action"].lower().split())
            seen[key] = seen.get(key, 0) + 1
    repeats = sorted(((n, a) for a, n in seen.items() if n > 1), reverse=True)
    wrong = []
    if invalid:
        wrong.append(f"{invalid} of its turns did not follow the Thought/Action format")
    if unknown:
        wrong.append(f"the simulator did not understand {unknown} of its actions")
    if repeats:
        wrong.append("it repeated " + ", ".join(f"'{a}' {n} times" for n, a in repeats))
    if wrong:
        said = "; ".join(wrong)
        out.append(said[0].upper() + said[1:] + ".")

    n = len(turns)
    if success:
        out.append(f"It completed the task at score 100 in {_steps(n)}.")
    elif n < step_limit and turns:
        last = turns[-1]
        how = "focused on the wrong thing, which ended the task" if last["action"].lower().startswith("focus on") else "ended the task without completing it"
        fell = f": the score fell to {points}" if float(last.get("reward", 0.0)) < 0 else f" at score {points}"
        out.append(f"Its last action, '{last['action']}' at step {n}, {how}{fell}.")
    else:
        nxt = f"; the gold path's next action was '{k.gold[i]}'" if i < len(k.gold) else ""
        out.append(f"It ran out of its {_steps(step_limit)} at score {points} of 100{nxt}.")
    return " ".join(out)
