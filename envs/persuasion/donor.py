"""The oracle donor: a willingness in [0, 1] that the persuader's strategies move, and a stated
decision.

Rules (strategies.py recognises the strategies in the words):
- Each strategy a message uses changes the willingness by EFFECTS[strategy][persona], scaled by
  seeded noise in [0.7, 1.3] and halved for every earlier use of the same strategy, so repeating
  one argument wears out. A story or an emotional appeal moves a donor with children more
  (CHILDREN_BONUS, first use); a skeptical donor's concern, once answered (strategies.
  answers_concern), adds CONCERN_BONUS once. A long message (over 60 words) costs an unfriendly
  donor LONG_PENALTY. Pressure backfires, most on unfriendly and skeptical donors, and so does
  asking again right after a refusal (half the pressure effect).
- Past its patience, each further turn costs FATIGUE: the talk has gone on too long.
- What the donor would give now is its cap x willingness, floored to a quarter dollar (`offer`).
- An ask (strategies "ask") is answered at once, after the message's effects (a concrete small
  ask, at most $1, is itself persuasive: EFFECTS["small_ask"]):
  - nothing to give (offer 0): a refusal; after `max_refusals` refusals the donor leaves, $0;
  - no amount named, or an amount up to the offer: the donor commits to its offer;
  - an amount above the offer by at most $0.50: it counters with its offer and commits;
  - more than that: "too much", no commitment, and half a pressure effect.
- When the turns run out the donor must decide (HR's simulated users): its offer if it was
  asked at least once, half its offer if it never was.
Commitment and leaving end the game; the donation is the reward, at the end.

Randomness (the noise, the wording) is seeded by the donor, the turn and the message, so the same
dialogue replays to the same donor.
"""
from __future__ import annotations

import hashlib
import math
import random
import re
from collections import Counter
from dataclasses import dataclass, field

from .donors import Donor
from .strategies import Reading, answers_concern, recognise

P, C, U, S = "philanthropic", "caring", "unfriendly", "skeptical"
EFFECTS = {
    "greeting": {P: 0.03, C: 0.05, U: 0.00, S: 0.00},
    "inquiry": {P: 0.03, C: 0.05, U: -0.02, S: 0.02},
    "credibility": {P: 0.08, C: 0.04, U: 0.05, S: 0.12},
    "logic": {P: 0.08, C: 0.04, U: 0.08, S: 0.10},
    "emotion": {P: 0.08, C: 0.15, U: -0.05, S: -0.04},
    "story": {P: 0.06, C: 0.12, U: -0.03, S: 0.02},
    "small_ask": {P: 0.05, C: 0.05, U: 0.15, S: 0.06},
    "pressure": {P: -0.05, C: -0.10, U: -0.30, S: -0.25},
}
CHILDREN_BONUS = 0.05
CONCERN_BONUS = 0.12
LONG_PENALTY = {U: -0.05}
FATIGUE = 0.04
NOISE = (0.7, 1.3)
OVER_ASK = 0.5  # how far above its offer an ask may go and still get a counter-offer
ORDER = ("greeting", "inquiry", "credibility", "logic", "emotion", "story", "small_ask", "pressure")


def seeded(*parts: object) -> random.Random:
    return random.Random(int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "big"))


def quarter(x: float) -> float:
    return max(0.0, min(2.0, math.floor(x * 4 + 1e-9) / 4))


def money(x: float) -> str:
    return f"${x:.2f}"


@dataclass(frozen=True)
class DonorReply:
    """The donor's turn: its words and, when it decided, the donation (0.0: it gives nothing)."""

    text: str
    donation: float | None = None
    reason: str = ""  # an LLM donor's reasoning; never shown to the persuader

    def decision_line(self) -> str:
        if self.donation is None:
            return ""
        return f"Decision: donate {money(self.donation)}" if self.donation > 0 else "Decision: no donation"

    def observation(self) -> str:
        return "\n".join(x for x in (self.text, self.decision_line()) if x)


_DECISION = re.compile(r"^\s*Decision:\s*(?:donate\s+\$?(\d+(?:\.\d+)?)|(no donation))\s*$", re.I)


def read_decision_line(line: str) -> float | None:
    m = _DECISION.match(line)
    if m is None:
        return None
    return 0.0 if m.group(2) else float(m.group(1))


def read_observation(text: str) -> DonorReply:
    """A logged donor turn back as a reply: its words and, if it decided there, the donation."""
    lines = text.rstrip().split("\n")
    amount = read_decision_line(lines[-1]) if lines else None
    if amount is None:
        return DonorReply(text)
    return DonorReply("\n".join(lines[:-1]), amount)


# ---- wording: each persona's voice, and cues a persuader can read ----

OPENING = {
    P: ["Hi! I always like hearing about good causes.", "Hello! I give to charity when I can, so go ahead."],
    C: ["Hello. Anything to do with kids gets my attention.", "Hi. I care a lot about children, so I'm listening."],
    U: ["I'm busy. Make it quick.", "What do you want? Get to the point."],
    S: ["Hi. I'll be honest, I'm wary of charities.", "Hello. I'm skeptical of these donation requests."],
}
CONCERN = {
    "overhead": "How much of the money actually reaches the children?",
    "scam": "How do I know this isn't a scam?",
    "impact": "Can a couple of dollars really make any difference?",
}
WARMTH = [  # by willingness below 0.2, 0.45, 0.7, and above
    ["I'm not convinced.", "I don't really see why I should.", "Not interested so far."],
    ["I'm listening.", "Go on.", "Okay, maybe."],
    ["That sounds worthwhile.", "That's good to hear.", "I like what you're saying."],
    ["I really want to help.", "That really moves me.", "You've convinced me this matters."],
]
REACT = {
    "pressure": {P: "Please don't push me.", C: "I don't like being pressured.", U: "Don't tell me what to do.", S: "Pushing me makes me trust this less."},
    "long": "That's a lot of talk.",
    "emotion_cold": {U: "Spare me the sob story.", S: "Sad stories don't tell me where the money goes."},
}


def warmth(w: float) -> int:
    return 0 if w < 0.2 else 1 if w < 0.45 else 2 if w < 0.7 else 3


@dataclass
class DonorState:
    """What the donor has made of the talk so far (the hidden state the oracle roles read)."""

    willingness: float
    uses: Counter = field(default_factory=Counter)
    asked: int = 0
    refusals: int = 0
    last_refused: bool = False
    concern_voiced: bool = False
    concern_answered: bool = False
    turns: int = 0

    def copy(self) -> DonorState:
        return DonorState(self.willingness, Counter(self.uses), self.asked, self.refusals, self.last_refused,
                          self.concern_voiced, self.concern_answered, self.turns)


def start(donor: Donor) -> DonorState:
    return DonorState(donor.willingness)


def offer(donor: Donor, state: DonorState) -> float:
    """What the donor would give now."""
    return quarter(donor.cap * min(1.0, max(0.0, state.willingness)))


def final_amount(donor: Donor, state: DonorState) -> float:
    """The decision the donor must make when the turns run out."""
    g = offer(donor, state)
    return g if state.asked else quarter(g / 2)


def effects(donor: Donor, state: DonorState, reading: Reading, text: str, rng: random.Random) -> list[tuple[str, float]]:
    """(cause, change of willingness) of one message, in a fixed order."""
    used = set(reading.strategies) - {"ask"}
    if reading.small_ask:
        used.add("small_ask")
    out = []
    for s in ORDER:
        if s not in used:
            continue
        base = EFFECTS[s][donor.persona]
        if s in ("story", "emotion") and donor.has_children and not state.uses[s]:
            base += CHILDREN_BONUS
        out.append((s, base * rng.uniform(*NOISE) * 0.5 ** state.uses[s]))
    if "ask" in reading.strategies and state.last_refused and "pressure" not in used:
        out.append(("asked again after a refusal", EFFECTS["pressure"][donor.persona] / 2 * rng.uniform(*NOISE)))
    if donor.concern and not state.concern_answered and answers_concern(text, donor.concern):
        out.append((f"answered the concern ({donor.concern})", CONCERN_BONUS * rng.uniform(*NOISE)))
    if reading.long and donor.persona in LONG_PENALTY:
        out.append(("long message", LONG_PENALTY[donor.persona]))
    if state.turns >= donor.patience:
        out.append(("past its patience", -FATIGUE))
    return out


def refuse(donor: Donor, state: DonorState, said: list[str]) -> float | None:
    """A refusal, counted: past the donor's limit it leaves with nothing ($0), else None."""
    state.refusals += 1
    state.last_refused = True
    if state.refusals >= donor.max_refusals:
        said.append("I'm done with this conversation. I won't donate anything.")
        return 0.0
    return None


def respond(donor: Donor, state: DonorState, text: str, rng: random.Random) -> tuple[DonorReply, list[tuple[str, float]]]:
    """The donor's reply to one message; `state` is updated. Also returns the effects applied."""
    reading = recognise(text)
    changes = effects(donor, state, reading, text, rng)
    state.willingness = min(1.0, max(0.0, state.willingness + sum(d for _, d in changes)))
    for s in reading.strategies:
        state.uses[s] += 1
    if reading.small_ask:
        state.uses["small_ask"] += 1
    if any(c.startswith("answered the concern") for c, _ in changes):
        state.concern_answered = True
    first = state.turns == 0
    state.turns += 1

    said: list[str] = []
    if first:
        said.append(rng.choice(OPENING[donor.persona]))
    if "inquiry" in reading.strategies:
        if re.search(r"\bheard\b|\bfamiliar\b|\bknow\b", text, re.I):
            said.append("Yes, I've heard of Save the Children." if donor.knows_charity else "No, I haven't heard of it.")
        about_them = re.sub(r"save the children", "", text, flags=re.I)
        if re.search(r"\b(kids|children|family)\b", about_them, re.I) and "?" in about_them:
            said.append("I have kids of my own." if donor.has_children else "I don't have kids myself.")
    if "pressure" in reading.strategies:
        said.append(REACT["pressure"][donor.persona])
    elif "emotion" in reading.strategies and donor.persona in REACT["emotion_cold"]:
        said.append(REACT["emotion_cold"][donor.persona])
    if reading.long and donor.persona in LONG_PENALTY:
        said.append(REACT["long"])
    if donor.concern and not state.concern_answered and (first or "ask" in reading.strategies):
        said.append(CONCERN[donor.concern])
        state.concern_voiced = True

    donation: float | None = None
    if "ask" in reading.strategies:
        state.asked += 1
        g = offer(donor, state)
        a = reading.amount
        if g <= 0:
            donation = refuse(donor, state, said)
            if donation is None:
                said.append(rng.choice(["No, I don't want to donate.", "No thanks, not right now.", "I'd rather keep my money."]))
        elif a is None or a <= g:
            said.append(f"Sure, and I'll make it {money(g)}." if a is not None and g > a else f"Okay, I'll donate {money(g)}.")
            donation = g
        elif a - g <= OVER_ASK:
            said.append(f"{money(a)} is more than I'd like to give, but I'll donate {money(g)}.")
            donation = g
        else:
            said.append(f"{money(a)}? That's way too much.")
            state.willingness = max(0.0, state.willingness + EFFECTS["pressure"][donor.persona] / 2)
            donation = refuse(donor, state, said)
    else:
        state.last_refused = False
    if donation is None:
        said.append(rng.choice(WARMTH[warmth(state.willingness)]))
    return DonorReply(" ".join(said), donation), changes


def decide_at_end(donor: Donor, state: DonorState) -> DonorReply:
    """The decision the donor states when the turns run out."""
    x = final_amount(donor, state)
    return DonorReply(f"I've thought about it: I'll donate {money(x)}." if x > 0 else "I've thought about it, and I won't donate.", x)
