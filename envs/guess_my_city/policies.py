"""Scripted behaviour policies that produce GuessMyCity demonstrations.

They know the world (every listed city's facts, as the oracle answers them), never the secret:
whatever they know about it they infer from the answers so far. They ask the oracle's questions
(oracle.QUESTIONS) general to specific, and write short reasons ("Ask about the climate."; before
a guess, what the answers established: "in East Asia, speaks Korean, coastal: only Busan
fits."), so the policies differ only in the choices they make. As in TwentyQuestions, the list
before a guess is what the name is learnt from, and the fact sheets (facts.py) end in the same
form, which is what lets a model name a city it never played.
"""
from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass

from envs.base import check_noise
from envs.reason_question import Action

from .cities import City
from .oracle import QUESTIONS, Oracle, Question, topic


@dataclass(frozen=True)
class PlayerView:
    """What a player sees before acting."""

    candidates: list[City]  # every listed city: HOPE lists them all, test cities included
    history: list[tuple[str, str]]  # (question, answer text)
    turn: int  # 0-based index of the question about to be asked
    max_turns: int

    @property
    def is_final_turn(self) -> bool:
        return self.turn == self.max_turns - 1


def established(oracle: Oracle, history: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(topic, answer) of the answers that settled something, in the order asked, each once. An
    answer settles something when the oracle gives it about some city; "unknown", the refusal to
    name the city, or an LLM simulator's own words settle nothing. A guess ends the game, so no
    later turn builds on one."""
    out: list[tuple[str, str]] = []
    for question, answer in history:
        t = topic(question)
        if (t, answer) in oracle.labels and (t, answer) not in out:
            out.append((t, answer))
    return out


def consistent(oracle: Oracle, view: PlayerView) -> list[City]:
    """The candidates every answer so far agrees with, in the candidate list's order."""
    left = view.candidates
    for t, answer in established(oracle, view.history):
        left = [c for c in left if oracle.says(c, t) == answer]
    if not left:
        raise ValueError("no candidate agrees with the answers so far (is the secret in the candidate list?)")
    return left


def known(oracle: Oracle, history: list[tuple[str, str]]) -> str:
    """What the answers established, as short labels in the order asked ("in East Asia, speaks
    Korean, coastal"): the list a guess's reason gives before the name it leads to."""
    return ", ".join(oracle.labels[fact] for fact in established(oracle, history))


def only_fits(oracle: Oracle, history: list[tuple[str, str]], name: str) -> str:
    facts = known(oracle, history)
    return f"{facts}: only {name} fits." if facts else f"Only {name} fits."


def asked(history: list[tuple[str, str]]) -> set[str]:
    """The topics the questions so far asked about."""
    return {t for t in (topic(q) for q, _ in history) if t is not None}


def gain(oracle: Oracle, left: list[City], q: Question) -> float:
    """Information gain of asking `q` about one of `left`: the entropy of how its answers split them."""
    counts = Counter(oracle.says(c, q.topic) for c in left).values()
    return -sum(k / len(left) * math.log2(k / len(left)) for k in counts)


def best_questions(oracle: Oracle, left: list[City], history: list[tuple[str, str]]) -> list[Question]:
    """The unasked questions of the most general level that still splits `left`, most informative
    first (ties in QUESTIONS' order); empty when no unasked question splits them."""
    done = asked(history)
    for level in sorted({q.level for q in QUESTIONS}):
        scored = [(gain(oracle, left, q), q) for q in QUESTIONS if q.level == level and q.topic not in done]
        splitting = [(g, q) for g, q in scored if g > 0]
        if splitting:
            return [q for _, q in sorted(splitting, key=lambda gq: -gq[0])]
    return []


def ask(q: Question) -> Action:
    return Action(f"Ask about the {q.about}.", q.text)


def guess(name: str, why: str) -> Action:
    return Action(why, f"Is the city {name}?")


class ExpertPolicy:
    """Tracks the consistent cities and asks, among the most general questions that still split
    them, the most informative one; guesses when one city is left, when no question splits the
    rest, or on the final turn. One fixed decision tree: ties go to the first question."""

    name = "expert"

    def __init__(self, oracle: Oracle):
        self.oracle = oracle

    def act(self, view: PlayerView, rng: random.Random) -> Action:
        left = consistent(self.oracle, view)
        if len(left) == 1:
            return guess(left[0].name, only_fits(self.oracle, view.history, left[0].name))
        best = best_questions(self.oracle, left, view.history)
        if view.is_final_turn or not best:
            name = rng.choice(left).name
            return guess(name, f"Last turn, guess {name}." if view.is_final_turn else f"Guess {name}.")
        return ask(best[0])


class NoisyPolicy:
    """The expert, except that before the final turn it asks a random question with probability
    p_random, repeats an earlier one with p_repeat, or guesses a random consistent city early
    with p_early_guess (which, with one guess allowed, usually loses the game)."""

    name = "noisy"

    def __init__(self, p_random: float, p_repeat: float, p_early_guess: float, oracle: Oracle):
        check_noise(p_random, p_repeat, p_early_guess)
        self.p_random, self.p_repeat, self.p_early_guess = p_random, p_repeat, p_early_guess
        self.expert = ExpertPolicy(oracle)
        self.oracle = oracle

    def act(self, view: PlayerView, rng: random.Random) -> Action:
        if view.is_final_turn:
            return self.expert.act(view, rng)
        u = rng.random()
        if u < self.p_random:
            return ask(rng.choice(QUESTIONS))
        u -= self.p_random
        done = [q for q in QUESTIONS if q.topic in asked(view.history)]
        if u < self.p_repeat and done:
            return ask(rng.choice(done))
        u -= self.p_repeat
        if u < self.p_early_guess:
            name = rng.choice(consistent(self.oracle, view)).name
            return guess(name, f"Guess {name}.")
        return self.expert.act(view, rng)


class RandomPolicy:
    """Asks random unasked questions and guesses a random listed city on the final turn."""

    name = "random"

    def __init__(self, oracle: Oracle):
        self.oracle = oracle

    def act(self, view: PlayerView, rng: random.Random) -> Action:
        unasked = [q for q in QUESTIONS if q.topic not in asked(view.history)]
        if view.is_final_turn or not unasked:
            name = rng.choice(view.candidates).name
            return guess(name, f"Last turn, guess {name}." if view.is_final_turn else f"Guess {name}.")
        return ask(rng.choice(unasked))
