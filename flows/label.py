"""Prefect flow for the label stage (dvc.yaml: `retrosight stage label`)."""
from prefect import flow

from flows.common import DATA, TRAJECTORIES, publish
from tasks.label import run_label
from tasks.params import load_params


@flow(name="label")
def label_flow(params_path: str = "params.yaml") -> dict:
    params = load_params(params_path)
    metrics = run_label(params, TRAJECTORIES, DATA / "label")
    publish("label", metrics)
    return metrics
