"""Prefect flow for the buffer stage (dvc.yaml: `retrosight stage buffer`)."""
from prefect import flow

from flows.common import DATA, TRAJECTORIES, publish
from tasks.buffer import run_buffer
from tasks.params import load_params


@flow(name="buffer")
def buffer_flow(params_path: str = "params.yaml") -> dict:
    params = load_params(params_path)
    metrics = run_buffer(params, TRAJECTORIES, DATA / "buffer")
    publish("buffer", metrics)
    return metrics
