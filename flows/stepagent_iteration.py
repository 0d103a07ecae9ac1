"""Prefect flow for one of StepAgent's later iterations (dvc.yaml: the `stepagent_iteration`
foreach, `retrosight stage stepagent_iteration@K`).

Iteration 1 is the stages expert, practice and stepagent over data/. Iteration K >= 2 (params.yaml
`stepagent_iterations`) runs Algorithm 1's body again from iteration K-1's policy: it practises
the same expert prefixes (inspection) and reflects on them, starting from that policy, which is
also the new pi_ref ("the reference model initialized with the agent policy", StepAgent 7.4),
into data/iterationK/practice and data/iterationK/stepagent (one DVC stage: a rerun of iteration K
redoes no earlier one). Its seed is derived from the run's and K, so its samples are new; its beta
is the item's when given (ETO: 0.5 after the first). stepagent_select then chooses among the
iterations on the val split.
"""
from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows.common import DATA, publish
from tasks.params import Params, iteration_dir, load_params
from tasks.practice import run_practice
from tasks.rollout import derive_seed
from tasks.stepagent import run_stepagent


def stepagent_iteration_params(params: Params, k: int) -> Params:
    """Iteration k's params: the previous iteration's policy practises and is the new start and reference."""
    item = params.stepagent_iterations[k]
    return params.model_copy(update={
        "seed": derive_seed(params.seed, "stepagent-iteration", k),
        "practice": params.practice.model_copy(update={"model": item.policy}),
        "stepagent": params.stepagent.model_copy(update={"base_model": item.policy, "beta": item.beta or params.stepagent.beta}),
    })


@flow(name="stepagent_iteration")
def stepagent_iteration_flow(iteration: int, params_path: str = "params.yaml") -> dict:
    params = load_params(params_path)
    if iteration not in params.stepagent_iterations:
        raise ValueError(f"stepagent iteration {iteration} is not in params.yaml's stepagent_iterations "
                         f"({', '.join(map(str, params.stepagent_iterations)) or 'none'})")
    p = stepagent_iteration_params(params, iteration)
    d = Path(iteration_dir(iteration))
    metrics = {"iteration": iteration, "policy": p.practice.model, "seed": p.seed, "beta": p.stepagent.beta}
    print(f"stepagent iteration {iteration}: practice", flush=True)
    metrics["practice"] = run_practice(p, DATA / "expert" / "trajectories.parquet", d / "practice")
    print(f"stepagent iteration {iteration}: stepagent", flush=True)
    metrics["stepagent"] = run_stepagent(p, d / "practice" / "pairs.parquet", d / "stepagent")
    publish(f"stepagent_iteration@{iteration}", metrics)
    return metrics
