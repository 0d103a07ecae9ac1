"""Run a stage flow as a child of the pipeline's `repro` task, across the DVC subprocess.

`dvc repro` starts the stage in a new process, so Prefect cannot see the nesting by itself.
The pipeline passes its task run id down; here the stage's flow run is created with that parent
and then executed, so the UI shows each stage under the pipeline run that caused it.

A failure crosses back the same way: a stage that fails for a reason it can say in one line
writes that line to the file ERROR_FILE_ENV names, and the pipeline ends with it. `python -m
flows.linking ARGS` is the pipeline's `dvc ARGS`, less DVC's own "failed to reproduce" report
of a stage that has said why it failed.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING
from uuid import UUID

if TYPE_CHECKING:
    from prefect import Flow

ERROR_FILE_ENV = "RETROSIGHT_ERROR_FILE"


def run_as_child(stage_flow: Flow, parent_task_run_id: str, parameters: dict | None = None):
    from prefect import get_client
    from prefect.flow_engine import run_flow

    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(stage_flow, parameters=parameters or {}, parent_task_run_id=UUID(parent_task_run_id))
    return run_flow(stage_flow, flow_run=flow_run, parameters=parameters or {})


class _Explained(logging.Filter):
    """DVC's errors, dropped once the stage has left its error line."""

    def filter(self, record: logging.LogRecord) -> bool:
        path = os.environ.get(ERROR_FILE_ENV)
        return record.levelno < logging.ERROR or not (path and os.path.exists(path) and os.path.getsize(path))


def dvc_main(argv: list[str]) -> int:
    from dvc.cli import main  # importing dvc sets up its console handlers

    for handler in logging.getLogger("dvc").handlers:
        handler.addFilter(_Explained())
    return main(argv)


if __name__ == "__main__":
    sys.exit(dvc_main(sys.argv[1:]))
