"""Prefect flow for the proposer stage (dvc.yaml: `retrosight stage proposer`)."""
from prefect import flow

from flows.common import DATA, TRAJECTORIES, publish
from tasks.params import load_params
from tasks.proposer import run_proposer


@flow(name="proposer")
def proposer_flow(params_path: str = "params.yaml") -> dict:
    params = load_params(params_path)
    metrics = run_proposer(params, DATA / "relabel" / "relabels.parquet", TRAJECTORIES, DATA / "summarize" / "summaries.parquet", DATA / "proposer")
    publish("proposer", metrics)
    return metrics
