"""CarDealer behind the environment interface (envs/base.py): HOPE's tool-use dealership (game.py)
with the oracle or an LLM buyer, HOPE's action formats (format.py), reward (reward.py), scripted
sellers (policies.py), oracle roles (roles.py) and LLM roles' prompts (llm_roles.py).

One seller turn is two actions, each one step and one assistant message, so that the seller writes
its reply having seen what its call found, as in HOPE (two prompts a turn). In the chat:

    assistant  the call as written, with `tool_calls` [{id, type: function, function: {name, arguments}}]
    tool       what the database showed (`tool_call_id`, `name`)
    assistant  the reply as written (REASON, RESPONSE, CAR INDEX, the copied car)
    user       the buyer's answer (and its decision when it ends the game)

`arguments` is a JSON object, as transformers' chat templates and TRL's tool-calling data take it
(OpenAI's wire format would carry the same object as a string). The content of the assistant's
call is the text the seller wrote, so a model trained on the chat learns to write the action
format this game parses, and a tool-aware template sees the structured call beside it.
"""
from __future__ import annotations

import functools
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import jinja2
from pydantic import Field

from envs.base import EMPTY_REPLY, Counterfactual, Environment, Label, Options, Policy, Request, Step, recorded_reply
from envs.base import Game as BaseGame

from . import llm_roles, roles
from .buyer import COULD_NOT_RESPOND, BuyerReply, check_buyer_types, parse_buyer, strategy
from .data import SPLITS, Buyer, inventory_for, load_buyers, load_catalog
from .format import ActionParseError, Reply, api_body, is_api, parse, parse_api, parse_reply, render, reply_body
from .game import MAX_TURNS, Dealership, Rules
from .policies import Expert, Noisy, Random, SellerView, view
from .reward import reward_range, sale_threshold
from .tools import ApiCall, tool_schemas

_TEMPLATES = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "prompts"),
                                undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, autoescape=False)


def _render(name: str, **context: object) -> str:
    return _TEMPLATES.get_template(name).render(**context).strip()


class CarDealerOptions(Options):
    max_turns: int = Field(MAX_TURNS, ge=1, le=50)  # seller turns (HOPE: 10), each two actions
    # paper (default): an invalid sale scores 0 and is no success, and no sale by the end (a
    # timeout too) costs the penalty; code: agent_prm's compute_reward (reward.py has the table)
    reward_rule: Literal["paper", "code"] = "paper"
    max_cars_shown: int | None = Field(8, ge=1)  # the paper's cap on a result; null shows every car found
    # agent_prm's type-6 buyer "buys" when neither type nor price fits (no car included); off:
    # it negotiates, as its strategy text reads (buyer.py)
    type6_quirk: bool = False


def _action(body: str) -> ApiCall | Reply:
    """A turn record's action back as what the game plays."""
    text = render("", body)
    return parse_api(text).call if is_api(text) else parse_reply(text)


class CarDealerGame(BaseGame):
    def __init__(self, env: CarDealer, task: Buyer):
        self.env, self.task, self.max_turns = env, task, env.max_turns
        self.state = Dealership(task, inventory_for(task), env.rules)

    turn = property(lambda self: self.state.actions)
    done = property(lambda self: self.state.done)
    success = property(lambda self: self.state.success)

    def reset(self):
        return [
            {"role": "system", "content": self.env.system_prompt()},
            {"role": "user", "content": _render("opening.j2")},
        ], {}

    def read_reply(self, text: str) -> tuple[Reply, bool]:
        """The reply and whether it followed the format. An unparseable reply is heard as it is,
        as a sloppy seller would be, and proposes no car."""
        try:
            return parse_reply(text), True
        except ActionParseError:
            return Reply("", " ".join(recorded_reply(text).split()), 0, None), False

    def step(self, text: str, answer: BuyerReply | None = None) -> Step:
        if self.state.phase == "api":
            return self._call(text)
        reply, parsed = self.read_reply(text)
        said, reward = self.state.answer(reply, answer)
        info = {
            "message": {"role": "assistant", "content": text},
            "turn": {"reason": reply.reason, "action": reply_body(reply.response, reply.car_index, reply.copied), "observation": said.observation()},
            "parsed": parsed,
            "success": self.state.success,
        }
        s = self.state
        return Step([{"role": "user", "content": said.observation()}], reward, s.done and not s.timed_out, s.timed_out, info)

    def _parse_call(self, text: str):
        # An unparseable call, or an unknown API, is a no_op (agent_prm's parser does the same).
        try:
            action = parse_api(text)
        except ActionParseError:
            return None, ApiCall("no_op")
        return action, action.call

    def message(self, text: str) -> dict:
        if self.state.phase != "api":
            return super().message(text)
        call = self._parse_call(text)[1]
        return {"role": "assistant", "content": text, "tool_calls": [
            {"id": f"call_{len(self.state.turns) + 1}", "type": "function", "function": {"name": call.name, "arguments": call.arguments()}}]}

    def _call(self, text: str) -> Step:
        message = self.message(text)  # before the call adds its turn: the id counts it (call_1 is the first)
        action, call = self._parse_call(text)
        shown = self.state.call(call)
        call_id = message["tool_calls"][0]["id"]
        info = {
            "message": message,
            "turn": {"reason": action.reason if action else "", "action": api_body(call), "observation": shown},
            "parsed": action is not None,
            "success": False,
        }
        return Step([{"role": "tool", "tool_call_id": call_id, "name": call.name, "content": shown}], 0.0, False, False, info)

    def restore(self, turns) -> None:
        self.state.restore([(_action(t["action"]), t["observation"]) for t in turns])

    def view(self) -> SellerView:
        return view(self.state)

    def simulator_request(self, text: str) -> Request[BuyerReply] | None:
        """The LLM buyer's call for a reply; None for a call (the database answers it) or an empty reply."""
        if self.state.phase == "api" or text == EMPTY_REPLY:
            return None
        reply = self.read_reply(text)[0]
        s = self.state.situation(reply)
        seen = [t for t in self.state.turns if t.answer is not None][1:]  # HOPE hides the first exchange from the buyer
        prompt = llm_roles.chat(
            "simulator.j2", buyer=self.task, history=[(t.reply.response, t.answer.answer) for t in seen],
            message=reply.response, car=s.car, checks=s.checks, strategy=strategy(self.task, s.mode), first=s.mode == "initial",
        )
        return Request(prompt, parse_buyer)

    def simulator_failed(self, text: str) -> BuyerReply:
        return BuyerReply(COULD_NOT_RESPOND, None)


class Scripted:
    """A scripted seller (policies.py) acting on a game."""

    def __init__(self, policy):
        self.policy, self.name = policy, policy.name

    def act(self, game: CarDealerGame, rng: random.Random) -> str:
        return self.policy.act(game.view(), rng)


class CarDealer(Environment):
    name = "car_dealer"
    Options = CarDealerOptions
    options: CarDealerOptions
    splits = SPLITS

    def __init__(self, options: CarDealerOptions):
        super().__init__(options)
        check_buyer_types()
        self.catalog = load_catalog()
        self.buyers = {b.id: b for b in load_buyers()}
        self.rules = Rules(options.max_turns, options.max_cars_shown, options.reward_rule, options.type6_quirk)

    @property
    def max_turns(self) -> int:
        """Actions per game: two a seller turn."""
        return 2 * self.options.max_turns

    def tasks(self, split: str) -> list[Buyer]:
        if split not in SPLITS:
            raise KeyError(f"unknown split {split!r}; expected one of {list(SPLITS)}")
        return [b for b in self.buyers.values() if b.split == split]

    def task(self, task_id: str) -> Buyer:
        try:
            return self.buyers[task_id]
        except KeyError:
            raise KeyError(f"unknown CarDealer buyer {task_id!r}") from None

    def game(self, task: Buyer) -> CarDealerGame:
        return CarDealerGame(self, task)

    def system_prompt(self) -> str:
        c = self.catalog
        return _render("agent_system.j2", max_turns=self.options.max_turns, brands=c.brands, types=c.types, features=c.features)

    def tools(self) -> list[dict]:
        """The database APIs as JSON-schema tools (an export's `tools` column for TRL)."""
        return tool_schemas(self.catalog)

    def dealership(self, task: Buyer, prefix: Sequence[Mapping] = ()) -> Dealership:
        """A game of `task` after the logged turns `prefix` (their buyer answers stand)."""
        state = Dealership(task, inventory_for(task), self.rules)
        state.restore([(_action(t["action"]), t["observation"]) for t in prefix])
        return state

    # ---- action format ----

    def render_action(self, reason: str, action: str) -> str:
        return render(reason, action)

    def parse_action(self, text: str) -> tuple[str, str]:
        return parse(text)

    def same_action(self, a: str, b: str) -> bool:
        return roles.move(a) == roles.move(b)

    # ---- rewards ----

    @functools.cached_property
    def _range(self) -> tuple[float, float]:
        return reward_range((b, inventory_for(b)) for b in self.buyers.values())

    @property
    def reward_range(self) -> tuple[float, float]:
        return self._range

    reward_bin = 0.25

    @functools.cached_property
    def _sale_threshold(self) -> float:
        return sale_threshold(self.buyers.values())

    def won(self, reward: float) -> bool:
        return reward > self._sale_threshold

    def relabel_turns(self, num_turns: int) -> list[int]:
        """HOPE's window [2, T-1] over T seller turns (0-based, both ends in): the call and the
        reply of each of those turns, so API and reply counterfactuals are both proposed."""
        seller_turns = (num_turns + 1) // 2
        return [a for j in range(2, seller_turns) for a in (2 * j, 2 * j + 1) if a < num_turns]

    # ---- scripted behaviour ----

    def policies(self, noise: Mapping[str, float]) -> dict[str, Policy]:
        return {
            "expert": Scripted(Expert(self.catalog)),
            "noisy": Scripted(Noisy(self.catalog, **noise)),
            "random": Scripted(Random(self.catalog)),
        }

    def tokenizer_corpus(self) -> list[str]:
        c = self.catalog
        return [self.system_prompt(), *c.brands, *c.types, *c.features]

    # ---- oracle roles ----

    def oracle_version(self, role: str) -> str:
        return roles.VERSIONS[role]

    def summarize(self, task: Buyer, turns, success: bool) -> str:
        return roles.summarize(self.dealership(task, turns))

    def propose(self, task: Buyer, prefix, n: int, original: str | None = None) -> list[Counterfactual]:
        return roles.propose(self.catalog, self.dealership(task, prefix), n)

    def critique(self, task: Buyer, turns, top: int) -> list[tuple[int, Counterfactual]]:
        return roles.critique(self.catalog, lambda k: self.dealership(task, turns[:k]), [t["action"] for t in turns], top)

    def label(self, task_id: str, turns) -> Label:
        if task_id not in self.buyers:
            return Label(None, None, f"task {task_id!r} is not a CarDealer buyer")
        return roles.label(Dealership(self.buyers[task_id], inventory_for(self.buyers[task_id]), self.rules), turns)

    # ---- LLM roles ----

    def prompt_hash(self, role: str) -> str:
        return llm_roles.template_hash(*llm_roles.TEMPLATES[role])

    def summary_request(self, task: Buyer, turns, success: bool) -> Request[str]:
        state = self.dealership(task, turns)
        return Request(llm_roles.summary_prompt(self.catalog, state), llm_roles.parse_summary)

    def proposer_request(self, task: Buyer, prefix, n: int, summary: str) -> Request[list[Counterfactual]]:
        state = self.dealership(task, prefix)
        return Request(llm_roles.proposer_prompt(self.catalog, state, n, summary), lambda text: llm_roles.parse_proposals(text, state, n))

    def proposer_reply(self, proposals: Sequence[Counterfactual]) -> str:
        return llm_roles.proposal_reply(proposals)

    def controller_request(self, task: Buyer, turns, top: int) -> Request[list[tuple[int, Counterfactual]]]:
        state = self.dealership(task, turns)
        return Request(llm_roles.controller_prompt(state, top), lambda text: llm_roles.parse_controller(text, lambda k: self.dealership(task, turns[:k]), len(turns), top))

    def forward_request(self, game: CarDealerGame) -> Request[list[tuple[str, BuyerReply | None]]]:
        # Each parse (a retry included) replays from the game as it is now, whatever happens to it later.
        start = game.state.fork()
        return Request(llm_roles.forward_prompt(self.catalog, start), lambda text: llm_roles.parse_continuation(text, start.fork()))

    def forward_reply(self, game: CarDealerGame, turns) -> str:
        return llm_roles.continuation_reply(game.state, turns)

    def labeler_request(self, turns, examples) -> Request[float]:
        low, high = self.reward_range
        return Request(llm_roles.labeler_prompt(turns, examples, low, high), lambda text: llm_roles.parse_reward(text, low, high))

    def judge_request(self, task_id: str, turns) -> Request[dict[str, float]]:
        return Request(llm_roles.judge_prompt(self.dealership(self.task(task_id), turns)), llm_roles.parse_rubric)
