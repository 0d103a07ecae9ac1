"""Prefect flow for the train stage (dvc.yaml: `retrosight stage train`)."""
from pathlib import Path

from prefect import flow

from flows.common import DATA, publish
from tasks.params import load_params
from tasks.train import run_train


@flow(name="train")
def train_flow(params_path: str = "params.yaml") -> dict:
    params = load_params(params_path)
    # Checkpoints live outside the stage's outputs, which DVC deletes before it reruns the stage.
    # A leap method also learns relabel's counterfactuals at their logged states; an eto method
    # pairs the expert's trajectories with the policy's failures.
    metrics = run_train(
        params, DATA / "standardize" / "train.parquet", DATA / "train", Path(".retrosight/checkpoints/train"),
        relabels=DATA / "relabel" / "relabels.parquet", trajectories=DATA / "collect" / "trajectories.parquet",
        expert=DATA / "expert" / "trajectories.parquet",
    )
    publish("train", metrics)
    return metrics
