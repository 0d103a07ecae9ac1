"""Play episodes of any environment, all live episodes batched together at every step.

Used by collect (logging trajectories), by bootstrap (to measure the trained policy beside the
scripted ones), by regenerate and by evaluate. An agent turns a batch of live episodes into one
action text each; the environment's game plays it (its oracle answers, or an LLM simulator).
"""
from __future__ import annotations

import hashlib
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from envs.base import Environment, Game, Policy, Task, recorded_reply
from models.base import Generator, Message, SamplingParams
from storage.schema import trajectory_id


def derive_seed(*parts: object) -> int:
    """A stable 31-bit seed from any parts (Python's hash() is salted per process)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


@dataclass
class Episode:
    """A trajectory being logged: its game, chat messages, turn records and lineage."""

    env: str
    task: Task
    split: str
    seed: int
    game: Game
    messages: list[Message] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    parse_failures: int = 0
    generation_failures: int = 0  # turns whose generation failed after the backend's retries
    simulator_failures: int = 0  # turns the LLM simulator gave no usable answer to
    policy_id: str = ""
    sampling: SamplingParams | None = None  # the episode's own, over its agent's (collect's logging temperatures)
    # Lineage of a regenerated episode: the logged trajectory, turn and relabel it branched from.
    source: str = "policy"
    parent_id: str | None = None
    branch_turn: int | None = None
    relabel_id: str | None = None

    @property
    def done(self) -> bool:
        return self.game.done

    def apply(self, text: str, answer: object | None = None) -> None:
        """Play one action text (`answer`: an LLM simulator's, else the environment's oracle
        answers) and log the turn. An empty reply is logged as EMPTY_REPLY, in the message and
        as the turn's action, so the row says what happened and passes the checks."""
        step = self.game.step(recorded_reply(text), answer)
        self.parse_failures += not step.info["parsed"]
        self.messages += [step.info["message"], *step.observation]
        self.turns.append({"turn": len(self.turns), **step.info["turn"], "reward": step.reward})

    def to_row(self) -> dict:
        row = {
            "env": self.env,
            "task_id": self.task.id,
            "split": self.split,
            "source": self.source,
            "parent_id": self.parent_id,
            "branch_turn": self.branch_turn,
            "relabel_id": self.relabel_id,
            "policy_id": self.policy_id,
            "seed": self.seed,
            "messages": self.messages,
            "turns": self.turns,
            "return": float(sum(t["reward"] for t in self.turns)),
            "success": bool(self.game.success),
            "num_turns": len(self.turns),
        }
        return {"trajectory_id": trajectory_id(row), **row}


def history(row: dict) -> list[tuple[str, str]]:
    """A trajectory row's (action, observation) pairs: what the agent did and heard."""
    return [(t["action"], t["observation"]) for t in row["turns"]]


def action_starts(messages: Sequence[Message]) -> list[int]:
    """The index of each action's message: every turn is one agent message (Step.info["message"])."""
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


def turn_start(messages: Sequence[Message], turn: int) -> int:
    """The index of the message that is action number `turn`."""
    return action_starts(messages)[turn]


def episode_from_prefix(env: Environment, parent: dict, branch_turn: int, seed: int) -> Episode:
    """The episode `parent` (a trajectories row) was at just before its action number
    `branch_turn`: its messages and turns copied, and the game restored from the logged
    observations rather than asked again, so the prefix is exactly the logged one."""
    if not 0 <= branch_turn < parent["num_turns"]:
        raise ValueError(f"trajectory {parent['trajectory_id']}: branch turn {branch_turn} outside 0..{parent['num_turns'] - 1}")
    ep = new_episode(env, env.task(parent["task_id"]), seed)
    ep.split = parent["split"]  # a branch stays in its parent's split
    ep.messages = [dict(m) for m in parent["messages"][: turn_start(parent["messages"], branch_turn)]]
    ep.turns = [dict(t) for t in parent["turns"][:branch_turn]]
    ep.game.restore(ep.turns)
    return ep


def new_episode(env: Environment, task: Task, seed: int) -> Episode:
    game = env.game(task)
    messages, _ = game.reset()
    return Episode(env=env.name, task=task, split=task.split, seed=seed, game=game, messages=messages)


class Agent(Protocol):
    def act(self, episodes: Sequence[Episode], step_seed: int) -> list[str]: ...


class LMAgent:
    """A language-model policy: one batched generation call per step for all live episodes."""

    def __init__(self, generator: Generator, sampling: SamplingParams):
        self.generator, self.sampling = generator, sampling

    def act(self, episodes: Sequence[Episode], step_seed: int) -> list[str]:
        # An episode with its own sampling (a logging temperature) names it in its policy_id:
        # the policy at T=0.3 is another behaviour policy than at T=1.0.
        for ep in episodes:
            ep.policy_id = self.generator.model_id if ep.sampling is None else f"{self.generator.model_id}@T={ep.sampling.temperature:g}"
        # Each turn's seed comes from its episode, not the batch: an episode plays the same
        # whichever episodes share its batch (or were served from the response cache).
        seeds = [derive_seed(ep.seed, "turn", len(ep.turns)) for ep in episodes]
        completions: list = [None] * len(episodes)
        groups: dict[SamplingParams, list[int]] = {}
        for i, ep in enumerate(episodes):
            groups.setdefault(ep.sampling or self.sampling, []).append(i)
        for sampling, at in groups.items():  # one batched call per sampling
            for i, c in zip(at, self.generator.generate([episodes[i].messages for i in at], sampling, [seeds[i] for i in at]), strict=True):
                completions[i] = c
        texts = []
        for ep, c in zip(episodes, completions, strict=True):
            if not c.ok:
                # The backend gave up on this turn: it is played as an empty reply (EMPTY_REPLY)
                # and counted, so the episode's row still says what happened.
                ep.generation_failures += 1
            texts.append(c.text if c.ok else "")
        return texts


class BestOfNAgent:
    """Best-of-N (HOPE 2.7): at every turn the policy samples `n` actions per live episode and the
    one a critic scores highest is played (the first of equals). `score` takes (state, action
    message) pairs and returns one score each; candidates the backend gave up on are not scored,
    and a turn where all n failed is played as an empty reply and counted."""

    def __init__(self, generator: Generator, sampling: SamplingParams, n: int, score: Callable[[list[tuple[list[Message], Message]]], list[float]]):
        self.generator, self.sampling, self.n, self.score = generator, sampling, n, score

    def candidates(self, episodes: Sequence[Episode]) -> list[list[str]]:
        """Each live episode's n sampled actions this turn, those the backend gave up on left out."""
        prompts, seeds = [], []
        for ep in episodes:
            prompts += [ep.messages] * self.n
            seeds += [derive_seed(ep.seed, "turn", len(ep.turns), "candidate", j) for j in range(self.n)]
        completions = self.generator.generate(prompts, self.sampling, seeds)
        return [[c.text for c in completions[i * self.n : (i + 1) * self.n] if c.ok] for i in range(len(episodes))]

    def act(self, episodes: Sequence[Episode], step_seed: int) -> list[str]:
        for ep in episodes:
            ep.policy_id = f"{self.generator.model_id}+best_of_{self.n}"
        candidates = self.candidates(episodes)
        # One scoring call for every candidate of every live episode.
        scores = iter(self.score([(ep.messages, ep.game.message(text)) for ep, ok in zip(episodes, candidates) for text in ok]))
        texts = []
        for ep, ok in zip(episodes, candidates):
            if not ok:
                ep.generation_failures += 1
                texts.append("")
                continue
            mine = [next(scores) for _ in ok]
            texts.append(ok[max(range(len(ok)), key=mine.__getitem__)])
        return texts


class ScriptedAgent:
    """A scripted behaviour policy. `policy_for(rng)` picks the policy an episode plays with (a
    mixture draws one per episode) and each episode keeps its own rng, so a rerun repeats."""

    def __init__(self, policy_for: Callable[[random.Random], Policy]):
        self.policy_for = policy_for
        self._state: dict[int, tuple[Policy, random.Random]] = {}

    def act(self, episodes: Sequence[Episode], step_seed: int) -> list[str]:
        texts = []
        for ep in episodes:
            if id(ep) not in self._state:
                rng = random.Random(ep.seed)
                self._state[id(ep)] = (self.policy_for(rng), rng)
            policy, rng = self._state[id(ep)]
            ep.policy_id = f"scripted:{policy.name}"
            texts.append(policy.act(ep.game, rng))
        return texts


class Simulator(Protocol):
    def answer(self, episodes: Sequence[Episode], texts: list[str]) -> list[object | None]:
        """One answer per action text for `game.step`; None where the oracle's answer stands."""


def ask(simulator: Simulator | None, episodes: Sequence[Episode], texts: list[str]) -> list[object | None]:
    """The simulator's answers to the actions `texts` of `episodes`, asked in one batch; all None
    (the environment's oracle answers) without a simulator."""
    return [None] * len(texts) if simulator is None else simulator.answer(episodes, texts)


def play(episodes: list[Episode], agent: Agent, run_seed: int, label: str = "rollout", simulator: Simulator | None = None) -> list[Episode]:
    """Step every live episode together until all are done; a progress bar counts finished ones.
    The simulator (default: the environment's oracle) answers every live episode's action in
    one batch per step (see ask). Where the games bound how many play at once (Game.concurrency),
    the next waiting one starts as one ends; each turn's seed is its episode's, so an episode
    plays the same either way."""
    waiting = deque(e for e in episodes if not e.done)
    cap = min((e.game.concurrency for e in waiting if e.game.concurrency), default=None)
    live: list[Episode] = []
    step = 0
    with Progress(
        TextColumn(f"[bold]{label}[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("step {task.fields[step]}"),
        TimeElapsedColumn(),
        transient=False,
    ) as progress:
        bar = progress.add_task(label, total=len(episodes), completed=len(episodes) - len(waiting), step=0)
        while waiting or live:
            while waiting and (cap is None or len(live) < cap):
                live.append(waiting.popleft())
            texts = agent.act(live, derive_seed(run_seed, label, step))
            answers = ask(simulator, live, texts)
            for ep, text, answer in zip(live, texts, answers, strict=True):
                ep.apply(text, answer)
            live = [e for e in live if not e.done]
            step += 1
            progress.update(bar, completed=len(episodes) - len(live) - len(waiting), step=step)
    return episodes


def episode_stats(episodes: Sequence[Episode]) -> dict:
    n = len(episodes)
    if n == 0:
        return {"episodes": 0}
    return {
        "episodes": n,
        "success_rate": sum(e.game.success for e in episodes) / n,
        "mean_return": sum(sum(t["reward"] for t in e.turns) for e in episodes) / n,
        "mean_turns": sum(len(e.turns) for e in episodes) / n,
        "parse_failure_rate": sum(e.parse_failures for e in episodes) / max(1, sum(len(e.turns) for e in episodes)),
        "generation_failures": sum(e.generation_failures for e in episodes),
        "simulator_failures": sum(e.simulator_failures for e in episodes),
    }


def stats_by_split(episodes: Sequence[Episode]) -> dict[str, dict]:
    """episode_stats per split, splits in order of first appearance."""
    splits = dict.fromkeys(e.split for e in episodes)
    return {split: episode_stats([e for e in episodes if e.split == split]) for split in splits}
