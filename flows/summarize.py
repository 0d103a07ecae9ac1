"""Prefect flow for the summarize stage (dvc.yaml: `retrosight stage summarize`)."""
from prefect import flow

from flows.common import DATA, publish
from tasks.params import load_params
from tasks.summarize import run_summarize


@flow(name="summarize")
def summarize_flow(params_path: str = "params.yaml") -> dict:
    metrics = run_summarize(load_params(params_path), DATA / "collect" / "trajectories.parquet", DATA / "summarize")
    publish("summarize", metrics)
    return metrics
