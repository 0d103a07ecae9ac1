"""The oracle roles. They see the donor's profile; what they write into an action never uses it.

- proposer (HOPE's pi_H): every line of the persuaders' library (policies.LINES) is played from
  the prefix against the oracle donor and the expert persuader finishes the conversation;
  hindsight ranks them by the donation, then by fewer turns, then by library order. The line and
  its reason are what a persuader could say knowing only the dialogue; the rationale names the
  persona and the amounts, which only hindsight knows.
- controller (HR): the turns whose best line gains most over what was said, valued the same way.
- summarizer: one paragraph from the donor's profile and the oracle's reading of each message
  (the strategies recognised and how each moved the donor).
- labeler (HR's two steps on the logged words): finished or not (the last donor turn states a
  decision, as the game's decision line or, in logs without one, in the donor's own words), then
  the amount. An amount the dialogue only mentions (an ask, a refused sum) is never read as given.
"""
from __future__ import annotations

import copy
import random
import re
from collections.abc import Mapping, Sequence

from envs.base import Counterfactual, Label

from .donor import EFFECTS, money, read_observation, respond, seeded, start
from .donors import Donor
from .format import render_action
from .game import Conversation
from .policies import LINES, REASONS, Expert, PersuaderView

VERSIONS = {"summarizer": "persuasion-summary-v1", "proposer": "persuasion-proposer-v1", "controller": "persuasion-proposer-v1", "labeler": "persuasion-labeler-v1"}
INVALID = "Invalid action ("


def history(turns: Sequence[Mapping]) -> list[tuple[str | None, str]]:
    """(message, or None where the action did not parse; the donor's observation) per turn."""
    return [(None if t["observation"].startswith(INVALID) else t["action"], t["observation"]) for t in turns]


def conversation(donor: Donor, max_turns: int, turns: Sequence[Mapping]) -> Conversation:
    c = Conversation(donor, max_turns)
    c.restore(history(turns))
    return c


def view(c: Conversation) -> PersuaderView:
    return PersuaderView(list(c.history), c.turn, c.max_turns)


# ---- hindsight: value a line by playing it out ----

def play_out(c: Conversation, message: str | None) -> tuple[float, int]:
    """(donation, turns it took from here): `message` played, then the expert to the end."""
    game = copy.deepcopy(c)
    start_turn, expert = game.turn, Expert()
    game.step(message)
    while not game.done:
        game.step(expert.act(view(game), random.Random(0))[1])
    return game.donation or 0.0, game.turn - start_turn


def candidates() -> list[tuple[str, str]]:
    """(kind, line) of every library line a persuader could say, in a fixed order."""
    return [(kind, line) for kind, lines in LINES.items() if kind != "filler" for line in lines]


def ranked(c: Conversation) -> list[tuple[tuple[float, int, int], str, str]]:
    out = []
    for order, (kind, line) in enumerate(candidates()):
        donation, turns = play_out(c, line)
        out.append(((donation, -turns, -order), kind, line))
    out.sort(key=lambda r: r[0], reverse=True)
    return out


def rationale(c: Conversation, donation: float, turns: int) -> str:
    d = c.donor
    facts = [f"it gives at most {money(d.cap)}", "it has children" if d.has_children else "it has no children"]
    if d.concern:
        facts.append(f"it doubts the charity ({d.concern})")
    return (f"The donor is {d.persona} ({', '.join(facts)}); its willingness is now {c.state.willingness:.2f}. "
            f"From this line the expert persuader ends with a donation of {money(donation)} in {turns} turns.")


def _counterfactual(c: Conversation, value: tuple, kind: str, line: str) -> Counterfactual:
    reason = REASONS.get(kind, REASONS["ask"])
    return Counterfactual(render_action(reason, line), line, reason, rationale(c, value[0], -value[1]))


def propose(c: Conversation, n: int) -> list[Counterfactual]:
    out, seen = [], set()
    for value, kind, line in ranked(c):
        if line in seen:
            continue
        seen.add(line)
        out.append(_counterfactual(c, value, kind, line))
        if len(out) == n:
            break
    return out


def critique(donor: Donor, max_turns: int, turns: Sequence[Mapping], top: int) -> list[tuple[int, Counterfactual]]:
    places = []
    for k, (message, _) in enumerate(history(turns)):
        c = conversation(donor, max_turns, turns[:k])
        value, kind, line = ranked(c)[0]
        if message is not None and " ".join(message.lower().split()) == line.lower():
            continue
        mine = play_out(c, message)
        gain = value[0] - mine[0]
        if gain > 0:
            places.append((gain, k, _counterfactual(c, value, kind, line)))
    places.sort(key=lambda p: (-p[0], p[1]))
    return [(k, cf) for _, k, cf in places[:top]]


# ---- summarizer ----

def summarize(donor: Donor, max_turns: int, turns: Sequence[Mapping]) -> str:
    state, notes, helped, hurt = start(donor), [], [], []
    for i, (message, _) in enumerate(history(turns)):
        if message is None:
            notes.append(f"turn {i + 1}: an invalid action")
            state.turns += 1
            continue
        _, changes = respond(donor, state, message, seeded("donor", donor.seed, i, message))
        tags = [c for c, _ in changes]
        notes.append(f"turn {i + 1}: {', '.join(tags) or 'nothing persuasive'}")
        helped += [(d, i + 1, c) for c, d in changes if d > 0]
        hurt += [(d, i + 1, c) for c, d in changes if d < 0]
    decision = read_observation(turns[-1]["observation"]).donation if turns else None
    outcome = "the conversation is unfinished" if decision is None else (f"the donor gave {money(decision)}" if decision > 0 else "the donor gave nothing")
    best = max(helped, default=None)
    worst = min(hurt, default=None)
    responds = sorted(EFFECTS, key=lambda s: -EFFECTS[s][donor.persona])[:2]
    lines = [
        f"The donor was {donor.persona}: it would give at most {money(donor.cap)}, started at willingness {donor.willingness:.2f}, "
        f"{'has' if donor.has_children else 'has no'} children" + (f" and doubted the charity ({donor.concern})" if donor.concern else "") + ".",
        f"Over {len(turns)} turns the persuader used: {'; '.join(notes) or 'nothing'}.",
        f"Outcome: {outcome} (willingness at the end {state.willingness:.2f}; asked {state.asked} times, refused {state.refusals}).",
        (f"What helped most: {best[2]} at turn {best[1]}. " if best else "Nothing helped. ")
        + (f"What hurt most: {worst[2]} at turn {worst[1]}. " if worst else "")
        + f"This persona responds best to {responds[0]} and {responds[1].replace('_', ' ')}"
        + (", and pressure backfires with it." if EFFECTS["pressure"][donor.persona] <= -0.25 else "."),
    ]
    return " ".join(lines)


# ---- labeler ----

_COMMIT = re.compile(
    r"\b(?:i'll|i will|i can|i'd like to|i would like to|i'm going to|i am going to|let me|put me down for|count me in for|"
    r"i'll make it|make it|i pledge|i'm happy to|i am happy to)\b(?P<between>[^.?!$]{0,40}?)\$\s?(?P<amount>\d+(?:\.\d{1,2})?)", re.I)
_REFUSE = re.compile(r"\b(?:won'?t|will not|not going to|don'?t want to|rather not|decided not to|can'?t) (?:donate|give)\b|\bno donation\b", re.I)
_NEGATED = re.compile(r"\b(not|never|no)\b|'t\b", re.I)


def decision_in_words(text: str) -> float | None:
    """The decision a donor's words state, or None. A commitment ("I'll donate $1.50") counts only
    with the amount it commits to, never an amount the sentence merely mentions ("$2 is too much,
    but I'll donate $1" is $1); a negated or questioning sentence commits to nothing; a refusal
    ("I won't donate") is $0. The last decision in the text wins."""
    found = None
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        if sentence.rstrip().endswith("?"):
            continue
        commits = [m for m in _COMMIT.finditer(sentence) if not _NEGATED.search(m.group("between"))]
        if commits:
            found = float(commits[-1].group("amount"))
        elif _REFUSE.search(sentence):
            found = 0.0
    return found


def read_decision(observation: str) -> float | None:
    """Step 1 and 2 of the oracle labeler on one donor turn: the decision line if there is one,
    else the decision its words state, else None (no decision there)."""
    reply = read_observation(observation)
    return reply.donation if reply.donation is not None else decision_in_words(reply.text)


def label(donor: Donor, max_turns: int, turns: Sequence[Mapping]) -> Label:
    if not turns:
        return Label(None, None, "unfinished: no turns")
    if len(turns) > max_turns:
        return Label(None, None, f"{len(turns)} turns, over the game's {max_turns}")
    for i, t in enumerate(turns[:-1]):
        if read_observation(t["observation"]).donation is not None:
            return Label(None, None, f"the donor decided at turn {i} but the trajectory has {len(turns)} turns")
    amount = read_decision(turns[-1]["observation"])
    if amount is None:
        return Label(None, None, "unfinished: the donor never committed to an amount or declined")
    if not 0.0 <= amount <= 2.0:
        return Label(None, None, f"the donor states {money(amount)}, outside [$0, $2]")
    return Label(amount, amount > 0, f"the donor gave {money(amount)}" if amount > 0 else "the donor gave nothing")
