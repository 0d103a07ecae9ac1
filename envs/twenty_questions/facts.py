"""What a pretrained LLM knows about the objects, outside any game.

The base policy is trained from scratch, so it knows nothing about an object it never played
unless it is told. A pretrained LLM has read that an apple is a red fruit that grows on trees:
it can name an object from a description, which is what lets it finish a game about an object
it was never shown playing. `fact_sheets` writes that knowledge as riddles: a random set of true
statements about one object (the short labels of questions of the question set, by their
answer: "not hand-sized, outdoor"), enough to tell it apart from every other object, then its
name. Several riddles about different objects make one sheet (one training sequence), so the
short riddles do not outnumber the games as training steps. They cover every object of every
split; game demonstrations (tasks/bootstrap.py) come from train tasks only, so val and test
games stay unseen. No riddle is a game: no turns, no player, no questions chosen by a strategy.
"""
from __future__ import annotations

import functools
import random

from envs.reason_question import render_action

from .kb import Entity, KnowledgeBase, Question

FACTS_SYSTEM = "Facts about objects. Name the object they describe."
RIDDLE_ASK = "Describe an object and name it."


@functools.cache
def _yes(kb: KnowledgeBase) -> dict[Question, frozenset[Entity]]:
    """Each question's yes-objects, so a description's splits are set sizes (a sheet of thousands
    of riddles is built in seconds)."""
    return {q: frozenset(e for e in kb.entities if kb.truth(e, q)) for q in kb.questions}


def telling(kb: KnowledgeBase, left: frozenset[Entity], used: set[str]) -> list[tuple[int, Question]]:
    """Unused questions that split `left`, scored by the smaller side of the split (higher tells
    more; the entropy of a yes/no split is a function of that side alone)."""
    scored = []
    for q, yes_set in _yes(kb).items():
        if q.key not in used:
            yes = len(left & yes_set)
            if 0 < yes < len(left):
                scored.append((min(yes, len(left) - yes), q))
    return scored


def identifying_facts(kb: KnowledgeBase, entity: Entity, rng: random.Random, breadth: int = 3, expert: bool = False) -> list[tuple[Question, bool]]:
    """A description of `entity`, general to specific, as a person narrowing it down would give
    it: each statement drawn uniformly from the `breadth` statements that tell the remaining
    objects apart best, until no other object fits them all. Every object of every split is
    described over all objects, whatever the game's candidates. `expert=True` takes the most
    telling statement, ties in the question set's order, as the scripted expert asks: the
    description is then the expert's path to the object (over every object)."""
    left = frozenset(kb.entities)
    facts: list[tuple[Question, bool]] = []
    while len(left) > 1:
        scored = telling(kb, left, {q.key for q, _ in facts})
        if not scored:
            break  # objects with identical answers to every question: the description stops short
        if not expert:
            rng.shuffle(scored)  # ties among equally telling statements fall randomly
        scored.sort(key=lambda sq: -sq[0])
        q = scored[0][1] if expert else rng.choice(scored[:breadth])[1]
        truth = entity in _yes(kb)[q]
        facts.append((q, truth))
        left = left & _yes(kb)[q] if truth else left - _yes(kb)[q]
    return facts


def riddle(kb: KnowledgeBase, entity: Entity, rng: random.Random, breadth: int = 3, form: str = "statements", expert: bool = False) -> list[dict]:
    """One riddle as two chat messages: the statements as short labels, then the object they lead
    to, in the words a player's reason ends with before its guess (policies.only_fits). The
    statements are given, not written by the model: only the name is learnt, so the random order
    and choice of statements add no noise to the loss."""
    facts = identifying_facts(kb, entity, rng, breadth, expert)
    labels = ", ".join(q.label if truth else q.no_label for q, truth in facts)
    if form == "known":  # the list as a game's observation gives it, then the guess it leads to
        return [{"role": "user", "content": f"Known: {labels}."},
                {"role": "assistant", "content": render_action(f"Only {entity.name} fits.", f"Is it {entity.name}?")}]
    if form == "guess":
        return [{"role": "user", "content": RIDDLE_ASK},
                {"role": "assistant", "content": render_action(f"{labels}: only {entity.name} fits.", f"Is it {entity.name}?")}]
    return [{"role": "user", "content": f"{labels}:"}, {"role": "assistant", "content": f"only {entity.name} fits."}]


def fact_sheets(kb: KnowledgeBase, per_object: int, seed: int, breadth: int = 3, per_sheet: int = 8, form: str = "statements", order: str = "telling") -> list[list[dict]]:
    """`per_object` riddles about every object of every split, in a random order, `per_sheet`
    to a sheet; reproducible from `seed`. `order`: telling (identifying_facts at `breadth`),
    expert (the expert's path) or mixed (every other riddle of an object the expert's path)."""
    rng = random.Random(seed)
    objects = [(e, i) for e in kb.entities for i in range(per_object)]
    rng.shuffle(objects)
    expert = {"telling": lambda i: False, "expert": lambda i: True, "mixed": lambda i: i % 2 == 0}[order]
    riddles = [riddle(kb, e, rng, breadth, form, expert(i)) for e, i in objects]
    return [
        [{"role": "system", "content": FACTS_SYSTEM}, *(m for r in riddles[i : i + per_sheet] for m in r)]
        for i in range(0, len(riddles), per_sheet)
    ]
