"""Scheduled runs: a Prefect deployment that reproduces the pipeline, keeps the run as a DVC
experiment named after it, pushes its data to the DVC remote and writes its report.

`retrosight serve --cron "0 3 * * *"` registers the deployment with the Prefect server named by
PREFECT_API_URL and executes its runs in this workspace as they come due.
"""
from __future__ import annotations

import logging
import re
from datetime import datetime, timezone
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.context import get_run_context

from flows import pipeline as p
from flows.common import expected_failure, log_to_file, say_error, stage_roles

FLOW_NAME = "retrosight-scheduled"


def run_name(prefix: str, flow_run_name: str | None, now: datetime | None = None) -> str:
    """`nightly-20261123-0300-amber-fox`: sortable, and valid as a git ref name."""
    now = now or datetime.now(timezone.utc)
    raw = f"{prefix}-{now:%Y%m%d-%H%M%S}" + (f"-{flow_run_name}" if flow_run_name else "")
    return re.sub(r"[^A-Za-z0-9._-]+", "-", raw).strip("-.")


@flow(name=FLOW_NAME)
def scheduled_run(overrides: list[str] | None = None, push: bool = True, report: bool = True, prefix: str = "run") -> dict:
    logger = get_run_logger()
    flow_run = get_run_context().flow_run
    try:
        # Unattended: a scheduled run that finds the workspace busy waits its turn.
        with p.workspace_lock(f"scheduled run {flow_run.name}", wait=True, on_wait=logger.info):
            # Once the workspace is ours (a waiting run must not truncate the running one's log):
            # this run's process logs to .retrosight/logs/scheduled.log and, as `retrosight run`
            # does, keeps an expected failure's traceback there, off the terminal.
            log_to_file("scheduled")
            return _scheduled(flow_run, overrides, push, report, prefix, logger)
    except Exception as e:
        if expected_failure(e):
            say_error(str(e))  # the line `retrosight run` would end with
        raise  # the flow run fails, its state saying why


def _scheduled(flow_run, overrides, push, report, prefix, logger) -> dict:
    from tasks.params import load_params
    from tasks.roles import check_api_keys

    if overrides:
        p.apply_overrides(overrides)
    # As `retrosight run` does: a bad params.yaml or a missing API key, before any work.
    params = load_params()
    check_api_keys(params, stage_roles(p.stage_names()))
    if restored := p.restore_cut_lock():
        logger.warning(restored)
    if not p.stale_stages():
        logger.info("Pipeline is up to date; no new version.")
        return {"ran": [], "experiment": None}
    name = run_name(prefix, flow_run.name)
    result = p.run_pipeline(p.stage_names(), preload=params.runtime.preload)
    ran = [s for s, outcome in result.items() if outcome["outcome"] == "ran"]
    stale = p.save_experiment(name, f"scheduled run {flow_run.name} ({flow_run.id}): {', '.join(ran)}")
    logger.info("Saved as DVC experiment %s%s", name, f" (stale in it: {', '.join(stale)})" if stale else "")
    out = {"ran": ran, "experiment": name}
    if push:
        out["push"] = p.push()
        logger.info("dvc push: %s", out["push"])
    if report:
        from flows.report import write_report

        out["report"] = str(write_report([name], Path("reports") / f"{name}.html"))
        logger.info("Report: %s", out["report"])
    return out


class _ExitSaidAbove(logging.Filter):
    """Drops the runner's report that a flow run's process exited with status 1, and the hint
    after it ("Check the flow run logs for an unhandled exception"): that process has said why
    above, in its error line or with its traceback."""

    def __init__(self) -> None:
        super().__init__()
        self.hint_due: set = set()  # runs whose next runner line is that hint

    def filter(self, record: logging.LogRecord) -> bool:
        if "runner" not in record.name:
            return True
        run = getattr(record, "flow_run_id", None)
        if re.search(r"exited with status code: 1\b", record.getMessage()):
            self.hint_due.add(run)
            return False
        if run in self.hint_due and record.levelno == logging.INFO:
            self.hint_due.discard(run)
            return False
        return True


def serve(name: str, cron: str, overrides: list[str], push: bool, timezone_name: str | None) -> None:
    """Register the deployment with its schedule and run its flow runs here until interrupted."""
    from prefect.logging.handlers import PrefectConsoleHandler
    from prefect.schedules import Cron

    log_to_file("serve")  # the runner's own lines, those the console drops included
    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler):
            handler.addFilter(_ExitSaidAbove())
    scheduled_run.serve(
        name=name,
        schedule=Cron(cron, timezone=timezone_name) if timezone_name else Cron(cron),
        parameters={"overrides": overrides, "push": push, "prefix": name},
        description="Reproduce the retrosight pipeline, save the run as a DVC experiment, push it, write its report.",
    )
