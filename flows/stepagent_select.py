"""Prefect flow for the stepagent_select stage (dvc.yaml: `retrosight stage stepagent_select`)."""
from prefect import flow

from flows.common import DATA, publish
from tasks.params import load_params
from tasks.stepagent_select import iteration_policies, run_stepagent_select


@flow(name="stepagent_select")
def stepagent_select_flow(params_path: str = "params.yaml") -> dict:
    params = load_params(params_path)
    metrics = run_stepagent_select(params, iteration_policies(params), DATA / "stepagent_select")
    publish("stepagent_select", metrics)
    return metrics
