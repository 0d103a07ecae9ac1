"""Prefect flow for the regenerate stage (dvc.yaml: `retrosight stage regenerate`)."""
from pathlib import Path

from prefect import flow

from flows.common import DATA, publish
from tasks.params import load_params
from tasks.regenerate import run_regenerate


@flow(name="regenerate")
def regenerate_flow(params_path: str = "params.yaml") -> dict:
    params = load_params(params_path)
    metrics = run_regenerate(params, DATA / "collect" / "trajectories.parquet", DATA / "relabel" / "relabels.parquet", Path(params.roles.policy.model), DATA / "regenerate")
    publish("regenerate", metrics)
    return metrics
