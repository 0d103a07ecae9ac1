"""GuessMyCity rules as in HOPE (notes/envs-wave2.md 1.2): open questions with free-text answers,
at most 10 questions, -1 a question, one guess that ends the game.

- A guess is a question of one of HOPE's guess forms ("Is it N?", "Is the city N?", "Is it the
  city of N?", "Is the city called N?", "Is the place (called) N?", "Are you from N?") or a bare
  name, where N names a listed city exactly (cities.Cities.named). HOPE's code instead matched
  substrings, so "Portoviejo" won for Porto Alegre, and took any 1-2 words after "is it" as a
  guess, so "Is it coastal?" lost the game; here neither happens.
- The right guess answers "yes", scores 0 and ends the game (a win on question k returns -(k-1)).
- A wrong guess answers "no" and ends the game at exactly -max_turns: its reward is what the
  questions so far left of -max_turns (HOPE's one-guess rule).
- Any other question costs -1 and the oracle answers it; after max_turns questions the game is
  over at -max_turns.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .cities import Cities, City, normalize

MAX_TURNS = 10

_GUESS = re.compile(
    r"^(?:is it the city of|is the city called|is the place called|is it|is the city|is the place|are you from) (.+)$"
)


@dataclass(frozen=True)
class Answer:
    text: str
    is_guess: bool
    correct: bool


def guessed_city(cities: Cities, question: str) -> City | None:
    """The listed city a question guesses, or None when it is not a guess."""
    q = normalize(question)
    if (city := cities.named(q)) is not None:
        return city
    m = _GUESS.match(q)
    return cities.named(m.group(1)) if m else None


@dataclass
class Game:
    cities: Cities
    secret: City
    answer_question: Callable[[City, str], str]  # the oracle's answer to a non-guess
    max_turns: int = MAX_TURNS
    turn: int = field(default=0, init=False)  # questions asked so far
    total: float = field(default=0.0, init=False)
    history: list[tuple[str, str]] = field(default_factory=list, init=False)  # (question, answer)
    done: bool = field(default=False, init=False)
    success: bool = field(default=False, init=False)
    guessed: bool = field(default=False, init=False)  # the game ended on a guess, right or wrong

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")

    def answer(self, question: str) -> Answer:
        guess = guessed_city(self.cities, question)
        if guess is not None:
            return Answer("yes" if guess == self.secret else "no", is_guess=True, correct=guess == self.secret)
        return Answer(self.answer_question(self.secret, question), is_guess=False, correct=False)

    def step(self, question: str, answer: Answer | None = None) -> tuple[str, float]:
        """Ask `question`; `answer` is another simulator's (an LLM's), else the oracle answers.
        Returns the answer text and the step reward."""
        if self.done:
            raise RuntimeError(f"the game for {self.secret.id!r} is over; start a new one")
        answer = self.answer(question) if answer is None else answer
        if answer.correct:
            reward = 0.0
        elif answer.is_guess:
            reward = -self.max_turns - self.total  # the return becomes exactly -max_turns
        else:
            reward = -1.0
        self.history.append((question, answer.text))
        self.turn += 1
        self.total += reward
        self.success, self.guessed = answer.correct, answer.is_guess
        self.done = answer.is_guess or self.turn >= self.max_turns
        return answer.text, reward

    def restore(self, history: list[tuple[str, str]]) -> None:
        """Resume after logged (question, answer) pairs without asking the oracle again; the
        prefix must be a game still running (no guess, turns left)."""
        if self.turn:
            raise RuntimeError("restore() needs a fresh game")
        if len(history) >= self.max_turns:
            raise ValueError(f"a prefix of {len(history)} turns leaves no turn of {self.max_turns}")
        if any(guessed_city(self.cities, q) is not None for q, _ in history):
            raise ValueError("a prefix with a guess has already ended its game")
        self.history = list(history)
        self.turn = len(history)
        self.total = -float(len(history))
