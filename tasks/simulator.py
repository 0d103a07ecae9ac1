"""The environment's simulator played by an LLM (HOPE's oracle is one): each game writes the
call for the agent's action (its prompt knows the hidden state) and turns the model's reply
into the game's answer, keeping the environment's own rules (in TwentyQuestions a win needs a
yes to a guess that names the secret, so a model that says yes to everything cannot hand out
wins). An answer that does not parse after the retries, or a call that fails, is played as the
game's no-answer (Game.simulator_failed) and counted on the episode.
"""
from __future__ import annotations

from collections.abc import Sequence

from envs.base import recorded_reply
from models.base import Generator
from tasks.params import Params, RoleParams
from tasks.roles import Outcome, account, call_requests, check_failure_rate, make_generator, sum_stats
from tasks.rollout import Episode, derive_seed


class LLMSimulator:
    def __init__(self, gen: Generator, role: RoleParams):
        self.gen, self.role = gen, role
        self.outcomes: list[Outcome] = []  # every call, for the stage's accounting

    def answer(self, episodes: Sequence[Episode], texts: list[str]) -> list[object | None]:
        """None where the action asks nothing (an empty reply): the oracle's answer stands."""
        texts = [recorded_reply(t) for t in texts]
        requests = [ep.game.simulator_request(t) for ep, t in zip(episodes, texts, strict=True)]
        asked = [i for i, r in enumerate(requests) if r is not None]
        seeds = [derive_seed(self.role.seed, "simulator", episodes[i].seed, len(episodes[i].turns)) for i in asked]
        outcomes = call_requests(self.gen, [requests[i] for i in asked], seeds, self.role)
        self.outcomes += outcomes
        answers: list[object | None] = [None] * len(texts)
        for i, o in zip(asked, outcomes, strict=True):
            if o.status != "ok":
                episodes[i].simulator_failures += 1
                answers[i] = episodes[i].game.simulator_failed(texts[i])
            else:
                answers[i] = o.value
        return answers


def make_simulator(params: Params) -> LLMSimulator | None:
    """None for the environment's oracle (the rollout's default), else the LLM simulator."""
    role = params.roles.simulator
    if role.backend == "oracle":
        return None
    return LLMSimulator(make_generator(role, params.cache.path), role)


def simulator_stats(simulator: LLMSimulator | None) -> dict:
    """The LLM simulator's call accounting, for a stage's metrics."""
    return {} if simulator is None else {"simulator_calls": account(simulator.outcomes, simulator.gen)}


def merged_simulator_stats(parts: list) -> dict:
    """simulator_stats of work split among processes, each part with its own simulator's
    `simulator_outcomes` (None: the oracle answered) and `simulator_generation`."""
    if not parts or parts[0].simulator_outcomes is None:
        return {}
    return {"simulator_calls": {
        **account([o for p in parts for o in p.simulator_outcomes]), **sum_stats([p.simulator_generation for p in parts])
    }}


def check_simulator(stage: str, simulator: LLMSimulator | None, metrics: dict) -> None:
    """Fails the stage when the simulator failed on more calls than its role allows."""
    if simulator is not None:
        check_failure_rate(stage, "simulator", simulator.role, metrics["simulator_calls"])
