"""Prefect flow for the evaluate stage (dvc.yaml: `retrosight stage evaluate`)."""
from pathlib import Path

from prefect import flow

from flows.common import DATA, publish
from tasks.evaluate import run_evaluate
from tasks.params import load_params


@flow(name="evaluate")
def evaluate_flow(params_path: str = "params.yaml") -> dict:
    params = load_params(params_path)
    # Finished plays live outside the stage's outputs, which DVC deletes before it reruns the stage.
    metrics = run_evaluate(params, DATA / "train", DATA / "evaluate", Path(".retrosight/checkpoints/evaluate"))
    publish("evaluate", metrics)
    return metrics
