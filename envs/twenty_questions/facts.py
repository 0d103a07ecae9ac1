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

import random

from .kb import Entity, KnowledgeBase, Question

FACTS_SYSTEM = "Facts about objects. Name the object they describe."


def identifying_facts(kb: KnowledgeBase, entity: Entity, rng: random.Random) -> list[tuple[Question, bool]]:
    """(question, answer) pairs in a random order, stopping once no other object fits them all."""
    others = [e for e in kb.entities if e != entity]
    order = list(kb.questions)
    rng.shuffle(order)
    facts = []
    for q in order:
        truth = kb.truth(entity, q)
        left = [e for e in others if kb.truth(e, q) == truth]
        if len(left) < len(others) or rng.random() < 0.25:  # a few facts that tell nothing new, as prose has
            facts.append((q, truth))
        others = left
        if not others:
            break
    return facts


def riddle(kb: KnowledgeBase, entity: Entity, rng: random.Random) -> list[dict]:
    """One riddle as two chat messages: the statements as short labels, then the object they lead
    to, in the words a player's reason ends with before its guess (policies.only_fits). The
    statements are given, not written by the model: only the name is learnt, so the random order
    and choice of statements add no noise to the loss."""
    facts = identifying_facts(kb, entity, rng)
    labels = ", ".join(q.label if truth else q.no_label for q, truth in facts)
    return [{"role": "user", "content": f"{labels}:"}, {"role": "assistant", "content": f"only {entity.name} fits."}]


def fact_sheets(kb: KnowledgeBase, per_object: int, seed: int, per_sheet: int = 8) -> list[list[dict]]:
    """`per_object` riddles about every object of every split, in a random order, `per_sheet`
    to a sheet; reproducible from `seed`."""
    rng = random.Random(seed)
    objects = [e for e in kb.entities for _ in range(per_object)]
    rng.shuffle(objects)
    riddles = [riddle(kb, e, rng) for e in objects]
    return [
        [{"role": "system", "content": FACTS_SYSTEM}, *(m for r in riddles[i : i + per_sheet] for m in r)]
        for i in range(0, len(riddles), per_sheet)
    ]
