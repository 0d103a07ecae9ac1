"""The environment's answerer played by an LLM (HOPE's oracle is one): given the secret's name
and category, it answers each question yes or no (prompts/simulator.j2).

The model decides every answer, guesses included, with one rule kept from the environment: a
game is won only when the model says yes to a guess that names the secret, so a model that
says yes to everything cannot hand out wins. An answer that does not parse after the retries,
or a call that fails, is heard as "unknown" and counted on the episode.
"""
from __future__ import annotations

from collections.abc import Sequence

from envs.twenty_questions.game import Answer
from envs.twenty_questions.kb import Entity, KnowledgeBase
from envs.twenty_questions.llm_roles import chat, parse_yes_no
from models.base import Generator
from tasks.params import Params, RoleParams
from tasks.roles import Outcome, account, call_parsed, check_failure_rate, make_generator, role_sampling
from tasks.rollout import Episode, derive_seed


def llm_answer(kb: KnowledgeBase, secret: Entity, question: str, text: str) -> Answer:
    """A model's yes/no/unknown as the environment's answer: a win needs a yes to a guess that
    names the secret."""
    guess = kb.resolve_guess(question)
    return Answer(text, is_guess=guess is not None, correct=text == "yes" and guess == secret)


class LLMSimulator:
    def __init__(self, kb: KnowledgeBase, gen: Generator, role: RoleParams):
        self.kb, self.gen, self.role = kb, gen, role
        self.outcomes: list[Outcome] = []  # every call, for the stage's accounting

    def answer(self, episodes: Sequence[Episode], questions: list[str]) -> list[Answer]:
        prompts = [chat("simulator.j2", secret=ep.task.name, category=ep.task.category, question=q) for ep, q in zip(episodes, questions)]
        seeds = [derive_seed(self.role.seed, "simulator", ep.seed, len(ep.turns)) for ep in episodes]
        outcomes = call_parsed(self.gen, prompts, seeds, parse_yes_no, role_sampling(self.role), self.role.parse_attempts)
        self.outcomes += outcomes
        answers = []
        for ep, q, o in zip(episodes, questions, outcomes):
            guess = self.kb.resolve_guess(q)
            if o.status != "ok":
                ep.simulator_failures += 1
                answers.append(Answer("unknown", is_guess=guess is not None, correct=False))
                continue
            answers.append(llm_answer(self.kb, ep.task, q, o.value))
        return answers


def make_simulator(params: Params, kb: KnowledgeBase) -> LLMSimulator | None:
    """None for the knowledge-base oracle (the rollout's default), else the LLM simulator."""
    role = params.roles.simulator
    if role.backend == "oracle":
        return None
    return LLMSimulator(kb, make_generator(role, params.cache.path), role)


def simulator_stats(simulator: LLMSimulator | None) -> dict:
    """The LLM simulator's call accounting, for a stage's metrics."""
    return {} if simulator is None else {"simulator_calls": account(simulator.outcomes, simulator.gen)}


def check_simulator(stage: str, simulator: LLMSimulator | None, metrics: dict) -> None:
    """Fails the stage when the simulator failed on more calls than its role allows."""
    if simulator is not None:
        check_failure_rate(stage, "simulator", simulator.role, metrics["simulator_calls"])
