"""Prefect flow for the collect stage (dvc.yaml: `retrosight stage collect`)."""
from prefect import flow

from flows.common import DATA, publish
from tasks.collect import run_collect
from tasks.params import load_params


@flow(name="collect")
def collect_flow(params_path: str = "params.yaml") -> dict:
    params = load_params(params_path)
    metrics = run_collect(params, model_dir=params.roles.policy.model, out_dir=DATA / "collect")
    publish("collect", metrics)
    return metrics
