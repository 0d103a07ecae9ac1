"""The persuasion game (HR's donation setting): at most `max_turns` persuader messages, each
answered by the donor (the oracle, donor.py, or an LLM donor's reply). The game ends when the
donor commits to an amount or leaves (terminated), or when the turns run out and the donor states
its decision (truncated). The reward is the donation, in [0, 2], on the last step; every other
step scores 0. A message that does not follow the action format is not heard: the turn is spent,
the donor's state is unchanged, and on the last turn the donor still decides.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .donor import DonorReply, DonorState, decide_at_end, read_observation, respond, seeded, start
from .donors import Donor

MAX_TURNS = 10


@dataclass
class Conversation:
    donor: Donor
    max_turns: int = MAX_TURNS
    state: DonorState = field(init=False)
    history: list[tuple[str | None, str]] = field(default_factory=list, init=False)  # (message or None when invalid, donor's observation)
    donation: float | None = field(default=None, init=False)
    ended_by_donor: bool = field(default=False, init=False)  # it committed or left (else the turns ran out)

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        self.state = start(self.donor)

    @property
    def turn(self) -> int:
        return len(self.history)

    @property
    def done(self) -> bool:
        return self.donation is not None

    def _rng(self, message: str | None):
        return seeded("donor", self.donor.seed, self.turn, message)

    def step(self, message: str | None, given: DonorReply | None = None) -> tuple[DonorReply, float]:
        """Play one persuader message (None: an action that did not parse, so nothing was said);
        `given` is another donor's reply (an LLM's), else the oracle answers. Returns the donor's
        reply (with the end-of-game decision when this was the last turn) and the step reward."""
        if self.done:
            raise RuntimeError(f"the conversation with {self.donor.id} is over; start a new one")
        if message is None:
            reply = DonorReply("")
            self.state.turns += 1  # a turn of the donor's patience is spent all the same
        else:
            oracle, _ = respond(self.donor, self.state, message, self._rng(message))
            reply = given if given is not None else oracle
        return self._record(message, reply)

    def _record(self, message: str | None, reply: DonorReply) -> tuple[DonorReply, float]:
        if reply.donation is not None:
            self.ended_by_donor = True
        elif self.turn + 1 >= self.max_turns:
            end = decide_at_end(self.donor, self.state)
            reply = DonorReply(" ".join(x for x in (reply.text, end.text) if x), end.donation, reply.reason)
        self.history.append((message, reply.observation()))
        self.donation = reply.donation
        return reply, self.donation or 0.0

    def restore(self, history: list[tuple[str | None, str]]) -> None:
        """Resume after logged (message, observation) pairs: the donor's state is rebuilt from the
        messages, its logged replies stand. The prefix must leave the conversation running."""
        if self.history:
            raise RuntimeError("restore() needs a fresh conversation")
        if len(history) >= self.max_turns:
            raise ValueError(f"a prefix of {len(history)} turns leaves no turn of {self.max_turns}")
        for i, (message, observation) in enumerate(history):
            if read_observation(observation).donation is not None:
                raise ValueError(f"turn {i} of the prefix ends the conversation (the donor decided)")
            if message is None:
                self.state.turns += 1
            else:
                respond(self.donor, self.state, message, self._rng(message))
            self.history.append((message, observation))
