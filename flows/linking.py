"""Run a stage flow as a child of the pipeline's `repro` task, across the DVC subprocess.

`dvc repro` starts the stage in a new process, so Prefect cannot see the nesting by itself.
The pipeline passes its task run id down; here the stage's flow run is created with that parent
and then executed, so the UI shows each stage under the pipeline run that caused it.
"""
from __future__ import annotations

from uuid import UUID

from prefect import Flow, get_client
from prefect.flow_engine import run_flow


def run_as_child(stage_flow: Flow, parent_task_run_id: str):
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(stage_flow, parent_task_run_id=UUID(parent_task_run_id))
    return run_flow(stage_flow, flow_run=flow_run)
