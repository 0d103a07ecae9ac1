"""Persuasion (HR's donation setting) behind the environment interface (envs/base.py): a
persuader for Save the Children talks with a donor who may give part of a $2 task payment, at
most 10 messages, the reward being the donation in [0, 2] at the end. The donor is the oracle
(donor.py, reacting to the strategies strategies.py recognises) or an LLM donor; the tasks are
donor profiles of HR's four personas (donors.py); the persuader writes REASON/MESSAGE
(format.py); scripted persuaders in policies.py, oracle roles in roles.py, LLM roles' prompts in
llm_roles.py."""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from pydantic import Field

from envs.base import EMPTY_REPLY, Counterfactual, Environment, Label, Options, Policy, Request, Step, fraction_window
from envs.base import Game as BaseGame

from . import llm_roles, roles
from .donor import DonorReply
from .donors import SPLITS, Donor, load_donors
from .format import ActionParseError, final_message, invalid_observation, observation_message, parse_action, render_action, system_prompt
from .game import MAX_TURNS, Conversation
from .policies import LINES, Expert, Noisy, PersuaderView, Pushy, Random


class PersuasionOptions(Options):
    max_turns: int = Field(MAX_TURNS, ge=1, le=50)  # HR: at most 10 messages each side


class PersuasionGame(BaseGame):
    def __init__(self, env: Persuasion, task: Donor):
        self.env, self.task, self.max_turns = env, task, env.max_turns
        self.state = Conversation(task, env.max_turns)

    turn = property(lambda self: self.state.turn)
    done = property(lambda self: self.state.done)
    success = property(lambda self: bool(self.state.donation))

    def reset(self):
        return [
            {"role": "system", "content": system_prompt(self.max_turns)},
            {"role": "user", "content": observation_message(None, 0, self.max_turns)},
        ], {}

    @staticmethod
    def read(text: str) -> tuple[str, str | None, str | None]:
        """(reason, message or None, why it did not parse)."""
        try:
            reason, message = parse_action(text)
            return reason, message, None
        except ActionParseError as e:
            return "", None, str(e)

    def step(self, text: str, answer: DonorReply | None = None) -> Step:
        reason, message, why = self.read(text)
        reply, reward = self.state.step(message, answer if message is not None else None)
        observation = reply.observation()
        if message is None:
            observation = "\n".join(x for x in (invalid_observation(why), observation) if x)
        s = self.state
        content = final_message(observation, s.donation) if s.done else observation_message(observation, s.turn, self.max_turns)
        info = {
            "message": {"role": "assistant", "content": text},
            "turn": {"reason": reason, "action": message if message is not None else " ".join(text.split()), "observation": observation},
            "parsed": message is not None,
            "success": self.success,
        }
        # The donor committing or leaving ends the task (terminated); the turns running out, with the
        # decision the donor must then state, truncates it.
        return Step([{"role": "user", "content": content}], reward, s.done and s.ended_by_donor, s.done and not s.ended_by_donor, info)

    def restore(self, turns) -> None:
        self.state.restore(roles.history(turns))

    def view(self) -> PersuaderView:
        return PersuaderView(list(self.state.history), self.state.turn, self.max_turns)

    def simulator_request(self, text: str) -> Request[DonorReply] | None:
        message = self.read(text)[1]
        if text == EMPTY_REPLY or message is None:
            return None  # nothing was said: the rules answer (the donor heard nothing)
        last = self.state.turn + 1 >= self.max_turns
        prompt = llm_roles.chat("simulator.j2", donor=self.task, persona=llm_roles.PERSONA_TEXT[self.task.persona],
                                dialogue=llm_roles.dialogue(self.state.history), message=message, last=last)
        return Request(prompt, llm_roles.parse_donor)

    def simulator_failed(self, text: str) -> DonorReply:
        return DonorReply("(the donor did not answer)")  # on the last turn the game adds the oracle's decision


class Scripted:
    """A scripted persuader (policies.py) acting on a game in the action format."""

    def __init__(self, policy):
        self.policy, self.name = policy, policy.name

    def act(self, game: PersuasionGame, rng: random.Random) -> str:
        return render_action(*self.policy.act(game.view(), rng))


class Persuasion(Environment):
    name = "persuasion"
    Options = PersuasionOptions
    options: PersuasionOptions
    splits = SPLITS
    reward_bin = 0.25

    def __init__(self, options: PersuasionOptions):
        super().__init__(options)
        self.donors = load_donors()

    @property
    def max_turns(self) -> int:
        return self.options.max_turns

    def tasks(self, split: str) -> list[Donor]:
        if split not in SPLITS:
            raise KeyError(f"unknown split {split!r}; expected one of {list(SPLITS)}")
        return [d for d in self.donors.values() if d.split == split]

    def task(self, task_id: str) -> Donor:
        try:
            return self.donors[task_id]
        except KeyError:
            raise KeyError(f"unknown persuasion donor {task_id!r}") from None

    def game(self, task: Donor) -> PersuasionGame:
        return PersuasionGame(self, task)

    def conversation(self, task: Donor, prefix: Sequence[Mapping] = ()) -> Conversation:
        return roles.conversation(task, self.max_turns, prefix)

    # ---- action format ----

    def render_action(self, reason: str, action: str) -> str:
        return render_action(reason, action)

    def parse_action(self, text: str) -> tuple[str, str]:
        return parse_action(text)

    # ---- rewards: the donation, at the end ----

    @property
    def reward_range(self) -> tuple[float, float]:
        return 0.0, 2.0

    def won(self, reward: float) -> bool:
        return reward > 0  # the donor gave something

    def relabel_turns(self, num_turns: int) -> list[int]:
        # Every turn but the first greeting: a persuasion can be lost (pressure, a premature ask)
        # or won (the ask) at any point, and the conversations are short.
        return fraction_window(num_turns, 0.1, 1.0) if num_turns > 1 else [0]

    # ---- scripted behaviour ----

    def policies(self, noise: Mapping[str, float]) -> dict[str, Policy]:
        return {
            "expert": Scripted(Expert()),
            "noisy": Scripted(Noisy(**noise)),
            "pushy": Scripted(Pushy()),
            "random": Scripted(Random()),
        }

    def tokenizer_corpus(self) -> list[str]:
        return [system_prompt(self.max_turns), *(line for lines in LINES.values() for line in lines), *llm_roles.donor_phrases()]

    # ---- oracle roles ----

    def oracle_version(self, role: str) -> str:
        return roles.VERSIONS[role]

    def summarize(self, task: Donor, turns, success: bool) -> str:
        return roles.summarize(task, self.max_turns, turns)

    def propose(self, task: Donor, prefix, n: int, original: str | None = None) -> list[Counterfactual]:
        return roles.propose(self.conversation(task, prefix), n)

    def critique(self, task: Donor, turns, top: int) -> list[tuple[int, Counterfactual]]:
        return roles.critique(task, self.max_turns, turns, top)

    def label(self, task_id: str, turns) -> Label:
        if task_id not in self.donors:
            return Label(None, None, f"task {task_id!r} is not a persuasion donor")
        return roles.label(self.donors[task_id], self.max_turns, turns)

    # ---- LLM roles ----

    def prompt_hash(self, role: str) -> str:
        return llm_roles.template_hash(*llm_roles.TEMPLATES[role])

    def summary_request(self, task: Donor, turns, success: bool) -> Request[str]:
        return llm_roles.summary_request(task, self.max_turns, turns)

    def proposer_request(self, task: Donor, prefix, n: int, summary: str) -> Request[list[Counterfactual]]:
        return llm_roles.proposer_request(task, self.max_turns, prefix, n, summary)

    def proposer_reply(self, proposals: Sequence[Counterfactual]) -> str:
        return llm_roles.proposal_reply(proposals)

    def controller_request(self, task: Donor, turns, top: int) -> Request[list[tuple[int, Counterfactual]]]:
        return llm_roles.controller_request(task, turns, top)

    def forward_request(self, game: PersuasionGame) -> Request[list[tuple[str, DonorReply]]]:
        return llm_roles.forward_request(game.state)

    def forward_reply(self, game: PersuasionGame, turns) -> str:
        return llm_roles.continuation_reply(turns)

    def labeler_request(self, turns, examples) -> Request[float]:
        return llm_roles.labeler_request(turns, examples)

    def finished_request(self, turns, examples) -> Request[bool]:
        """HR's labeler, step 1 alone: is the dialogue finished (a decision stated)?"""
        return llm_roles.finished_request(turns, examples)

    def amount_request(self, turns, examples) -> Request[float]:
        """HR's labeler, step 2 alone: the donation of a finished dialogue."""
        return llm_roles.amount_request(turns, examples)

    def judge_request(self, task_id: str, turns) -> Request[dict[str, float]]:
        return llm_roles.judge_request(self.task(task_id), turns)
