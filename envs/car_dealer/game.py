"""CarDealer's rules (HOPE App. I.1; agent_prm env.py and interface.py): at most 10 seller turns,
the seller first, each turn an API call, then a reply to the buyer, then the buyer's answer.

- The call runs on the buyer type's inventory. The cars it shows become the list the reply picks
  from by number; a call that finds nothing (no_op included) leaves the previous list in place, as
  agent_prm reuses the last call that found cars for the reply.
- The reply picks one car of that list (0 or a number past its end: none), copies its details and
  may quote a price. The buyer (oracle or LLM) answers with a decision: negotiate, accept at a
  price, or reject. Accept and reject end the game; so does the last turn's reply.
- The reward comes at the end (reward.py); every other action scores 0.

Randomness is seeded by the content of the game, never by the clock: which cars a too-broad search
shows by (buyer, turn, call), the oracle's wording by (buyer, turn, reply). The same actions
replay to the same game, which is what `restore` and the labeler rely on.
"""
from __future__ import annotations

import copy
import hashlib
import random
from dataclasses import dataclass, field
from typing import Literal

from .buyer import BuyerReply, Counters, Situation, count, oracle_reply, read_observation, situate
from .data import Buyer, Car, Inventory
from .format import Reply, reply_body
from .reward import Outcome, Rule, no_sale, sale
from .tools import NOTHING_FOUND, ApiCall, display, search, shown

MAX_TURNS = 10  # seller turns


def seeded(*parts: object) -> random.Random:
    return random.Random(int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "big"))


@dataclass(frozen=True)
class Rules:
    max_turns: int = MAX_TURNS
    max_cars_shown: int | None = 8
    reward_rule: Rule = "paper"
    type6_quirk: bool = False


@dataclass(frozen=True)
class Listing:
    """The cars the last call that found any shows, numbered from 1."""

    call: ApiCall
    cars: tuple[Car, ...]
    text: str


@dataclass
class SellerTurn:
    """One seller turn as it happened, for views, summaries and prompts."""

    call: ApiCall
    found: int  # cars the call found (before the display cap)
    tool_text: str  # what the tool message showed
    reply: Reply | None = None
    car: Car | None = None  # the car the reply picked
    situation: Situation | None = None
    answer: BuyerReply | None = None


@dataclass
class Dealership:
    buyer: Buyer
    inventory: Inventory
    rules: Rules = Rules()
    turns: list[SellerTurn] = field(default_factory=list)
    listing: Listing | None = None
    counters: Counters = Counters()
    done: bool = False
    timed_out: bool = False
    outcome: Outcome | None = None

    @property
    def phase(self) -> Literal["api", "reply"]:
        return "reply" if self.turns and self.turns[-1].reply is None else "api"

    @property
    def actions(self) -> int:
        return len(self.turns) + sum(t.reply is not None for t in self.turns)

    @property
    def success(self) -> bool:
        return bool(self.outcome and self.outcome.success)

    @property
    def previous_car(self) -> Car | None:
        replied = [t for t in self.turns if t.reply is not None]
        return replied[-1].car if replied else None

    def fork(self) -> Dealership:
        """An independent copy of the game to play on; the buyer and the inventory, which no game
        changes, are shared rather than copied (hindsight plays out dozens of forks per action)."""
        return copy.deepcopy(self, {id(self.inventory): self.inventory, id(self.buyer): self.buyer})

    def call(self, call: ApiCall) -> str:
        """Run the seller's API call; returns the tool message."""
        self._expect("api")
        found = search(call, self.inventory)
        if found:
            cars, broad = shown(found, self.rules.max_cars_shown, seeded("cars", self.buyer.id, len(self.turns), call))
            self.listing = Listing(call, tuple(cars), display(cars, broad))
            text = self.listing.text
        else:
            what = "no_op: nothing was searched." if call.name == "no_op" else NOTHING_FOUND
            kept = f"\nThe list stays that of {self.listing.call}." if self.listing else ""
            text = what + kept
        self.turns.append(SellerTurn(call, len(found), text))
        return text

    def picked(self, reply: Reply) -> Car | None:
        cars = self.listing.cars if self.listing else ()
        return cars[reply.car_index - 1] if 1 <= reply.car_index <= len(cars) else None

    def situation(self, reply: Reply) -> Situation:
        """What the buyer makes of `reply`, without playing it (an LLM buyer's prompt needs it)."""
        self._expect("reply")
        car = self.picked(reply)
        counters = count(self.counters, self.previous_car, car, reply.response)
        return situate(self.buyer, len(self.turns) == 1, car, reply.response, counters, self.rules.type6_quirk)

    def answer(self, reply: Reply, given: BuyerReply | None = None) -> tuple[BuyerReply, float]:
        """Play the seller's reply; `given` is an LLM buyer's answer, else the oracle answers.
        Returns the buyer's reply and the action's reward."""
        s = self.situation(reply)
        turn = self.turns[-1]
        said = given if given is not None else oracle_reply(self.buyer, s, seeded("words", self.buyer.id, len(self.turns), reply_body(reply.response, reply.car_index, reply.copied)))
        turn.reply, turn.car, turn.situation, turn.answer = reply, s.car, s, said
        self.counters = s.counters
        if said.decision == "accept":
            self.outcome = sale(self.buyer, s.car, reply.copied, said.price, s.counters, self.inventory, self.rules.reward_rule)
        elif said.decision == "reject":
            self.outcome = no_sale(self.buyer, s.car, self.rules.reward_rule, "the buyer rejected the car" if s.car else "the buyer left")
        elif len(self.turns) >= self.rules.max_turns:
            self.timed_out = True
            self.outcome = no_sale(self.buyer, s.car, self.rules.reward_rule, f"no sale in {self.rules.max_turns} turns", timeout=True)
        self.done = self.outcome is not None
        return said, self.outcome.reward if self.outcome else 0.0

    def restore(self, actions: list[tuple[ApiCall | Reply, str]]) -> None:
        """Replay logged (action, observation) pairs without asking the buyer: its logged answers
        stand. The tool is run again and must show what was logged, else the data or the code
        changed under the log and its car numbers would point elsewhere."""
        if self.turns:
            raise RuntimeError("restore() needs a fresh game")
        for i, (action, observation) in enumerate(actions):
            if self.done:
                raise ValueError(f"action {i} comes after the game ended")
            if isinstance(action, ApiCall):
                if (got := self.call(action)) != observation:
                    raise ValueError(f"action {i} ({action}) shows other cars than logged:\n{got[:200]}\nlogged:\n{observation[:200]}")
            else:
                self.answer(action, read_observation(observation))

    def _expect(self, phase: str) -> None:
        if self.done:
            raise RuntimeError(f"the game for {self.buyer.id} is over")
        if self.phase != phase:
            raise RuntimeError(f"expected the seller's {self.phase} action, got a {phase} action")
