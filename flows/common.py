"""What every stage flow shares: where its data lives and how it reports."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.parquet as pq
import yaml
from prefect.artifacts import create_markdown_artifact
from prefect.context import get_run_context

DATA = Path("data")
# Every trajectory the later stages work on: the logged ones and their hindsight regenerations.
TRAJECTORIES = [DATA / "collect" / "trajectories.parquet", DATA / "regenerate" / "trajectories.parquet"]
# Columns summarised in a stage's artifact when its output has them.
REWARD_COLUMNS = ("return", "reward", "standardized_reward", "weight")
OK_STATUSES = ("ok", "tied", "singleton")  # standardize's tied and singleton groups are not failures
FAILURE_WORDS = ("fail", "invalid", "quarantin", "error")


def _stage_files(stage: str) -> tuple[list[Path], list[Path]]:
    """The Parquet files the stage reads and writes, as dvc.yaml declares them."""
    spec = yaml.safe_load(Path("dvc.yaml").read_text())["stages"][stage]

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
    create_markdown_artifact(key=f"retrosight-{stage}", markdown="\n".join(body), description=f"{stage}: rows, failures, rewards, time")
