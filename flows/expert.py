"""Prefect flow for the expert stage (dvc.yaml: `retrosight stage expert`)."""
from prefect import flow

from flows.common import DATA, publish
from tasks.expert import run_expert
from tasks.params import load_params


@flow(name="expert")
def expert_flow(params_path: str = "params.yaml") -> dict:
    params = load_params(params_path)
    metrics = run_expert(params, DATA / "expert")
    publish("expert", metrics)
    return metrics
