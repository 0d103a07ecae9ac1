"""The oracle reward labeler: the environment's own return, recomputed by replaying the actions.

It does not trust a logged return: it plays the trajectory's actions against the knowledge-base
oracle and sums HOPE's rewards (-1 per turn, 0 for the correct guess). A trajectory that stops
before its game is over cannot be scored and is reported as such.
"""
from __future__ import annotations

from envs.base import Label

from .game import Game
from .kb import KnowledgeBase

VERSION = "oracle-labeler-v1"


def label_trajectory(kb: KnowledgeBase, task_id: str, actions: list[str], max_turns: int) -> Label:
    try:
        game = Game(kb, kb.get(task_id), max_turns=max_turns)
    except KeyError:
        return Label(None, None, f"task {task_id!r} is not in the knowledge base")
    total = 0.0
    for i, action in enumerate(actions):
        if game.done:
            return Label(None, None, f"the game ended at turn {i} but the trajectory has {len(actions)} actions")
        total += game.step(action).reward
    if not game.done:
        return Label(None, None, f"the trajectory stops after {len(actions)} actions, before the game ends")
    outcome = f"found {task_id} in {game.turn} turns" if game.success else f"did not find {task_id} in {game.turn} turns"
    return Label(total, game.success, f"environment return: {outcome}")
