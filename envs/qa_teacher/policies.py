"""Scripted answerers for bootstrap's mixture, good and poor, as the paper's logging policy is
(Base at three temperatures: right and wrong answers, sound and thin reasoning). They know what a
well-read student knows, each option's fact (questions.py), so the expert answers from the facts,
and they write the system prompt's format in the game's mode (format.render_reply).

- expert: the key every turn with sound reasoning: first the key's fact; then the distractors'
  facts (why they fail); in an intermediate turn every option's fact; last the key's fact again.
- noisy: the expert, except that each turn, with p_random, it argues for a random option (its
  false fact, or the key's fact when the draw is the key); with p_repeat it repeats its last
  reply, not answering the teacher's new question; with p_early_guess it states the key bare,
  no reasoning (bootstrap's shared noise knobs, read for this game).
- wrong: one distractor (drawn per episode) argued for throughout: its false fact, then the key's
  false fact beside the other distractors' facts, then the distractor again.
- unjustified: the key, bare, every turn: right answers, nothing to learn from.
- random: a random letter each turn with a line that says nothing.
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence

from envs.base import check_noise

from .format import read_answer, render_reply
from .questions import LETTERS, Question

FILLER = ("I am not sure about this one.", "This option looks plausible to me.", "It could be this one.", "Let me go with this option.")


def expert_reason(q: Question, turn: int, turns: int) -> str:
    distractors = [i for i in range(4) if i != q.key]
    if turn == 0 or turn == turns - 1:
        return q.facts[q.key]
    if turn == 1:
        return " ".join(q.facts[i] for i in distractors)
    return " ".join(q.facts)


def expert(q: Question, mode: str, turn: int, turns: int) -> str:
    return render_reply(mode, q.answer, expert_reason(q, turn, turns))


class Answerer(ABC):
    """A scripted policy acting on a QA game (envs.base.Policy): reads the game's question, mode,
    turn and earlier replies."""

    name: str

    def act(self, game, rng: random.Random) -> str:
        return self.reply(game.task, game.mode, game.turn, game.max_turns, game.replies, rng)

    @abstractmethod
    def reply(self, q: Question, mode: str, turn: int, turns: int, earlier: Sequence[str], rng: random.Random) -> str: ...


class Expert(Answerer):
    name = "expert"

    def reply(self, q, mode, turn, turns, earlier, rng):
        return expert(q, mode, turn, turns)


class Noisy(Answerer):
    name = "noisy"

    def __init__(self, p_random: float, p_repeat: float, p_early_guess: float):
        check_noise(p_random, p_repeat, p_early_guess)
        self.p_random, self.p_repeat, self.p_early_guess = p_random, p_repeat, p_early_guess

    def reply(self, q, mode, turn, turns, earlier, rng):
        u = rng.random()
        if u < self.p_random:
            i = rng.randrange(4)
            return render_reply(mode, LETTERS[i], q.facts[i] if i == q.key else q.false_facts[i])
        if u < self.p_random + self.p_repeat and earlier:
            return earlier[-1]
        if u < self.p_random + self.p_repeat + self.p_early_guess:
            return render_reply(mode, q.answer, "")
        return expert(q, mode, turn, turns)


class Wrong(Answerer):
    name = "wrong"

    def reply(self, q, mode, turn, turns, earlier, rng):
        # the episode's distractor: drawn at the first turn, then read back from that reply (one
        # policy plays many episodes at once, so it keeps no state of its own)
        pick = rng.choice([i for i in range(4) if i != q.key]) if turn == 0 else LETTERS.index(read_answer(earlier[0])[0])
        if turn in (0, turns - 1):
            return render_reply(mode, LETTERS[pick], q.false_facts[pick])
        others = [q.facts[i] for i in range(4) if i not in (pick, q.key)]
        return render_reply(mode, LETTERS[pick], " ".join([q.false_facts[q.key], *others]))


class Unjustified(Answerer):
    name = "unjustified"

    def reply(self, q, mode, turn, turns, earlier, rng):
        return render_reply(mode, q.answer, "")


class Random(Answerer):
    name = "random"

    def reply(self, q, mode, turn, turns, earlier, rng):
        return render_reply(mode, rng.choice(LETTERS), rng.choice(FILLER))
