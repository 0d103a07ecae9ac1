"""Play TwentyQuestions episodes, all live episodes batched together at every step.

Used by collect (logging trajectories), by bootstrap (to measure the trained policy beside the
scripted ones) and later by regenerate and evaluate. An agent turns a batch of live episodes
into one action text each; the environment's oracle answers.
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from envs.twenty_questions.format import (
    EMPTY_REPLY,
    ActionParseError,
    final_message,
    observation_message,
    parse_action,
    recorded_reply,
    render_action,
    system_prompt,
)
from envs.twenty_questions.game import Answer, Game
from envs.twenty_questions.kb import Entity, KnowledgeBase
from envs.twenty_questions.policies import PlayerView
from models.base import Generator, Message, SamplingParams
from storage.schema import trajectory_id

ENV_NAME = "twenty_questions"


def derive_seed(*parts: object) -> int:
    """A stable 31-bit seed from any parts (Python's hash() is salted per process)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


@dataclass
class Episode:
    task: Entity
    split: str
    seed: int
    game: Game
    candidates: list[Entity]
    messages: list[Message] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    parse_failures: int = 0
    generation_failures: int = 0  # turns whose generation failed after the backend's retries
    simulator_failures: int = 0  # turns the LLM simulator gave no usable answer to ("unknown")
    policy_id: str = ""
    # Lineage of a regenerated episode: the logged trajectory, turn and relabel it branched from.
    source: str = "policy"
    parent_id: str | None = None
    branch_turn: int | None = None
    relabel_id: str | None = None

    @property
    def done(self) -> bool:
        return self.game.done

    def view(self) -> PlayerView:
        return PlayerView(
            candidates=self.candidates,
            history=list(self.game.history),
            turn=self.game.turn,
            max_turns=self.game.max_turns,
        )

    @staticmethod
    def read(text: str) -> tuple[str, str, bool]:
        """(reason, question, parsed) of an action text. An unparseable output still costs a
        turn: the simulator hears the raw text, exactly as a sloppy agent would be treated; an
        empty one is the question EMPTY_REPLY."""
        try:
            action = parse_action(text)
            return action.reason, action.question, True
        except ActionParseError:
            return "", recorded_reply(text).strip(), False

    def apply(self, text: str, answer: Answer | None = None) -> None:
        """Execute one action text: parse it, let the simulator answer (by default the
        knowledge-base oracle), log the turn. An empty reply is logged as EMPTY_REPLY, in the
        message and as the turn's action, so the row says what happened and passes the checks."""
        text = recorded_reply(text)
        reason, question, parsed = self.read(text)
        self.parse_failures += not parsed
        step = self.game.step(question, answer)
        self.messages.append({"role": "assistant", "content": text})
        if self.game.done:
            self.messages.append({"role": "user", "content": final_message(step.observation, step.success)})
        else:
            self.messages.append(
                {
                    "role": "user",
                    "content": observation_message(step.observation, self.game.turn, self.game.max_turns),
                }
            )
        self.turns.append(
            {
                "turn": len(self.turns),
                "reason": reason,
                "action": question,
                "observation": step.observation,
                "reward": step.reward,
            }
        )

    def to_row(self) -> dict:
        row = {
            "env": ENV_NAME,
            "task_id": self.task.name,
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
    """A trajectory row's (question, answer) pairs: what the player asked and heard."""
    return [(t["action"], t["observation"]) for t in row["turns"]]


def episode_from_prefix(kb: KnowledgeBase, parent: dict, branch_turn: int, seed: int, max_turns: int, show_candidates: bool) -> Episode:
    """The episode `parent` (a trajectories row) was at just before its action number
    `branch_turn`: its messages and turns copied, and the game state restored from the logged
    answers rather than asked again, so the prefix is exactly the logged one."""
    if not 0 <= branch_turn < parent["num_turns"]:
        raise ValueError(f"trajectory {parent['trajectory_id']}: branch turn {branch_turn} outside 0..{parent['num_turns'] - 1}")
    ep = new_episode(kb, kb.get(parent["task_id"]), parent["split"], seed, max_turns, show_candidates)
    ep.messages = [dict(m) for m in parent["messages"][: 2 + 2 * branch_turn]]
    ep.turns = [dict(t) for t in parent["turns"][:branch_turn]]
    ep.game.restore(history({"turns": ep.turns}))
    return ep


def new_episode(
    kb: KnowledgeBase, task: Entity, split: str, seed: int, max_turns: int, show_candidates: bool
) -> Episode:
    # A player shown the split's list narrows to it; one not shown it must consider every object
    # it knows, so scripted players then search the whole knowledge base.
    candidates = kb.split(split) if show_candidates else list(kb.entities)
    names = [c.name for c in candidates] if show_candidates else None
    ep = Episode(task=task, split=split, seed=seed, game=Game(kb, task, max_turns=max_turns), candidates=candidates)
    ep.messages = [
        {"role": "system", "content": system_prompt(max_turns=max_turns, candidates=names)},
        {"role": "user", "content": observation_message(None, 0, max_turns)},
    ]
    return ep


class Agent(Protocol):
    def act(self, episodes: Sequence[Episode], step_seed: int) -> list[str]: ...


class LMAgent:
    """A language-model policy: one batched generation call per step for all live episodes."""

    def __init__(self, generator: Generator, sampling: SamplingParams):
        self.generator, self.sampling = generator, sampling

    def act(self, episodes: Sequence[Episode], step_seed: int) -> list[str]:
        for ep in episodes:
            ep.policy_id = self.generator.model_id
        # Each turn's seed comes from its episode, not the batch: an episode plays the same
        # whichever episodes share its batch (or were served from the response cache).
        seeds = [derive_seed(ep.seed, "turn", len(ep.turns)) for ep in episodes]
        completions = self.generator.generate([e.messages for e in episodes], self.sampling, seeds)
        texts = []
        for ep, c in zip(episodes, completions, strict=True):
            if not c.ok:
                # The backend gave up on this turn: it is played as an empty reply (EMPTY_REPLY)
                # and counted, so the episode's row still says what happened.
                ep.generation_failures += 1
            texts.append(c.text if c.ok else "")
        return texts


class ScriptedAgent:
    """A scripted behaviour policy. `policy_for(episode)` picks the policy an episode plays with
    (a mixture draws one per episode) and each episode keeps its own rng, so a rerun repeats."""

    def __init__(self, policy_for: Callable[[random.Random], object]):
        self.policy_for = policy_for
        self._state: dict[int, tuple[object, random.Random]] = {}

    def act(self, episodes: Sequence[Episode], step_seed: int) -> list[str]:
        texts = []
        for ep in episodes:
            if id(ep) not in self._state:
                rng = random.Random(ep.seed)
                self._state[id(ep)] = (self.policy_for(rng), rng)
            policy, rng = self._state[id(ep)]
            ep.policy_id = f"scripted:{policy.name}"
            action = policy.act(ep.view(), rng)
            texts.append(render_action(action.reason, action.question))
        return texts


class Simulator(Protocol):
    def answer(self, episodes: Sequence[Episode], questions: list[str]) -> list[Answer]: ...


def ask(simulator: Simulator | None, episodes: Sequence[Episode], texts: list[str]) -> list[Answer | None]:
    """The simulator's answers to the actions `texts` of `episodes`, asked in one batch; None
    where the knowledge-base oracle answers: every action without a simulator, and an empty
    reply always (it asks nothing, so the oracle's "unknown" stands and no LLM is asked to
    make up an answer to it)."""
    answers: list[Answer | None] = [None] * len(texts)
    if simulator is None:
        return answers
    questions = [Episode.read(t)[1] for t in texts]
    asked = [i for i, q in enumerate(questions) if q != EMPTY_REPLY]
    if asked:
        for i, a in zip(asked, simulator.answer([episodes[i] for i in asked], [questions[i] for i in asked]), strict=True):
            answers[i] = a
    return answers


def play(episodes: list[Episode], agent: Agent, run_seed: int, label: str = "rollout", simulator: Simulator | None = None) -> list[Episode]:
    """Step every live episode together until all are done; a progress bar counts finished ones.
    The simulator (default: the knowledge-base oracle) answers every live episode's question in
    one batch per step (see ask)."""
    live = [e for e in episodes if not e.done]
    step = 0
    with Progress(
        TextColumn(f"[bold]{label}[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("turn {task.fields[turn]}"),
        TimeElapsedColumn(),
        transient=False,
    ) as progress:
        bar = progress.add_task(label, total=len(episodes), completed=len(episodes) - len(live), turn=0)
        while live:
            texts = agent.act(live, derive_seed(run_seed, label, step))
            answers = ask(simulator, live, texts)
            for ep, text, answer in zip(live, texts, answers, strict=True):
                ep.apply(text, answer)
            live = [e for e in live if not e.done]
            step += 1
            progress.update(bar, completed=len(episodes) - len(live), turn=step)
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
