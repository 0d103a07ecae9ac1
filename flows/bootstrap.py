"""Prefect flow for the bootstrap stage (dvc.yaml: `retrosight stage bootstrap`)."""
from prefect import flow

from flows.common import DATA, publish
from tasks.bootstrap import run_bootstrap
from tasks.params import load_params


@flow(name="bootstrap")
def bootstrap_flow(params_path: str = "params.yaml") -> dict:
    metrics = run_bootstrap(load_params(params_path), DATA / "bootstrap")
    publish("bootstrap", metrics)
    return metrics
