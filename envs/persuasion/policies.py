"""Scripted persuaders for bootstrap demonstrations. They see what the persuader sees (the donor's
replies), never the donor's profile: whatever they know of the persona they read from its words.

- expert: opens by asking whether the donor knows the charity, reads the persona from the reply
  (CUES) and plays the arguments that persona responds to (PLANS), answering a skeptic's stated
  concern first, then makes a concrete small ask; after a refusal, one new argument and a
  smaller ask; it never pressures.
- noisy: the expert, except that before the last turn it says a random line with p_random,
  repeats an earlier message with p_repeat, or asks early and hard with p_early_guess (the
  bootstrap's shared noise knobs, read for this game).
- pushy: one plan for everyone, emotion and a story, then the full $2, then pressure: what HR
  saw supervised agents do; it works on receptive donors and backfires on the rest.
- random: a random line of the library every turn.
The lines come from one library (LINES), which the oracle proposer also chooses from.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from envs.base import check_noise

LINES: dict[str, list[str]] = {
    "open": ["Hello! Have you heard of Save the Children?", "Hi, how are you today? Are you familiar with Save the Children?"],
    "credibility": [
        "Save the Children was founded in 1919 and is a registered charity with a long track record.",
        "About 87% of every dollar donated goes directly to programs for children, and its financial reports are audited every year.",
        "Charity Navigator rates Save the Children four stars for accountability and transparency.",
    ],
    "logic": [
        "Just $1 provides a nutritious meal for a child in need.",
        "Last year donors helped over a million children get food and medicine.",
        "$2 can buy school supplies for a child for a month.",
    ],
    "emotion": [
        "Imagine a child going to bed hungry, with no one to turn to.",
        "Many children in war zones are scared and alone, and they need help to survive.",
    ],
    "story": [
        "I met a girl named Amina who can now go to school thanks to donors like you.",
        "One story stays with me: a boy named Samuel got treatment for malaria just in time.",
    ],
    "ask": ["Would you consider donating $1 of your payment today?", "How about starting with $1?", "Could you give just $0.50 to help?"],
    "ask_open": ["How much would you like to donate today?", "Would you like to help the children with a donation?"],
    "ask_big": ["Would you donate the full $2 today?"],
    "pressure": ["You should really donate right now; it's only $2.", "Come on, surely you can spare $2. What's stopping you?"],
    "filler": ["Save the Children works in many countries.", "Thanks for chatting with me.", "The weather is nice today, isn't it?"],
}
# Which line answers a skeptic's concern (its words, as CUES read them).
CONCERN_LINE = {"overhead": LINES["credibility"][1], "scam": LINES["credibility"][0], "impact": LINES["logic"][0]}
PLANS = {
    "philanthropic": ["credibility", "logic", "emotion"],
    "caring": ["story", "emotion", "logic"],
    "skeptical": ["concern", "credibility", "logic"],
    "unfriendly": ["logic"],
    None: ["credibility", "logic", "emotion"],
}
REASONS = {
    "open": "Start friendly and find out what the person knows.",
    "credibility": "Show the charity can be trusted.",
    "logic": "Show what a small sum achieves.",
    "emotion": "Help them feel what is at stake.",
    "story": "Tell a real story about a child.",
    "concern": "They doubt charities: answer their concern first.",
    "ask": "They are ready: ask for a small, concrete amount.",
    "ask_smaller": "They said no: ask for less.",
    "ask_big": "Ask for the whole payment.",
    "pressure": "Push them to decide.",
    "filler": "Keep the conversation going.",
}
CUES = [  # (persona, pattern over the donor's words); the first that matches wins
    ("unfriendly", r"\b(busy|make it quick|get to the point|tell me what to do|sob story|a lot of talk|what do you want)\b"),
    ("skeptical", r"\b(wary|skeptical|scam|reaches the children|any difference|trust this less|where the money goes)\b"),
    ("caring", r"\b(care a lot about children|kids gets my attention|to do with kids)\b"),
    ("philanthropic", r"\b(good causes|give to charity)\b"),
]
CONCERNS = [("overhead", r"reaches the children|where the money goes"), ("scam", r"\bscam\b"), ("impact", r"any difference")]
REFUSAL = re.compile(r"\b(no thanks|don't want to donate|rather keep my money|too much)\b", re.I)
WARM = re.compile(r"\b(really want to help|really moves me|convinced me)\b", re.I)


@dataclass(frozen=True)
class PersuaderView:
    """What a persuader sees before its message number `turn` (0-based)."""

    history: list[tuple[str | None, str]]  # (its message, or None when it did not parse; the donor's reply)
    turn: int
    max_turns: int

    @property
    def replies(self) -> str:
        return " ".join(obs for _, obs in self.history)


def persona_cue(view: PersuaderView) -> str | None:
    return next((p for p, pattern in CUES if re.search(pattern, view.replies, re.I)), None)


def concern_cue(view: PersuaderView) -> str | None:
    return next((c for c, pattern in CONCERNS if re.search(pattern, view.replies, re.I)), None)


def _said(view: PersuaderView) -> set[str]:
    return {m for m, _ in view.history if m}


def _pick(kind: str, view: PersuaderView, rng: random.Random) -> str:
    """A line of `kind` not said yet (any, once all were)."""
    fresh = [line for line in LINES[kind] if line not in _said(view)]
    return rng.choice(fresh or LINES[kind])


class Expert:
    name = "expert"

    def act(self, view: PersuaderView, rng: random.Random) -> tuple[str, str]:
        if view.turn == 0:
            return REASONS["open"], _pick("open", view, rng)
        persona = persona_cue(view)
        asks = [m for m, _ in view.history if m and m in LINES["ask"]]
        refused = bool(REFUSAL.search(view.history[-1][1])) if view.history else False
        last = view.turn == view.max_turns - 1
        if refused and not last:
            return self._argue(view, persona, rng, after_refusal=True)
        plan_left = self._plan_left(view, persona)
        warm = bool(WARM.search(view.history[-1][1]))
        if last or not plan_left or warm or view.turn >= view.max_turns - 2:
            if asks:
                return REASONS["ask_smaller"], "Could you give just $0.50 to help?"
            small = "Could you give just $0.50 to help?" if persona == "unfriendly" else "Would you consider donating $1 of your payment today?"
            return REASONS["ask"], small
        return self._argue(view, persona, rng)

    def _plan_left(self, view: PersuaderView, persona: str | None) -> list[str]:
        said = _said(view)
        left = []
        for kind in PLANS[persona]:
            if kind == "concern":
                line = CONCERN_LINE.get(concern_cue(view) or "")
                if line and line not in said:
                    left.append(kind)
            elif not any(line in said for line in LINES[kind]):
                left.append(kind)
        return left

    def _argue(self, view: PersuaderView, persona: str | None, rng: random.Random, after_refusal: bool = False) -> tuple[str, str]:
        left = self._plan_left(view, persona)
        if left:
            kind = left[0]
            if kind == "concern":
                return REASONS["concern"], CONCERN_LINE[concern_cue(view)]
            return REASONS[kind], _pick(kind, view, rng)
        # Plan spent (after a refusal): an argument it responds to that was not made yet.
        for kind in ("credibility", "logic") if persona in ("skeptical", "unfriendly") else ("story", "credibility", "logic"):
            fresh = [line for line in LINES[kind] if line not in _said(view)]
            if fresh:
                return REASONS[kind], rng.choice(fresh)
        return REASONS["ask_smaller"], "Could you give just $0.50 to help?"


class Noisy:
    name = "noisy"

    def __init__(self, p_random: float, p_repeat: float, p_early_guess: float):
        check_noise(p_random, p_repeat, p_early_guess)
        self.p_random, self.p_repeat, self.p_early = p_random, p_repeat, p_early_guess
        self.expert = Expert()

    def act(self, view: PersuaderView, rng: random.Random) -> tuple[str, str]:
        u = rng.random()
        if view.turn < view.max_turns - 1:
            if u < self.p_early:
                return REASONS["pressure"], _pick(rng.choice(["pressure", "ask_big"]), view, rng)
            u -= self.p_early
            if u < self.p_random:
                kind = rng.choice(sorted(LINES))
                return REASONS.get(kind, REASONS["filler"]), rng.choice(LINES[kind])
            u -= self.p_random
            said = [m for m, _ in view.history if m]
            if u < self.p_repeat and said:
                return "Say it again.", rng.choice(said)
        return self.expert.act(view, rng)


class Pushy:
    name = "pushy"
    PLAN = ("emotion", "story", "ask_big", "pressure", "ask_big")

    def act(self, view: PersuaderView, rng: random.Random) -> tuple[str, str]:
        kind = self.PLAN[min(view.turn, len(self.PLAN) - 1)] if view.turn < view.max_turns - 1 else "ask_big"
        return REASONS[kind], _pick(kind, view, rng)


class Random:
    name = "random"

    def act(self, view: PersuaderView, rng: random.Random) -> tuple[str, str]:
        kind = rng.choice(sorted(LINES))
        return REASONS.get(kind, REASONS["filler"]), rng.choice(LINES[kind])
