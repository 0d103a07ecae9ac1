"""TwentyQuestions rules as in HOPE: one yes-no question per turn, -1 per turn, 0 for the correct
guess, at most 20 turns with the last one a forced guess.

The oracle is rule-based: it answers from the knowledge base and says "unknown" to anything the
knowledge base cannot decide, instead of inventing an answer as an LLM simulator might.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .kb import Entity, KnowledgeBase

MAX_TURNS = 20


@dataclass(frozen=True)
class Answer:
    text: Literal["yes", "no", "unknown"]
    is_guess: bool
    correct: bool


@dataclass(frozen=True)
class Step:
    observation: str  # the oracle's answer text
    reward: float
    done: bool
    success: bool


class Oracle:
    def __init__(self, kb: KnowledgeBase):
        self.kb = kb

    def answer(self, secret: Entity, question: str) -> Answer:
        # Guesses first, so "Is it a key?" names the object rather than asking about keys.
        guess = self.kb.resolve_guess(question)
        if guess is not None:
            correct = guess == secret
            return Answer("yes" if correct else "no", is_guess=True, correct=correct)
        q = self.kb.match_question(question)
        if q is None:
            return Answer("unknown", is_guess=False, correct=False)
        return Answer("yes" if self.kb.truth(secret, q) else "no", is_guess=False, correct=False)


@dataclass
class Game:
    kb: KnowledgeBase
    secret: Entity
    max_turns: int = MAX_TURNS
    turn: int = field(default=0, init=False)  # actions taken so far
    history: list[tuple[str, str]] = field(default_factory=list, init=False)  # (question, answer text)
    done: bool = field(default=False, init=False)
    success: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        self.oracle = Oracle(self.kb)

    @property
    def is_final_turn(self) -> bool:
        """The next action is the last allowed one, so only a correct guess can still win."""
        return not self.done and self.turn == self.max_turns - 1

    def restore(self, history: list[tuple[str, str]]) -> None:
        """Resume from logged (question, answer) pairs without asking the oracle again: a
        branch from a logged prefix keeps the answers that prefix actually got."""
        if self.turn:
            raise RuntimeError("restore() needs a fresh game")
        if len(history) >= self.max_turns:
            raise ValueError(f"a prefix of {len(history)} turns leaves no turn of {self.max_turns}")
        self.history = list(history)
        self.turn = len(history)

    def step(self, question: str, answer: Answer | None = None) -> Step:
        """Ask `question`. `answer` is another simulator's (an LLM's) answer; by default the
        knowledge-base oracle answers."""
        if self.done:
            raise RuntimeError(f"the game for {self.secret.name!r} is over; start a new one")
        answer = self.oracle.answer(self.secret, question) if answer is None else answer
        self.history.append((question, answer.text))
        self.turn += 1
        self.success = answer.correct
        # A non-guess on the final turn simply runs out of turns: the episode fails at -1.
        self.done = self.success or self.turn >= self.max_turns
        return Step(answer.text, 0.0 if self.success else -1.0, self.done, self.success)
