"""Prefect flow for the relabel stage (dvc.yaml: `retrosight stage relabel`)."""
from prefect import flow

from flows.common import DATA, publish
from tasks.params import load_params
from tasks.relabel import run_relabel


@flow(name="relabel")
def relabel_flow(params_path: str = "params.yaml") -> dict:
    params = load_params(params_path)
    metrics = run_relabel(params, DATA / "collect" / "trajectories.parquet", DATA / "summarize" / "summaries.parquet", DATA / "relabel")
    publish("relabel", metrics)
    return metrics
