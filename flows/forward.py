"""Prefect flow for the forward stage (dvc.yaml: `retrosight stage forward`)."""
from prefect import flow

from flows.common import DATA, publish
from tasks.forward import run_forward
from tasks.params import load_params


@flow(name="forward")
def forward_flow(params_path: str = "params.yaml") -> dict:
    params = load_params(params_path)
    metrics = run_forward(params, DATA / "collect" / "trajectories.parquet", DATA / "forward")
    publish("forward", metrics)
    return metrics
