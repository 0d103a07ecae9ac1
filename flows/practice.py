"""Prefect flow for the practice stage (dvc.yaml: `retrosight stage practice`)."""
from prefect import flow

from flows.common import DATA, publish
from tasks.params import load_params
from tasks.practice import run_practice


@flow(name="practice")
def practice_flow(params_path: str = "params.yaml") -> dict:
    params = load_params(params_path)
    metrics = run_practice(params, DATA / "expert" / "trajectories.parquet", DATA / "practice")
    publish("practice", metrics)
    return metrics
