"""What every stage flow shares: where its data lives and how it reports."""
from __future__ import annotations

import json
from pathlib import Path

from prefect.artifacts import create_markdown_artifact

DATA = Path("data")
# Every trajectory the later stages work on: the logged ones and their hindsight regenerations.
TRAJECTORIES = [DATA / "collect" / "trajectories.parquet", DATA / "regenerate" / "trajectories.parquet"]


def publish(stage: str, metrics: dict) -> None:
    """A Prefect markdown artifact with the stage's metrics, readable in the UI."""
    body = f"# {stage}\n\n```json\n{json.dumps(metrics, indent=2, sort_keys=True)}\n```\n"
    create_markdown_artifact(key=f"retrosight-{stage}", markdown=body, description=f"{stage} metrics")
