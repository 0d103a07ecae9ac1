"""Prefect flow for the actor stage (dvc.yaml: `retrosight stage actor`)."""
from prefect import flow

from flows.common import DATA, TRAJECTORIES, publish
from tasks.actor import run_actor
from tasks.params import load_params


@flow(name="actor")
def actor_flow(params_path: str = "params.yaml") -> dict:
    params = load_params(params_path)
    metrics = run_actor(params, DATA / "buffer" / "pairs.parquet", TRAJECTORIES, DATA / "summarize" / "summaries.parquet", DATA / "actor")
    publish("actor", metrics)
    return metrics
