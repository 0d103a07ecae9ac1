"""Prefect flow for the stepagent stage (dvc.yaml: `retrosight stage stepagent`)."""
from prefect import flow

from flows.common import DATA, publish
from tasks.params import load_params
from tasks.stepagent import run_stepagent


@flow(name="stepagent")
def stepagent_flow(params_path: str = "params.yaml") -> dict:
    params = load_params(params_path)
    metrics = run_stepagent(params, DATA / "practice" / "pairs.parquet", DATA / "stepagent")
    publish("stepagent", metrics)
    return metrics
