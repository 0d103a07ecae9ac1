"""Prefect flow for one NLAC iteration (dvc.yaml: the `nlac_iteration` foreach, `retrosight stage
nlac_iteration@K`): collect with iteration K's policy, add to the replay buffer, train L1 and L2
with the EMA step (tasks/nlac.py), into data/iterationK/nlac_collect and data/iterationK/nlac.
Iteration K reads iteration K-1's policy, target network and buffer, so a rerun of K redoes no
earlier one. Its seed is derived from the run's and K.
"""
from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows.common import publish
from tasks.nlac import run_nlac_iteration
from tasks.params import load_params, nlac_dir


@flow(name="nlac_iteration")
def nlac_iteration_flow(iteration: int, params_path: str = "params.yaml") -> dict:
    params = load_params(params_path)
    if iteration not in params.nlac_iterations:
        raise ValueError(f"nlac iteration {iteration} is not in params.yaml's nlac_iterations ({', '.join(map(str, params.nlac_iterations)) or 'none'})")
    out = Path(nlac_dir(iteration))
    metrics = run_nlac_iteration(params, iteration, out, out.parent / "nlac_collect")
    publish(f"nlac_iteration@{iteration}", metrics)
    return metrics
