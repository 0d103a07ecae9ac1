"""Prefect flow for the critic stage (dvc.yaml: `retrosight stage critic`)."""
from pathlib import Path

from prefect import flow

from flows.common import DATA, publish
from tasks.critic import run_critic
from tasks.params import load_params


@flow(name="critic")
def critic_flow(params_path: str = "params.yaml") -> dict:
    params = load_params(params_path)
    metrics = run_critic(params, DATA / "buffer" / "pairs.parquet", DATA / "critic", Path(".retrosight/checkpoints/critic"))
    publish("critic", metrics)
    return metrics
