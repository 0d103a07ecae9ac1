"""Prefect flow for one of HOPE's later iterations (dvc.yaml: the `iteration` foreach,
`retrosight stage iteration@K`).

Iteration 1 is the stages collect ... actor over data/. Iteration K >= 2 (params.yaml
`iterations`) runs Algorithm 1's body again with iteration K-1's actor as the policy: collect,
summarize, relabel, regenerate, buffer, critic and actor, each the stage's own task, into
data/iterationK/<stage>/ (one DVC stage: a rerun of iteration K redoes no earlier one). As HOPE (notes/hope.md 2.8, read as its likely meaning),
the critic and the actor start again from their base_model (pi_0) and the actor's DPO reference
stays pi_0; what the new iteration changes is the data: the policy it collects and regenerates
with, the critic's best-of-N selection plays with, and so the buffer the critic and actor learn
from. Its seed is derived from the run's seed and K, so its games are not a replay of
iteration 1's. The iteration's metrics (data/iterationK/metrics.json) hold each stage's, and
evaluate plays an iteration's actor when evaluate.actor names it.
"""
from __future__ import annotations

import json
from pathlib import Path

from prefect import flow

from flows.collect import run_collect_stage
from flows.common import publish
from tasks.actor import run_actor
from tasks.buffer import run_buffer
from tasks.critic import run_critic
from tasks.params import Params, iteration_dir, load_params
from tasks.regenerate import run_regenerate
from tasks.relabel import run_relabel
from tasks.rollout import derive_seed
from tasks.summarize import run_summarize


def iteration_params(params: Params, k: int) -> Params:
    """Iteration k's params: the previous actor plays, this iteration's critic ranks, a seed of its own."""
    policy = params.roles.policy.model_copy(update={"model": params.iterations[k].policy})
    return params.model_copy(
        update={
            "seed": derive_seed(params.seed, "iteration", k),
            "roles": params.roles.model_copy(update={"policy": policy}),
            "actor": params.actor.model_copy(update={"critic": f"{iteration_dir(k)}/critic/model"}),
        }
    )


@flow(name="iteration")
def iteration_flow(iteration: int, params_path: str = "params.yaml") -> dict:
    params = load_params(params_path)
    if iteration not in params.iterations:
        raise ValueError(f"iteration {iteration} is not in params.yaml's iterations ({', '.join(map(str, params.iterations)) or 'none'})")
    p = iteration_params(params, iteration)
    d = Path(iteration_dir(iteration))
    logged = d / "collect/trajectories.parquet"
    trajectories = [logged, d / "regenerate/trajectories.parquet"]
    summaries = d / "summarize/summaries.parquet"
    steps = {
        "collect": lambda: run_collect_stage(p, d / "collect"),
        "summarize": lambda: run_summarize(p, logged, d / "summarize"),
        "relabel": lambda: run_relabel(p, logged, summaries, d / "relabel"),
        "regenerate": lambda: run_regenerate(p, logged, d / "relabel/relabels.parquet", Path(p.roles.policy.model), d / "regenerate"),
        "buffer": lambda: run_buffer(p, trajectories, d / "buffer"),
        "critic": lambda: run_critic(p, d / "buffer/pairs.parquet", d / "critic"),
        "actor": lambda: run_actor(p, d / "buffer/pairs.parquet", trajectories, summaries, d / "actor"),
    }
    metrics = {"iteration": iteration, "policy": p.roles.policy.model, "seed": p.seed}
    for stage, step in steps.items():
        print(f"iteration {iteration}: {stage}", flush=True)
        metrics[stage] = step()
    (d / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    publish(f"iteration@{iteration}", metrics)
    return metrics
