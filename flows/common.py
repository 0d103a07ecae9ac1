"""What every stage flow shares: where its data lives, how it reports, and how a failure is told."""
from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from storage.revisions import lookup

DATA = Path("data")
# Every trajectory the later stages work on: the logged ones and their hindsight regenerations.
TRAJECTORIES = [DATA / "collect" / "trajectories.parquet", DATA / "regenerate" / "trajectories.parquet"]
# Columns summarised in a stage's artifact when its output has them.
REWARD_COLUMNS = ("return", "reward", "standardized_reward", "weight")
OK_STATUSES = ("ok", "tied", "singleton")  # standardize's tied and singleton groups are not failures
FAILURE_WORDS = ("fail", "invalid", "quarantin", "error")


def _foreach_items(spec: dict) -> dict:
    """A foreach stage's items by key: a literal list or mapping, or `${name}` from params.yaml."""
    items = spec["foreach"]
    if isinstance(items, str) and items.startswith("${") and items.endswith("}"):
        items = lookup(yaml.safe_load(Path("params.yaml").read_text()) or {}, items[2:-1], {})
    return {str(k): v for k, v in items.items()} if isinstance(items, dict) else {str(i): i for i in items or []}


def stage_names(dvc_yaml: Path = Path("dvc.yaml")) -> list[str]:
    """dvc.yaml's stages in order as DVC names them: a foreach group as its items (`iteration@2`)."""
    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    return [n for name, spec in stages.items() for n in ([f"{name}@{k}" for k in _foreach_items(spec)] if "foreach" in spec else [name])]


def stage_spec(stage: str) -> dict:
    """A stage's entry in dvc.yaml; for `group@key`, the group's `do` with ${key} and ${item...} filled in."""
    stages = yaml.safe_load(Path("dvc.yaml").read_text())["stages"]
    if "@" not in stage:
        return stages[stage]
    group, key = stage.split("@", 1)
    item = _foreach_items(stages[group])[key]
    fields = {"key": key, "item": item, **({f"item.{k}": v for k, v in item.items()} if isinstance(item, dict) else {})}
    text = yaml.safe_dump(stages[group]["do"])
    for name, value in fields.items():
        text = text.replace("${" + name + "}", str(value))
    return yaml.safe_load(text)


def stage_roles(stages: list[str]) -> list[str]:
    """The roles these stages call, in params order: those their dvc.yaml params name (a stage
    that names all of `roles` calls any of them)."""
    from tasks.params import Roles

    named = set()
    for stage in stages:
        for key in stage_spec(stage).get("params", []):  # keys of params.yaml
            if key == "roles":
                named.update(Roles.model_fields)
            elif key.startswith("roles."):
                named.add(key.split(".")[1])
    return [name for name in Roles.model_fields if name in named]


def _stage_files(stage: str) -> tuple[list[Path], list[Path]]:
    """The Parquet files the stage reads and writes, as dvc.yaml declares them."""
    spec = stage_spec(stage)

    def parquet(entries: list) -> list[Path]:
        paths = [Path(next(iter(e)) if isinstance(e, dict) else e) for e in entries]
        return [f for p in paths for f in ([p] if p.suffix == ".parquet" else sorted(p.glob("*.parquet")) if p.is_dir() else [])]

    return parquet(spec.get("deps", [])), parquet(spec.get("outs", []))


def _failures(metrics: dict) -> dict[str, int]:
    """Counts in the metrics that are not successes: statuses other than ok, failed/invalid keys."""
    out: dict[str, int] = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and k == "status":
                out.update({f"{key}.{s}": n for s, n in v.items() if s not in OK_STATUSES and n})
            elif isinstance(v, dict):
                walk(v, key + ".")
            elif isinstance(v, int) and not isinstance(v, bool) and v and any(w in k for w in FAILURE_WORDS):
                out[key] = v

    walk(metrics, "")
    return out


def _reward_lines(path: Path) -> list[str]:
    import duckdb

    names = set(pq.read_schema(path).names)
    lines = []
    for col in REWARD_COLUMNS:
        if col not in names:
            continue
        n, mean, std, lo, hi = duckdb.sql(
            f'SELECT count("{col}"), avg("{col}"), stddev_samp("{col}"), min("{col}"), max("{col}") FROM read_parquet(?)',
            params=[str(path)],
        ).fetchall()[0]
        if n:
            lines.append(f"| {path} | {col} | {n} | {mean:.4g} | {(std or 0):.4g} | {lo:.4g} | {hi:.4g} |")
    return lines


def publish(stage: str, metrics: dict) -> None:
    """A Prefect markdown artifact for the stage: rows in and out, failures, reward statistics, time."""
    # Imported here: an error line (say_error) should not wait seconds for Prefect to load.
    from prefect.artifacts import create_markdown_artifact
    from prefect.context import get_run_context

    started = get_run_context().flow_run.start_time
    seconds = (datetime.now(timezone.utc) - started).total_seconds() if started else None
    inputs, outputs = _stage_files(stage)
    body = [f"# {stage}", "", f"**time** {seconds:.1f} s" if seconds is not None else "", ""]
    body += ["| | table | rows |", "|---|---|---|"]
    body += [f"| in | {p} | {pq.read_metadata(p).num_rows} |" for p in inputs if p.exists()]
    body += [f"| out | {p} | {pq.read_metadata(p).num_rows} |" for p in outputs if p.exists()]
    failures = _failures(metrics)
    body += ["", "**failures** " + (", ".join(f"{k} {v}" for k, v in failures.items()) if failures else "**failures** none"), ""]
    rewards = [line for p in outputs if p.exists() for line in _reward_lines(p)]
    if rewards:
        body += ["| table | column | n | mean | std | min | max |", "|---|---|---|---|---|---|---|", *rewards, ""]
    body += ["<details><summary>metrics</summary>", "", "```json", json.dumps(metrics, indent=2, sort_keys=True), "```", "</details>"]
    key = re.sub(r"[^a-z0-9-]", "-", f"retrosight-{stage}".lower())  # Prefect's keys: lowercase, digits, dashes
    create_markdown_artifact(key=key, markdown="\n".join(body), description=f"{stage}: rows, failures, rewards, time")


LOGS = Path(".retrosight/logs")
DEBUG_ENV = "RETROSIGHT_DEBUG"  # set by `retrosight --debug`; stage processes inherit it
# Failures a user acts on from their message alone, by module and class. A class is looked up
# only once its module is loaded (no exception of it can exist before), so the check imports nothing.
EXPECTED = {
    "tasks.roles": "RoleFailure",  # a role past its max_failure_rate
    "tasks.params": "ParamsError",  # a bad param
    "models.base": "BackendUnavailable",  # a server that cannot be reached
    "storage.parquet": "SchemaVersionError",  # an input file of another table or schema version
    "tasks.train.sft": "TrainingDiverged",
    "flows.pipeline": "StageFailed",  # DVC's own errors, and a stage's, as the pipeline reports them
    "models.openai": "MissingAPIKey",  # a role's api_key_env names a variable that is not set
}


def debug() -> bool:
    return os.environ.get(DEBUG_ENV) == "1"


def say_error(msg: str) -> None:
    """The one line an expected failure ends with, wherever a user meets it (`retrosight run`, a
    stage run by DVC, a scheduled run under `retrosight serve`); the run's log file gets it too."""
    from rich.console import Console
    from rich.markup import escape

    # soft_wrap: one line however long, so a command in it can be pasted whole
    Console().print(f"[red]error:[/] {escape(msg)}", soft_wrap=True)
    if (log := logging.getLogger("retrosight")).handlers:  # the run's log file (log_to_file)
        log.error("error: %s", msg)


def expected_failure(e: BaseException, inputs: Sequence[Path] = ()) -> bool:
    """Whether `e` is a failure said in one line (its traceback helps no user): one of EXPECTED,
    or a ValueError about one of the stage's input files (storage names the file first,
    `<path>: not a readable Parquet file: ...`)."""
    for module, name in EXPECTED.items():
        loaded = sys.modules.get(module)
        if loaded is not None and isinstance(e, getattr(loaded, name)):
            return True
    return type(e) is ValueError and str(e).startswith(tuple(f"{p}: " for p in inputs))


def stage_inputs(stage: str) -> list[Path]:
    return _stage_files(stage)[0]


class _QuietExpected(logging.Filter):
    """Drops Prefect's console report of an expected failure: the task's or flow's traceback and
    the "Finished in state Failed" lines after it. The error line says it; the log file keeps it."""

    def __init__(self, inputs: Sequence[Path]):
        super().__init__()
        self.inputs, self.seen = inputs, False

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and expected_failure(exc, self.inputs):
            self.seen = True
            return False
        return not (self.seen and record.getMessage().startswith("Finished in state Failed"))


def log_to_file(name: str, inputs: Sequence[Path] = ()) -> Path:
    """Send every log record of this process (Prefect's included, tracebacks and all) to
    .retrosight/logs/<name>.log, rewritten each run, and, unless --debug, keep expected failures'
    tracebacks off the console."""
    from prefect.logging.handlers import PrefectConsoleHandler  # importing prefect sets up its handlers

    LOGS.mkdir(parents=True, exist_ok=True)
    path = LOGS / f"{name}.log"
    handler = logging.FileHandler(path, mode="w", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)-7s | %(name)s - %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    # Our own lines (the error line at the end) go to the file alone: the console has them already.
    own = logging.getLogger("retrosight")
    own.propagate = False
    own.setLevel(logging.INFO)
    own.addHandler(handler)
    if not debug():
        for h in root.handlers:
            if isinstance(h, PrefectConsoleHandler):
                h.addFilter(_QuietExpected(inputs))
    return path
