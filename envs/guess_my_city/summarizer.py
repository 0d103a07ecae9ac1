"""The oracle summarizer: HOPE's trajectory summary, written from the environment's hidden state.

It sees the secret city, so it can say what the answers established about it, what the player
missed and how the game ended, in a few sentences as HOPE's GuessMyCity summary prompt asks:
the secret city with its country and continent, and a critique of the strategy (repeated or
unanswerable questions, whether it guessed once only one city remained, why it failed).
"""
from __future__ import annotations

from .cities import City
from .game import guessed_city
from .oracle import Oracle, topic
from .policies import PlayerView, consistent, known

VERSION = "guess-my-city-oracle-summary-v1"  # bump when the wording changes: summaries are cached by it


def _plural(n: int, word: str, words: str | None = None) -> str:
    return f"{n} {word if n == 1 else words or word + 's'}"


def summarize_game(oracle: Oracle, secret: City, history: list[tuple[str, str]], success: bool, max_turns: int) -> str:
    """history: (question, answer) per turn, as the simulator answered them."""
    candidates = list(oracle.cities.cities)
    sentences = [f"The secret city was {secret.name}, in {secret.country} ({secret.continent})."]
    if facts := known(oracle, history):
        sentences.append(f"The answers established: {facts}.")

    topics: set[str] = set()
    repeats = unanswerable = refused = 0
    guessed, singled_out = None, None
    for turn, (question, _) in enumerate(history):
        if (city := guessed_city(oracle.cities, question)) is not None:
            guessed = (turn, city)
            break
        if singled_out is None and len(_left(oracle, candidates, history[: turn + 1], max_turns)) == 1:
            singled_out = turn + 1  # questions after which only one city fit
        t = topic(question)
        if t is None:
            unanswerable += 1
        elif t == "name":
            refused += 1
        elif t in topics:
            repeats += 1
        topics.add(t)

    missed = []
    if not success and "continent" not in topics:
        missed.append(f"never asked what part of the world the city is in ({oracle.facts[secret.id].subregion})")
    if repeats:
        missed.append(f"repeated {_plural(repeats, 'question')}")
    if unanswerable:
        missed.append(f"asked {_plural(unanswerable, 'question')} the answerer could not answer")
    if refused:
        missed.append(f"asked for the name of the city or its country {_plural(refused, 'time')}, which the rules forbid")
    if missed:
        sentences.append("The player " + "; ".join(missed) + ".")

    if guessed is not None:
        turn, city = guessed
        fit = len(_left(oracle, candidates, history[:turn], max_turns))
        how = "once only that city fit the answers" if fit == 1 else f"while {_plural(fit, 'city', 'cities')} still fit the answers"
        outcome = "rightly" if city == secret else "wrongly, which ended the game"
        sentences.append(f"At question {turn + 1} it guessed {city.name} {how}, {outcome}.")
    elif singled_out is not None:
        sentences.append(f"Only one city fit the answers after question {singled_out}, but it never guessed.")
    else:
        sentences.append("It never guessed.")
    n = len(history)
    sentences.append(f"It found the city in {_plural(n, 'question')}." if success else f"It failed to find the city in {_plural(n, 'question')}.")
    return " ".join(sentences)


def _left(oracle: Oracle, candidates: list[City], history: list[tuple[str, str]], max_turns: int) -> list[City]:
    """The cities the answers leave; none when they contradict each other (an LLM simulator's)."""
    try:
        return consistent(oracle, PlayerView(candidates, history, len(history), max_turns))
    except ValueError:
        return []
