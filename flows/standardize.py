"""Prefect flow for the standardize stage (dvc.yaml: `retrosight stage standardize`)."""
from prefect import flow

from flows.common import DATA, TRAJECTORIES, publish
from tasks.params import load_params
from tasks.standardize import run_standardize


@flow(name="standardize")
def standardize_flow(params_path: str = "params.yaml") -> dict:
    params = load_params(params_path)
    metrics = run_standardize(params, TRAJECTORIES, DATA / "label" / "labels.parquet", DATA / "standardize")
    publish("standardize", metrics)
    return metrics
