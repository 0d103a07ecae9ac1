"""Scripted behaviour policies that produce TwentyQuestions demonstrations.

They know the world (the knowledge base) and the candidate list, never the secret: whatever they
know about it they infer from the answers so far. Every policy writes the same kind of short reason
("Ask about size."; before a guess, what the answers established: "red, round: only Apple
fits."), so the policies differ only in the choices they make.
Reasons stay short on purpose: a tiny model re-reads every earlier turn at every step, and a
growing scratchpad made contexts long and copying errors compound. The list before a guess is
the exception: the name it leads to is learnt from the same kind of list in the fact sheets
(facts.py), which is what lets the model name an object it never played.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from envs.base import check_noise

from .facts import telling
from .format import Action
from .game import Game, Step
from .kb import Entity, KnowledgeBase, Question, load_kb

__all__ = [
    "Action",
    "ExpertPolicy",
    "NoisyPolicy",
    "PlayerView",
    "Policy",
    "RandomPolicy",
    "play",
]


@dataclass(frozen=True)
class PlayerView:
    """What a player sees before acting."""

    candidates: list[Entity]  # the split's objects
    history: list[tuple[str, str]]  # (question, answer text)
    turn: int  # 0-based index of the action about to be taken
    max_turns: int

    @property
    def is_final_turn(self) -> bool:
        return self.turn == self.max_turns - 1


class Policy(Protocol):
    name: str

    def act(self, view: PlayerView, rng: random.Random) -> Action: ...


def _established(kb: KnowledgeBase, history: list[tuple[str, str]]) -> list[tuple[Question | Entity, bool]]:
    """What the answers settled, in order: (question, its truth) or (wrongly guessed object, False).
    Mirrors the oracle: guesses first, then the question set; "unknown" settles nothing."""
    facts: list[tuple[Question | Entity, bool]] = []
    for text, answer in history:
        guess = kb.resolve_guess(text)
        if guess is not None:
            if answer == "no":
                facts.append((guess, False))
        elif (q := kb.match_question(text)) is not None and answer in ("yes", "no"):
            facts.append((q, answer == "yes"))
    return facts


def consistent(kb: KnowledgeBase, view: PlayerView) -> list[Entity]:
    """The candidates every answer so far agrees with."""
    left = view.candidates
    for subject, value in _established(kb, view.history):
        if isinstance(subject, Entity):
            left = [e for e in left if e != subject]
        else:
            left = [e for e in left if kb.truth(e, subject) == value]
    if not left:
        raise ValueError("no candidate agrees with the answers so far (is the secret in the candidate list?)")
    return left


def known(kb: KnowledgeBase, history: list[tuple[str, str]]) -> str:
    """What the answers established, as short labels in the order asked ("not hand-sized, outdoor,
    not Cup"): the list a guess's reason gives before the name it leads to. Fact sheets
    (facts.py) end in the same form, so the name is learnt from the same kind of context."""
    return ", ".join(
        (s.label if value else s.no_label) if isinstance(s, Question) else f"not {s.name}" for s, value in _established(kb, history)
    )


def only_fits(kb: KnowledgeBase, history: list[tuple[str, str]], name: str, listed: bool = True) -> str:
    """A guess's reason. `listed=False` when the observations already say what the answers
    established (observation: known): the reason then only names the object, so the name follows
    the list the environment wrote, not a list the model rewrites from memory."""
    facts = known(kb, history) if listed else ""
    return f"{facts}: only {name} fits." if facts else f"Only {name} fits."


def _asked(kb: KnowledgeBase, history: list[tuple[str, str]]) -> list[Question]:
    return [q for q in (kb.match_question(text) for text, _ in history) if q is not None]


def _ask(q: Question) -> Action:
    return Action(f"Ask about {q.label}.", q.text)


def _guess(name: str, why: str) -> Action:
    return Action(why, f"Is it {name}?")


class ExpertPolicy:
    """Tracks the consistent candidates and asks the category or attribute question with maximal
    information gain; guesses when one candidate is left, when no question splits the rest, or on
    the final turn.

    Ties between equally good questions go to the first in the question set, so the expert is one
    fixed decision tree a small model can learn; `random_ties=True` breaks them with the rng for
    more varied demonstrations."""

    name = "expert"

    def __init__(self, kb: KnowledgeBase | None = None, random_ties: bool = False, listed: bool = True):
        self.kb = kb or load_kb()
        self.random_ties, self.listed = random_ties, listed

    def act(self, view: PlayerView, rng: random.Random) -> Action:
        left = consistent(self.kb, view)
        if len(left) == 1:
            return _guess(left[0].name, only_fits(self.kb, view.history, left[0].name, self.listed))
        best = self.best_questions(left, view.history)
        if view.is_final_turn or not best:
            name = rng.choice(left).name
            return _guess(name, f"Last turn, guess {name}." if view.is_final_turn else f"Guess {name}.")
        return _ask(rng.choice(best) if self.random_ties else best[0])

    def best_questions(self, left: list[Entity], history: list[tuple[str, str]]) -> list[Question]:
        """The unasked questions that split `left` most evenly (empty if none splits it), in the
        question set's order: the ones tied for maximal information gain (facts.telling)."""
        scored = telling(self.kb, frozenset(left), {q.key for q in _asked(self.kb, history)})
        top = max((score for score, _ in scored), default=0)
        return [q for score, q in scored if score == top]


class NoisyPolicy:
    """The expert, except that before the final turn it asks a random question from the question
    set with probability p_random, repeats an earlier question with p_repeat, or guesses a random
    consistent candidate early with p_early_guess."""

    name = "noisy"

    def __init__(self, p_random: float, p_repeat: float, p_early_guess: float, kb: KnowledgeBase | None = None, listed: bool = True):
        check_noise(p_random, p_repeat, p_early_guess)
        self.p_random, self.p_repeat, self.p_early_guess = p_random, p_repeat, p_early_guess
        self.expert = ExpertPolicy(kb, listed=listed)
        self.kb = self.expert.kb

    def act(self, view: PlayerView, rng: random.Random) -> Action:
        if view.is_final_turn:
            return self.expert.act(view, rng)
        u = rng.random()
        if u < self.p_random:
            return _ask(rng.choice(self.kb.questions))
        u -= self.p_random
        asked = _asked(self.kb, view.history)
        if u < self.p_repeat and asked:
            return _ask(rng.choice(asked))
        u -= self.p_repeat
        if u < self.p_early_guess:
            name = rng.choice(consistent(self.kb, view)).name
            return _guess(name, f"Guess {name}.")
        return self.expert.act(view, rng)


class RandomPolicy:
    """Asks random unasked questions and guesses a random candidate on the final turn."""

    name = "random"

    def __init__(self, kb: KnowledgeBase | None = None):
        self.kb = kb or load_kb()

    def act(self, view: PlayerView, rng: random.Random) -> Action:
        asked = {q.key for q in _asked(self.kb, view.history)}
        unasked = [q for q in self.kb.questions if q.key not in asked]
        if view.is_final_turn or not unasked:
            name = rng.choice(view.candidates).name
            return _guess(name, f"Last turn, guess {name}." if view.is_final_turn else f"Guess {name}.")
        return _ask(rng.choice(unasked))


def play(policy: Policy, game: Game, candidates: list[Entity], rng: random.Random) -> list[tuple[Action, Step]]:
    """Run one episode to the end; for a mixture pass `mixture.for_episode(rng)` (envs.base.Mixture)."""
    steps = []
    while not game.done:
        view = PlayerView(candidates, list(game.history), game.turn, game.max_turns)
        action = policy.act(view, rng)
        steps.append((action, game.step(action.question)))
    return steps
