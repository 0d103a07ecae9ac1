"""The environment interface: everything a stage asks of an environment, and nothing more.

Stages never name an environment: they take an `Environment` from the registry (envs/registry.py)
by `env.name` and use only what is declared here. An environment gives
- its tasks (the contexts x: a secret object, a city, a buyer profile) and their splits;
- games in Gymnasium's shape: `reset()`, then `step(text)` -> (observation, reward, terminated,
  truncated, info), the action being the agent's text as it wrote it;
- the agent's action format (`render_action` / `parse_action`);
- its oracle roles, which see the hidden state: the simulator (inside `step`), the summarizer,
  the proposer and controller, the labeler;
- the prompts of the same roles played by an LLM, each a `Request`: the chat and its parser;
- scripted behaviour policies, which bootstrap learns from;
- its reward range (Refit's fixed reward-to-weight map) and its relabel window.

Trajectories are in the chat format: `Step.observation` holds the messages that follow the
agent's own (a user message, a tool result), so an environment with tools records an assistant
tool call and a tool message where a question game records a question and its answer. A turn
record (`info["turn"]`) holds the trajectory's per-turn columns: reason, action, observation.
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, NamedTuple, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

Message = dict[str, Any]  # {role, content} (and tool_calls / tool_call_id where tools are used)
T = TypeVar("T")

# What a trajectory records for a reply with no text (the model ended at once, or its backend
# gave up on the turn): every chat message needs content (row checks and chat templates), and a
# visible marker says what happened where an empty string would read as a field left out. An
# environment plays it as an unparseable action.
EMPTY_REPLY = "(empty reply)"


def recorded_reply(text: str) -> str:
    """The text a trajectory records for an agent's reply: the reply as it is, or EMPTY_REPLY
    when it holds nothing but whitespace."""
    return text if text.strip() else EMPTY_REPLY


def _missing(where: object, what: str) -> NotImplementedError:
    return NotImplementedError(f"{type(where).__name__} has no {what}")


class Options(BaseModel):
    """An environment's own params (params.yaml `env:` beside `name`); a misspelt key is an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Task(Protocol):
    id: str  # the trajectory's task_id
    split: str


class Step(NamedTuple):
    """Gymnasium's step result. `observation`: the messages after the agent's own. `info` holds
    "message" (the agent's action as the chat records it: an assistant message, or an assistant
    tool call), "turn" (the turn's reason, action and observation, as the trajectory's turn
    columns record them), "parsed" (the text followed the action format) and "success"."""

    observation: list[Message]
    reward: float
    terminated: bool  # the task ended: a win, or a loss the rules declare (a wrong final guess)
    truncated: bool  # the turn limit ran out first
    info: dict[str, Any]


@dataclass(frozen=True)
class Request(Generic[T]):
    """One call of an LLM role: the chat to send and the parser of its reply, which raises
    ValueError saying what is wrong (the caller samples again, then records the reason)."""

    messages: list[Message]
    parse: Callable[[str], T]


class Unfinished(ValueError):
    """A role's reply that parses and says the dialogue did not finish: a forward model's
    continuation that stops before the game ends, or a labeler's "unfinished" (HR's step 1).
    It is an answer, not a fault: the caller records it with status "unfinished" and the
    reason, does not sample again, and leaves the dialogue out (HR discards them)."""


@dataclass(frozen=True)
class Counterfactual:
    """A hindsight action (HOPE's a^H, HR's replacement) in the agent's own format."""

    text: str  # the action as the agent would have written it (render_action)
    action: str  # the action alone (a question, a tool call, a reply), for comparison and the table
    reason: str  # the agent's reason, as the action states it: no hindsight
    rationale: str  # the hindsight reasoning; may use the hidden state, never enters the action


@dataclass(frozen=True)
class Label:
    """The oracle labeler's reward for a whole trajectory, or None with the reason it has none."""

    reward: float | None
    success: bool | None
    reason: str
    scores: Mapping[str, float] | None = None  # an oracle rubric judge's criteria and Overall (the labels' scores column)


class Game(ABC):
    """One episode of one task. The simulator is the environment's oracle unless `step` is handed
    an LLM simulator's answer (from `simulator_request`). Only reset, step, turn, done and
    success are required; a stage that needs more names what the game lacks."""

    task: Task
    max_turns: int
    # Games of this kind played at once without extra cost (None: any number). A simulator that
    # holds so many worlds sets it, so a rollout admits games as others end rather than all at
    # once (many more live games than worlds would make each step replay most of them).
    concurrency: int | None = None

    @abstractmethod
    def reset(self) -> tuple[list[Message], dict[str, Any]]:
        """The opening messages (system prompt, first observation) and an info dict."""

    @abstractmethod
    def step(self, text: str, answer: object | None = None) -> Step:
        """Play the agent's text. An unparseable text still costs a turn (info["parsed"] False)."""

    def message(self, text: str) -> Message:
        """The agent's text as the chat records it now (Step.info["message"]), without playing it:
        what a critic scores. A plain assistant message unless the game turns text into tool calls."""
        return {"role": "assistant", "content": text}

    def restore(self, turns: Sequence[Mapping[str, Any]]) -> None:
        """Resume a fresh game after logged turns without asking the simulator again, so a branch
        from a logged prefix keeps the observations that prefix actually got (regenerate)."""
        raise _missing(self, "restore a game from a logged prefix")

    @property
    @abstractmethod
    def turn(self) -> int:
        """Actions taken so far."""

    @property
    @abstractmethod
    def done(self) -> bool: ...

    @property
    @abstractmethod
    def success(self) -> bool: ...

    def simulator_request(self, text: str) -> Request[object] | None:
        """The LLM simulator's call for the agent's text (its parse gives `step`'s answer), or
        None when the oracle's answer stands: the text asks nothing (EMPTY_REPLY), or it is a
        move the rules answer themselves (a guess, where the rules judge guesses)."""
        raise _missing(self, "LLM simulator (roles.simulator)")

    def simulator_failed(self, text: str) -> object:
        """The answer `step` plays when the LLM simulator gave no usable reply."""
        raise _missing(self, "LLM simulator (roles.simulator)")


class Policy(Protocol):
    """A scripted behaviour policy: sees what the agent sees (never the hidden state)."""

    name: str

    def act(self, game: Game, rng: random.Random) -> str: ...


class Mixture:
    """Draws one behaviour policy per episode, with probability proportional to its weight.

    Call `for_episode(rng)` once when an episode starts and let the policy it returns play the
    whole episode. The draw takes one value from `rng`, so the choice is reproducible from the
    episode's seed; the policies keep no state between episodes and can be shared."""

    def __init__(self, weights: Mapping[str, float], policies: Mapping[str, Policy]):
        unknown = set(weights) - set(policies)
        if unknown:
            raise ValueError(f"no policy named {sorted(unknown)}; known: {sorted(policies)}")
        if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ValueError(f"weights must be >= 0 and not all zero, got {dict(weights)}")
        self.names = [n for n, w in weights.items() if w > 0]
        self.weights = [weights[n] for n in self.names]
        self.policies = dict(policies)

    def for_episode(self, rng: random.Random) -> Policy:
        return self.policies[rng.choices(self.names, weights=self.weights)[0]]


def check_noise(p_random: float, p_repeat: float, p_early_guess: float) -> None:
    """A noisy policy's probabilities: each in [0, 1], together at most 1 (the rest plays the expert)."""
    probs = (p_random, p_repeat, p_early_guess)
    if any(not 0 <= p <= 1 for p in probs) or sum(probs) > 1:
        raise ValueError(f"noise probabilities must lie in [0, 1] and sum to at most 1, got {probs}")


def fraction_window(num_turns: int, a: float, b: float) -> list[int]:
    """The 0-based turns j with a*T <= j < b*T (HOPE's relabel window)."""
    return [j for j in range(num_turns) if a * num_turns <= j < b * num_turns]


class Environment(ABC):
    """An environment: its tasks, games, action format, roles, prompts, policies and rewards.

    The abstract methods are what collect and evaluate need; the rest serve one stage or role
    each and, left out, fail with an error naming what is missing when that stage or role runs.
    `turns` below are a trajectory's turn records (dicts with reason, action, observation,
    reward), the form every stage reads back from Parquet."""

    name: ClassVar[str]  # env.name in params.yaml and the trajectories' `env` column
    Options: ClassVar[type[Options]] = Options

    def __init__(self, options: Options):
        self.options = options

    # ---- tasks and games ----

    @property
    @abstractmethod
    def splits(self) -> tuple[str, ...]: ...

    @abstractmethod
    def tasks(self, split: str) -> list[Task]:
        """The split's tasks in a fixed order (limit_tasks keeps a prefix)."""

    @abstractmethod
    def task(self, task_id: str) -> Task:
        """KeyError naming the id when there is no such task."""

    @abstractmethod
    def game(self, task: Task) -> Game: ...

    @property
    @abstractmethod
    def max_turns(self) -> int: ...

    # ---- action format ----

    @abstractmethod
    def render_action(self, reason: str, action: str) -> str: ...

    @abstractmethod
    def parse_action(self, text: str) -> tuple[str, str]:
        """(reason, action); ValueError when the text does not follow the format."""

    def same_action(self, a: str, b: str) -> bool:
        """Whether two actions are the same move (a counterfactual equal to the original is dropped)."""
        return " ".join(a.lower().split()) == " ".join(b.lower().split())

    # ---- rewards ----

    @property
    @abstractmethod
    def reward_range(self) -> tuple[float, float]:
        """The lowest and highest return; Refit's weight maps it linearly onto [0, 1]."""

    reward_bin: ClassVar[float] = 1.0  # histogram bin width on the return scale

    @abstractmethod
    def won(self, reward: float) -> bool:
        """Whether a labelled return, alone, reads as a win (the labeler's calibration)."""

    def relabel_turns(self, num_turns: int) -> list[int]:
        """The turns of a T-turn trajectory where hindsight may branch (HOPE's window)."""
        raise _missing(self, "relabel window of its own (set relabel.window)")

    # ---- scripted behaviour (bootstrap) ----

    def policies(self, noise: Mapping[str, float]) -> dict[str, Policy]:
        """The scripted behaviour policies by name; `noise` sets the imperfect ones' rates."""
        raise _missing(self, "scripted behaviour policies (bootstrap)")

    def tools(self) -> list[dict] | None:
        """The agent's tools as JSON-schema functions (OpenAI's and TRL's `tools`), or None when
        its actions are plain text. Goes into the export, for chat templates that render tools."""
        return None

    def tokenizer_corpus(self) -> list[str]:
        """Texts the bootstrap tokenizer sees besides the demonstrations (every task's names,
        every prompt a policy will read), so held-out tasks encode as compactly as trained ones."""
        return []

    def fact_sheets(self, seed: int) -> list[list[Message]]:
        """What a pretrained LLM would know about the tasks, as chats outside any game: bootstrap
        trains on them beside the demonstrations. How many is the environment's own option
        (env.facts_per_object where it has one); none by default."""
        return []

    # ---- oracle roles: they see the hidden state ----

    def oracle_version(self, role: str) -> str:
        """Recorded with each oracle output and bumped when its wording changes (caches key on it)."""
        raise _missing(self, "oracle roles")

    def summarize(self, task: Task, turns: Sequence[Mapping], success: bool) -> str:
        raise _missing(self, "oracle summarizer")

    def propose(self, task: Task, prefix: Sequence[Mapping], n: int, original: str | None = None) -> list[Counterfactual]:
        """Up to n distinct better actions after `prefix` (HOPE's pi_H). Relabeling passes the action
        the player took there as `original`; an oracle that can rank actions proposes only better
        ones (TwentyQuestions), others may ignore it."""
        raise _missing(self, "oracle proposer")

    def critique(self, task: Task, turns: Sequence[Mapping], top: int) -> list[tuple[int, Counterfactual]]:
        """HR's hindsight controller: the `top` turns to improve, each with its replacement."""
        raise _missing(self, "oracle controller")

    def label(self, task_id: str, turns: Sequence[Mapping]) -> Label:
        """The return, recomputed by replaying the actions (a logged return is not trusted); a
        task id the environment does not know is a Label without a reward, not an error."""
        raise _missing(self, "oracle labeler")

    # ---- the same roles played by an LLM ----

    def prompt_hash(self, role: str) -> str:
        """Content hash of the prompt templates `role` renders: rows record it, so a reworded prompt shows."""
        raise _missing(self, "LLM role prompts")

    def summary_request(self, task: Task, turns: Sequence[Mapping], success: bool) -> Request[str]:
        raise _missing(self, "LLM summarizer prompt")

    def proposer_request(self, task: Task, prefix: Sequence[Mapping], n: int, summary: str) -> Request[list[Counterfactual]]:
        raise _missing(self, "LLM proposer prompt")

    def proposer_reply(self, proposals: Sequence[Counterfactual]) -> str:
        """The reply to `proposer_request` that its parser reads back as `proposals`: a proposer's
        counterfactuals as a model's training target (the distilled proposer, tasks/proposer.py)."""
        raise _missing(self, "LLM proposer reply format")

    def controller_request(self, task: Task, turns: Sequence[Mapping], top: int) -> Request[list[tuple[int, Counterfactual]]]:
        raise _missing(self, "LLM controller prompt")

    def forward_request(self, game: Game) -> Request[list[tuple[str, object]]]:
        """HR's forward model: the rest of `game`, both sides, as (agent text, simulator answer)
        pairs to step with; the parser checks that the game ends exactly at the last pair."""
        raise _missing(self, "LLM forward-model prompt")

    def forward_reply(self, game: Game, turns: Sequence[Mapping]) -> str:
        """The reply to `forward_request(game)` that its parser reads back as the logged `turns`
        that followed (turn records, as trajectories hold them): a logged dialogue's rest as a
        forward model's training target (the learned forward model, tasks/forward.py)."""
        raise _missing(self, "LLM forward-model reply format")

    def labeler_request(self, turns: Sequence[Mapping], examples: Sequence[tuple[Sequence[Mapping], float]]) -> Request[float]:
        """HR's few-shot labeler: labelled (turns, return) examples, then the trajectory."""
        raise _missing(self, "LLM labeler prompt")

    def finished_request(self, turns: Sequence[Mapping], examples: Sequence[tuple[Sequence[Mapping], float]]) -> Request[bool] | None:
        """HR's two-step labeler, step 1: is the dialogue finished (True) or not (False)? None
        (the default): the environment's few-shot labeler is one call, `labeler_request`."""
        return None

    def amount_request(self, turns: Sequence[Mapping], examples: Sequence[tuple[Sequence[Mapping], float]]) -> Request[float]:
        """HR's two-step labeler, step 2, asked only of a dialogue step 1 found finished: its reward."""
        return self.labeler_request(turns, examples)

    def judge_request(self, task_id: str, turns: Sequence[Mapping]) -> Request[dict[str, float]]:
        """Refit's rubric judge: criteria scored 0-10 and "Overall"."""
        raise _missing(self, "LLM judge prompt")

    # ---- NLAC's language critic, backup and refiner (envs/nlac.py) ----

    def oracle_critique(self, task: Task, turns: Sequence[Mapping], text: str):
        """NLAC's oracle critic: an envs.nlac.Critique of the agent's text after the logged turns."""
        raise _missing(self, "oracle language critic (roles.language_critic)")

    def oracle_backup(self, task: Task, turns: Sequence[Mapping], turn: Mapping, terminal: bool, final_return: float):
        """NLAC's oracle backup: the Critique that is L1's target for a logged transition, the turn
        record `turn` played after `turns` (its observation the one it got); a terminal one's
        future is grounded in the game's outcome and return."""
        raise _missing(self, "oracle language-critic backup (roles.backup)")

    def critic_request(self, state: Sequence[Message], action: Message) -> Request:
        raise _missing(self, "NLAC critic prompt")

    def future_request(self, state: Sequence[Message], action: Message, observation: Sequence[Message]) -> Request[str]:
        raise _missing(self, "NLAC bootstrap prompt")

    def target_request(self, state: Sequence[Message], action: Message, observation: Sequence[Message], future: str | None, reward: float,
                       terminal: bool) -> Request:
        raise _missing(self, "NLAC backup prompt")

    def refine_request(self, state: Sequence[Message], action: Message, critique: str) -> Request[str]:
        raise _missing(self, "NLAC refinement prompt")
