"""Scripted ScienceWorld agents for bootstrap's demonstrations, each writing ETO's Thought/Action.

- expert: plays the task's gold path (the simulator's, generated on load) in order, with a short
  templated thought per action (ETO's thoughts were GPT-4's, which are not reachable here).
  In a world whose doors start open (ETO's `easy`) it leaves out the path's "open door to X",
  which only answer "The door is already open.": with them a third of the find-animal and
  find-living-thing gold paths (up to 16 actions) outrun ETO's limit of 15; without them every
  variation of the default types completes at score 100 in at most 10.
  After an action of another policy it goes on from the first gold action not yet played.
- noisy: the expert, except that before the last step it plays, with p_random, a random valid
  action other than a focus (a detour), with p_repeat its previous action again, and with
  p_early_guess a focus on a random thing (a guess: a wrong focus ends the task at score 0).
  The rates are bootstrap.noisy's, shared by every environment.
- random: a random valid action every step, focus included.
The valid actions are the simulator's own list for the world's state (about 0.1 s to ask).
"""
from __future__ import annotations

import random
import re

from envs.base import check_noise

from .format import render_action

# Each agent acts on an env.ScienceWorldGame (its gold path, its valid actions, the actions sent);
# not imported here, as env.py imports this module.

# (pattern over the action, thought); the first that matches speaks. Groups fill {0}, {1}.
THOUGHTS = [
    (r"open door to (.+)", "The way to the {0} is through this door, so I open it."),
    (r"open (.+)", "I open the {0} to get at what is inside."),
    (r"close (.+)", "I close the {0}."),
    (r"go to (.+)", "The door is open, so I go to the {0}."),
    (r"teleport to (.+)", "I teleport to the {0}."),
    (r"look around", "I look around to see what is here."),
    (r"(?:look at|look in|examine) (.+)", "I look closely at the {0}."),
    (r"focus on (.+)", "The {0} is what the task is about, so I focus on it."),
    (r"pick up (.+)", "I pick up the {0} to take it with me."),
    (r"put down (.+)", "I put down the {0}."),
    (r"move (.+) to (.+)", "I move the {0} to the {1}, as the task asks."),
    (r"pour (.+) (?:in|into) (.+)", "I pour the {0} into the {1}."),
    (r"mix (.+)", "I mix what is in the {0}."),
    (r"dunk (.+) in (.+)", "I dunk the {0} in the {1}."),
    (r"connect (.+) to (.+)", "I connect the {0} to the {1}."),
    (r"disconnect (.+)", "I disconnect the {0}."),
    (r"activate (.+)", "I turn the {0} on."),
    (r"deactivate (.+)", "I turn the {0} off."),
    (r"use (.+) on (.+)", "I use the {0} on the {1}."),
    (r"use (.+)", "I use the {0}."),
    (r"read (.+)", "I read the {0}."),
    (r"wait1?", "Nothing to do but let time pass, so I wait."),
    (r"inventory", "I check what I am carrying."),
    (r"(\d+)", "Several things have that name; I choose number {0}."),
]


def thought(action: str) -> str:
    """The templated thought that goes with an action."""
    for pattern, text in THOUGHTS:
        m = re.fullmatch(pattern, action.strip(), flags=re.IGNORECASE)
        if m:
            return text.format(*m.groups())
    return f"Next I {action}."


def said(action: str) -> str:
    return render_action(thought(action), action)


def next_gold(gold: list[str], played: list[str]) -> int:
    """The index of the first gold action not yet played: the played actions matched against the
    gold path in order (a detour's actions match nothing and are skipped)."""
    k = 0
    for a in played:
        if k < len(gold) and " ".join(a.lower().split()) == " ".join(gold[k].lower().split()):
            k += 1
    return k


def expert_path(gold: list[str], doors_open: bool) -> list[str]:
    """The gold path the expert plays: without its door openings where the doors are open."""
    return [a for a in gold if not (doors_open and a.lower().startswith("open door to"))]


class Expert:
    name = "expert"

    def act(self, game, rng: random.Random) -> str:
        gold = expert_path(game.gold_path(), game.doors_open)
        k = next_gold(gold, game.sent)
        return said(gold[k] if k < len(gold) else "look around")


class Noisy:
    name = "noisy"

    def __init__(self, p_random: float, p_repeat: float, p_early_guess: float):
        check_noise(p_random, p_repeat, p_early_guess)
        self.p_random, self.p_repeat, self.p_early = p_random, p_repeat, p_early_guess
        self.expert = Expert()

    def act(self, game, rng: random.Random) -> str:
        u = rng.random()
        if game.turn < game.max_turns - 1:
            if u < self.p_early:
                focus = [a for a in game.valid_actions() if a.startswith("focus on")]
                if focus:
                    return said(rng.choice(focus))
            u -= self.p_early
            if u < self.p_random:
                detours = [a for a in game.valid_actions() if not a.startswith("focus on")]
                if detours:
                    return said(rng.choice(detours))
            u -= self.p_random
            if u < self.p_repeat and game.sent:
                return said(game.sent[-1])
        return self.expert.act(game, rng)


class Random:
    name = "random"

    def act(self, game, rng: random.Random) -> str:
        return said(rng.choice(game.valid_actions() or ["look around"]))
