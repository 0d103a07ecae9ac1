"""What a pretrained LLM knows about the cities, outside any game.

The base policy is trained from scratch, so it knows nothing about a city it never played unless
it is told. A pretrained LLM has read that Busan is a large Korean port: it can name a city from
a description, which is what lets it finish a game about a city it was never shown playing.
`fact_sheets` writes that knowledge as riddles: true statements about one city from the oracle's
knowledge base (the short labels of its answers: "in East Asia, speaks Korean, coastal"), general
to specific, enough to tell it apart from every other listed city, then its name, in the words a
guess's reason ends with (policies.only_fits). Several riddles make one sheet (one training
sequence). They cover every city of every split; game demonstrations (tasks/bootstrap.py) come
from train tasks only, so val and test games stay unseen. No riddle is a game: no turns, no
player, no questions chosen by a strategy.

The country is never stated: no answer names it, so no reason can, and a riddle says only what
a reason says.
"""
from __future__ import annotations

import random

from .cities import City
from .oracle import QUESTIONS, Oracle, Question
from .policies import gain

FACTS_SYSTEM = "Facts about cities. Name the city they describe."


def identifying_facts(oracle: Oracle, city: City, rng: random.Random, breadth: int = 3) -> list[Question]:
    """A description of `city`, general to specific, as a player narrowing it down would hear it:
    each statement drawn uniformly from the `breadth` most telling of the most general level that
    still tells the remaining cities apart, until no other city fits them all. Every city of
    every split is described over all listed cities."""
    left = list(oracle.cities.cities)
    facts: list[Question] = []
    while len(left) > 1:
        scored = [(gain(oracle, left, q), q) for q in QUESTIONS if q not in facts]
        scored = [(g, q) for g, q in scored if g > 0]
        if not scored:
            break  # cities the knowledge base cannot tell apart: the description stops short
        level = min(q.level for _, q in scored)
        scored = [(g, q) for g, q in scored if q.level == level]
        rng.shuffle(scored)  # ties among equally telling statements fall randomly
        scored.sort(key=lambda gq: -gq[0])
        q = rng.choice(scored[:breadth])[1]
        facts.append(q)
        said = oracle.says(city, q.topic)
        left = [c for c in left if oracle.says(c, q.topic) == said]
    return facts


def riddle(oracle: Oracle, city: City, rng: random.Random, breadth: int = 3) -> list[dict]:
    """One riddle as two chat messages: the statements, then the city they lead to. The
    statements are given, not written by the model: only the name is learnt."""
    labels = ", ".join(oracle.labels[(q.topic, oracle.says(city, q.topic))] for q in identifying_facts(oracle, city, rng, breadth))
    return [{"role": "user", "content": f"{labels}:"}, {"role": "assistant", "content": f"only {city.name} fits."}]


def fact_sheets(oracle: Oracle, per_city: int, seed: int, breadth: int = 3, per_sheet: int = 8) -> list[list[dict]]:
    """`per_city` riddles about every city of every split, in a random order, `per_sheet` to a
    sheet; reproducible from `seed`."""
    rng = random.Random(seed)
    cities = [c for c in oracle.cities.cities for _ in range(per_city)]
    rng.shuffle(cities)
    riddles = [riddle(oracle, c, rng, breadth) for c in cities]
    return [
        [{"role": "system", "content": FACTS_SYSTEM}, *(m for r in riddles[i : i + per_sheet] for m in r)]
        for i in range(0, len(riddles), per_sheet)
    ]
