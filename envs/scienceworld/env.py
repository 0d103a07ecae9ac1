"""ScienceWorld (Wang et al. 2022; StepAgent's and ETO's benchmark) behind the environment
interface (envs/base.py), on the real simulator of the `scienceworld` package (simulator.py: a
pool of JVMs, needing a Java runtime).

- Tasks: (task type, variation), id `<task type>-<variation>` (`find-animal-17`); the simulator's
  train / dev / test variations are our train / val / test (tables.py), as ETO's seen dev
  and unseen test variations. `task_types` picks the types.
- Turns: ETO's ReAct (`Thought: ...` then `Action: ...`, format.py); a text that does not follow
  it spends its step without asking the world. Each task type has a step limit (`max_steps`).
- Reward: the simulator's score, 0 to 100 (negative when a wrong focus fails the task), over 100.
  Each step is rewarded with the change of the score it credits, so an episode's return is the
  credited score / 100: `score: final` credits the last score (a failed task: 0), as StepAgent
  reports; `score: best` the best score the episode reached, as ETO's evaluation code keeps it.
  `success`: the task completed at score 100.
- Scripted agents (policies.py): the expert plays the gold path; noisy and random ones for
  bootstrap's mixture. The oracle labeler replays the actions on the simulator.
- Oracle hindsight roles (roles.py: summarizer, proposer, controller) read a trajectory's turns
  against what the simulator tells of the task (its description, start room and gold path: one
  load per task, kept); their LLM prompts (summarizer, proposer) are in llm_roles.py.
- Relabel window: every turn; the proposer names no action where the turn followed the gold path.
"""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator

from envs.base import Counterfactual, Environment, Label, Options, Policy, Request, Step, fraction_window
from envs.base import Game as BaseGame

from . import llm_roles, roles, simulator
from .format import (
    INVALID,
    ActionParseError,
    ending,
    first_message,
    invalid_observation,
    observation_message,
    parse_action,
    render_action,
    system_prompt,
)
from .policies import THOUGHTS, Expert, Noisy, Random, thought
from .tables import DEFAULT_TASK_TYPES, SPLITS, table

# Step limits per task type: ETO's (eval_agent/data/sciworld/max_steps.json). ETO gives none for
# the six types it leaves out; theirs are twice the gold path of variation 0, rounded up to tens.
# Where the gold path of variation 0 is longer than ETO's limit (grow-fruit 77 of 60, grow-plant
# 63 of 30, identify-life-stages-1 41 of 30) the expert cannot finish: raise it in max_steps.
STEP_LIMITS = {
    "boil": 100, "change-the-state-of-matter-of": 80, "freeze": 80, "melt": 80,
    "measure-melting-point-known-substance": 120, "use-thermometer": 30,
    "power-component": 20, "power-component-renewable-vs-nonrenewable-energy": 30,
    "test-conductivity": 30, "test-conductivity-of-unknown-substances": 30,
    "find-animal": 15, "find-living-thing": 15, "find-non-living-thing": 15, "find-plant": 15,
    "grow-fruit": 60, "grow-plant": 30, "chemistry-mix": 60,
    "chemistry-mix-paint-secondary-color": 15, "chemistry-mix-paint-tertiary-color": 30,
    "lifespan-longest-lived": 10, "lifespan-longest-lived-then-shortest-lived": 12, "lifespan-shortest-lived": 10,
    "identify-life-stages-1": 30, "identify-life-stages-2": 30,
    "inclined-plane-determine-angle": 110, "inclined-plane-friction-named-surfaces": 110,
    "inclined-plane-friction-unnamed-surfaces": 360, "measure-melting-point-unknown-substance": 70,
    "mendelian-genetics-known-plant": 300, "mendelian-genetics-unknown-plant": 300,
}
SIMPLIFICATIONS = ("easy", "teleportAction", "selfWateringFlowerPots", "openContainers", "openDoors", "noElectricalAction")
LABELER_VERSION = "scienceworld-replay-1"
ORACLE_VERSIONS = {**roles.VERSIONS, "labeler": LABELER_VERSION}


def _known(names) -> list[str]:
    unknown = [n for n in names if n not in table()]
    if unknown:
        raise ValueError(f"unknown task type(s) {unknown}; ScienceWorld's are: {', '.join(table())}")
    return list(names)


class ScienceWorldOptions(Options):
    task_types: tuple[str, ...] = DEFAULT_TASK_TYPES  # which task types' variations are the tasks
    max_steps: dict[str, int] = {}  # step limits by task type, over STEP_LIMITS (ETO's)
    simplifications: str = "easy"  # the simulator's, comma-separated; ETO's "easy": teleport, open doors and containers
    # The history knob: each observation's words in the policy's chat (null: whole, as ETO).
    # The trajectory's turn records keep every observation whole.
    observation_words: int | None = Field(None, ge=1)
    score: Literal["final", "best"] = "final"  # the return: the last score (StepAgent) or the best reached (ETO's code)
    simulators: int = Field(1, ge=1)  # JVMs in this process's pool
    worlds: int = Field(64, ge=1)  # worlds (games held at once) per JVM; beyond, games replay to get theirs back
    call_timeout: float = Field(60.0, gt=0)  # seconds a simulator call may take before its JVM is killed
    restarts: int = Field(2, ge=0)  # JVM deaths an episode survives (replayed on another); past that, an error

    @field_validator("task_types")
    @classmethod
    def _types(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("name at least one task type")
        if len(set(v)) != len(v):
            raise ValueError(f"a task type is named twice: {list(v)}")
        return tuple(_known(v))

    @field_validator("max_steps")
    @classmethod
    def _limits(cls, v: dict[str, int]) -> dict[str, int]:
        _known(v)
        if bad := {k: n for k, n in v.items() if n < 1}:
            raise ValueError(f"step limits must be >= 1: {bad}")
        return v

    @field_validator("simplifications")
    @classmethod
    def _simplifications(cls, v: str) -> str:
        if bad := [s for s in v.split(",") if s and s not in SIMPLIFICATIONS]:
            raise ValueError(f"unknown simplification(s) {bad}; the simulator's are: {', '.join(SIMPLIFICATIONS)}")
        return v


@dataclass(frozen=True)
class Task:
    task_type: str
    variation: int
    split: str

    @property
    def id(self) -> str:
        return f"{self.task_type}-{self.variation}"


class ScienceWorldGame(BaseGame):
    """One episode: the simulator's world for the task (borrowed from the pool), the actions sent,
    and the score as the game credits it."""

    def __init__(self, env: ScienceWorld, task: Task):
        self.env, self.task = env, task
        self.max_turns = env.step_limit(task.task_type)
        self.concurrency = env.settings.simulators * env.settings.worlds
        self.sim = simulator.Episode(env.pool, task.task_type, task.variation, task.id)
        self.history: list[tuple[str | None, str]] = []  # (action sent, or None when it did not parse; observation)
        self.score = 0  # the simulator's last score
        self.credited = 0  # the points the rewards so far add up to
        self.completed = False

    turn = property(lambda self: len(self.history))
    success = property(lambda self: self.completed and self.score >= 100)

    @property
    def done(self) -> bool:
        return self.ended or self.turn >= self.max_turns

    @property
    def ended(self) -> bool:
        """The simulator ended the task: completed, or failed (a negative score)."""
        return self.completed or self.score < 0

    @property
    def sent(self) -> list[str]:
        """The actions the world was asked, in order."""
        return [a for a, _ in self.history if a is not None]

    def reset(self):
        description, first = self.sim.start()
        return [
            {"role": "system", "content": system_prompt(self.max_turns, self.env.options.simplifications)},
            {"role": "user", "content": first_message(description, first, self.env.options.observation_words)},
        ], {"task_description": description}

    def _credit(self, score: int) -> int:
        if self.env.options.score == "best":
            return max(self.credited, score)
        return max(score, 0)

    def advance(self, action: str | None, why: str = "") -> tuple[str, float]:
        """Play one step: an action for the world, or None (a text that did not parse: `why`).
        Returns the observation and the step's reward."""
        if self.done:
            raise RuntimeError(f"the episode of {self.task.id} is over; start a new one")
        if action is None:
            observation = invalid_observation(why)
        else:
            observation, self.score, completed = self.sim.step(action)
            self.completed = self.completed or completed
        self.history.append((action, observation))
        credited, self.credited = self.credited, self._credit(self.score)
        if self.done:
            self.sim.close()  # the world goes back to the pool
        return observation, (self.credited - credited) / 100

    def step(self, text: str, answer: object | None = None) -> Step:
        try:
            reason, action = parse_action(text)
            why = ""
        except ActionParseError as e:
            reason, action, why = "", None, str(e)
        observation, reward = self.advance(action, why)
        end = ending(self.score, self.completed, not self.ended) if self.done else None
        content = observation_message(observation, self.env.options.observation_words, end)
        info = {
            "message": {"role": "assistant", "content": text},
            "turn": {"reason": reason, "action": action if action is not None else " ".join(text.split()), "observation": observation},
            "parsed": action is not None,
            "success": self.success,
        }
        return Step([{"role": "user", "content": content}], reward, self.ended, self.done and not self.ended, info)

    def restore(self, turns: Sequence[Mapping]) -> None:
        """Resume after logged turns: their observations stand, and the world replays their
        actions when it is next asked (a turn whose observation is the invalid-action note sent
        nothing). The prefix must leave the episode running."""
        if self.history:
            raise RuntimeError("restore() needs a fresh game")
        if len(turns) >= self.max_turns:
            raise ValueError(f"a prefix of {len(turns)} turns leaves no step of {self.max_turns}")
        points = 0.0
        actions, scores = [], []
        for t in turns:
            points += 100 * float(t.get("reward", 0.0))
            sent = not str(t["observation"]).startswith(INVALID)
            self.history.append((t["action"] if sent else None, t["observation"]))
            if sent:
                actions.append(t["action"])
                scores.append(round(points))
        self.credited = self.score = round(points)
        # Under `score: final` the credited points are the simulator's score at each step (a
        # prefix never holds the failing one), so the replay is checked against them.
        self.sim.replayed(actions, scores if self.env.options.score == "final" else [None] * len(scores))

    def gold_path(self) -> list[str]:
        """The simulator's gold action sequence for this task (the expert's path)."""
        return self.sim.gold_path()

    @property
    def doors_open(self) -> bool:
        return self.env.doors_open

    def valid_actions(self) -> list[str]:
        """The simulator's valid actions in the world's state now."""
        return self.sim.valid_actions()


class Scripted:
    def __init__(self, policy):
        self.policy, self.name = policy, policy.name

    def act(self, game: ScienceWorldGame, rng: random.Random) -> str:
        return self.policy.act(game, rng)


class ScienceWorld(Environment):
    name = "scienceworld"
    Options = ScienceWorldOptions
    options: ScienceWorldOptions
    splits = tuple(SPLITS)
    reward_bin = 0.1

    def __init__(self, options: ScienceWorldOptions):
        super().__init__(options)
        o = options
        self.settings = simulator.Settings(o.simplifications, o.simulators, o.worlds, o.call_timeout, o.restarts)
        self._pool: simulator.Pool | None = None
        self._known: dict[str, roles.Known] = {}

    @property
    def pool(self) -> simulator.Pool:
        """The process's simulator pool for these settings; no JVM starts before a game needs one."""
        if self._pool is None or self._pool.closed:
            self._pool = simulator.pool_for(self.settings)
        return self._pool

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pool": None}  # another process starts its own pool (see simulator.Episode)

    def use_pool(self, pool: simulator.Pool) -> None:
        """Play on another pool (tests: a recorded simulator, record.Recorded)."""
        self._pool = pool

    def step_limit(self, task_type: str) -> int:
        return self.options.max_steps.get(task_type, STEP_LIMITS[task_type])

    def _simplified(self, *names: str) -> bool:
        return bool(set(names) & set(self.options.simplifications.split(",")))

    @property
    def doors_open(self) -> bool:
        """The world's doors start open (the `easy` or `openDoors` simplification)."""
        return self._simplified("easy", "openDoors")

    @property
    def teleport(self) -> bool:
        """The agent may teleport (the `easy` or `teleportAction` simplification)."""
        return self._simplified("easy", "teleportAction")

    def known(self, task: Task) -> roles.Known:
        """What the simulator tells of the task before any action (its description, start room and
        gold path): one load of the task, kept for this environment object."""
        if task.id not in self._known:
            ep = simulator.Episode(self.pool, task.task_type, task.variation, task.id)
            try:
                gold = ep.gold_path()
                description, first = ep.start()
            finally:
                ep.close()
            self._known[task.id] = roles.known(task.id, description, first, gold, self.doors_open, self.teleport)
        return self._known[task.id]

    # ---- tasks ----

    def tasks(self, split: str) -> list[Task]:
        """The split's variations of every task type, interleaved (each type's first, then each
        one's second, ...), so that limit_tasks keeps some of every type."""
        if split not in SPLITS:
            raise KeyError(f"unknown split {split!r}; expected one of {list(SPLITS)}")
        per_type = [[Task(t, v, split) for v in table()[t][split]] for t in self.options.task_types]
        return [ts[i] for i in range(max(map(len, per_type))) for ts in per_type if i < len(ts)]

    def task(self, task_id: str) -> Task:
        task_type, _, variation = task_id.rpartition("-")
        if task_type in table() and variation.isdigit():
            for split, variations in table()[task_type].items():
                if int(variation) in variations:
                    return Task(task_type, int(variation), split)
        raise KeyError(f"unknown ScienceWorld task {task_id!r} (a task type and a variation, e.g. 'find-animal-0')")

    def game(self, task: Task) -> ScienceWorldGame:
        return ScienceWorldGame(self, task)

    @property
    def max_turns(self) -> int:
        return max(self.step_limit(t) for t in self.options.task_types)

    # ---- action format ----

    def render_action(self, reason: str, action: str) -> str:
        return render_action(reason, action)

    def parse_action(self, text: str) -> tuple[str, str]:
        return parse_action(text)

    # ---- rewards: the score / 100 ----

    @property
    def reward_range(self) -> tuple[float, float]:
        return 0.0, 1.0

    def won(self, reward: float) -> bool:
        return reward >= 1.0 - 1e-9  # the task completed, at score 100

    def relabel_turns(self, num_turns: int) -> list[int]:
        # Every turn: an episode can leave the gold path at any step (a failing focus is often its
        # last), and where it did not, the proposer proposes nothing (counted as no_better_action).
        return fraction_window(num_turns, 0.0, 1.0)

    # ---- scripted behaviour ----

    def policies(self, noise: Mapping[str, float]) -> dict[str, Policy]:
        return {"expert": Scripted(Expert()), "noisy": Scripted(Noisy(**noise)), "random": Scripted(Random())}

    def tokenizer_corpus(self) -> list[str]:
        prompts = {system_prompt(self.step_limit(t), self.options.simplifications) for t in self.options.task_types}
        return sorted(prompts) + [text for _, text in THOUGHTS] + list(self.options.task_types)

    # ---- oracle roles: the hindsight roles read the turns against the gold path (roles.py); the
    # labeler replays the actions on the simulator ----

    def oracle_version(self, role: str) -> str:
        if role not in ORACLE_VERSIONS:
            raise NotImplementedError(f"ScienceWorld has no oracle {role} (its oracle roles: {', '.join(ORACLE_VERSIONS)})")
        return ORACLE_VERSIONS[role]

    def summarize(self, task: Task, turns: Sequence[Mapping], success: bool) -> str:
        return roles.summarize(self.known(task), turns, success, self.step_limit(task.task_type))

    def propose(self, task: Task, prefix: Sequence[Mapping], n: int, original: str | None = None) -> list[Counterfactual]:
        p = roles.propose(self.known(task), prefix, original)
        return [p.counterfactual()] if p is not None and n > 0 else []

    def critique(self, task: Task, turns: Sequence[Mapping], top: int) -> list[tuple[int, Counterfactual]]:
        return [(j, p.counterfactual()) for j, p in roles.critique(self.known(task), turns, top)]

    def label(self, task_id: str, turns: Sequence[Mapping]) -> Label:
        try:
            task = self.task(task_id)
        except KeyError as e:
            return Label(None, None, str(e.args[0]))
        game = self.game(task)
        game.reset()
        for i, t in enumerate(turns):
            if game.done:
                return Label(None, None, f"turn {i} comes after the episode ended (at turn {game.turn})")
            sent = not str(t["observation"]).startswith(INVALID)
            game.advance(t["action"] if sent else None, "logged as invalid")
        if not game.done:
            game.sim.close()
        return Label(game.credited / 100, game.success, f"replayed {game.turn} actions: score {game.score}")

    # ---- the same roles played by an LLM (llm_roles.py) ----

    def prompt_hash(self, role: str) -> str:
        return llm_roles.template_hash(role)

    def _outcome(self, task: Task, turns: Sequence[Mapping], success: bool) -> str:
        points = round(100 * sum(float(t.get("reward", 0.0)) for t in turns))
        if success:
            return f"Completed at score 100 in {len(turns)} actions."
        if len(turns) < self.step_limit(task.task_type):
            return f"The task ended after {len(turns)} actions without being completed: score {points} of 100."
        return f"Out of actions ({len(turns)}) at score {points} of 100."

    def summary_request(self, task: Task, turns: Sequence[Mapping], success: bool) -> Request[str]:
        k = self.known(task)
        return llm_roles.summary_request(k.description, k.gold, turns, self._outcome(task, turns, success), self.step_limit(task.task_type),
                                         self.options.observation_words)

    def proposer_request(self, task: Task, prefix: Sequence[Mapping], n: int, summary: str) -> Request[list[Counterfactual]]:
        k = self.known(task)
        return llm_roles.proposer_request(k.description, k.gold, prefix, n, summary, self.step_limit(task.task_type), self.options.observation_words)

    def proposer_reply(self, proposals: Sequence[Counterfactual]) -> str:
        return llm_roles.proposal_reply(proposals)


__all__ = ["ScienceWorld", "ScienceWorldOptions", "Task", "thought"]
