"""The `retrosight` command line."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Hindsight data and offline training for multi-turn LLM agents.")
console = Console()


def _stage_flows() -> dict:
    from flows.bootstrap import bootstrap_flow
    from flows.collect import collect_flow
    from flows.evaluate import evaluate_flow
    from flows.label import label_flow
    from flows.regenerate import regenerate_flow
    from flows.relabel import relabel_flow
    from flows.standardize import standardize_flow
    from flows.summarize import summarize_flow
    from flows.train import train_flow

    return {
        "bootstrap": bootstrap_flow,
        "collect": collect_flow,
        "summarize": summarize_flow,
        "relabel": relabel_flow,
        "regenerate": regenerate_flow,
        "label": label_flow,
        "standardize": standardize_flow,
        "train": train_flow,
        "evaluate": evaluate_flow,
    }


def _fail(msg: str) -> None:
    console.print(f"[red]error:[/] {msg}")
    raise typer.Exit(2)


@app.command()
def run(
    stage: Annotated[Optional[str], typer.Argument(help="Run this stage and what depends on it.")] = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Rerun even if DVC finds nothing changed.")] = False,
) -> None:
    """Reproduce the pipeline through DVC; stale stages run as Prefect flows, the rest are skipped."""
    from flows import pipeline as p
    from tasks.params import ParamsError, load_params

    try:
        load_params()  # fail before any work on a bad params.yaml
    except ParamsError as e:
        _fail(str(e))
    names = p.stage_names()
    if stage is not None and stage not in names:
        _fail(f"unknown stage '{stage}' (stages: {', '.join(names)})")
    t0 = time.time()
    if stage is None and not force and not p.stale_stages():
        console.print(f"Pipeline is up to date; nothing to run ({time.time() - t0:.1f}s).")
        return
    todo = p.downstream(stage) if stage else names
    try:
        result = p.pipeline(todo, force=force)
    except p.StageFailed as e:  # DVC and the stage already printed the cause above
        _fail(str(e))
    for name, outcome in result.items():
        console.print(f"  {name}: {outcome}")
    console.print(f"Done in {time.time() - t0:.1f}s.")
    if "evaluate" in result:
        results()


@app.command()
def results(
    metrics: Annotated[Path, typer.Option(help="The evaluate stage's metrics file.")] = Path("data/evaluate/metrics.json"),
) -> None:
    """The evaluation table: held-out success, return and turns per policy, with standard errors."""
    import json

    if not metrics.exists():
        _fail(f"{metrics}: no evaluation yet; run `retrosight run` first")
    m = json.loads(metrics.read_text())
    s = m["sampling"]
    table = Table(title=f"Success rate on held-out tasks ({m['episodes_per_task']} episodes per task, T={s['temperature']})")
    table.add_column("policy", no_wrap=True)
    for col in (*m["splits"], "held-out", "return", "turns"):
        table.add_column(col, justify="right", no_wrap=True)
    for name, r in m["policies"].items():
        h = r["heldout"]
        table.add_row(
            name,
            *(f"{r[split]['success_rate']:.3f}±{r[split]['success_se']:.3f}" for split in [*m["splits"], "heldout"]),
            f"{h['mean_return']:.1f}±{h['return_se']:.1f}",
            f"{h['mean_turns']:.1f}±{h['turns_se']:.1f}",
        )
    console.print(table)
    console.print("mean ± standard error over episodes; held-out = all evaluated splits together")


@app.command("stage", hidden=True)
def stage_cmd(name: str) -> None:
    """Run one stage's flow in this process (the `cmd` of each dvc.yaml stage)."""
    flows = _stage_flows()
    if name not in flows:
        _fail(f"unknown stage '{name}' (stages: {', '.join(flows)})")
    from flows.pipeline import PARENT_TASK_ENV

    parent = os.environ.get(PARENT_TASK_ENV)
    if parent:
        from flows.linking import run_as_child

        run_as_child(flows[name], parent)
    else:
        flows[name]()


@app.command()
def inspect(
    sql: Annotated[Optional[str], typer.Option("--sql", help="Run a DuckDB query over the stage tables.")] = None,
    data: Annotated[Path, typer.Option(help="Data directory.")] = Path("data"),
) -> None:
    """Tables with row counts, schema and reward/success statistics; or a SQL query over them."""
    from storage.catalog import list_tables, open_catalog

    con = open_catalog(data)
    if sql:
        try:
            rel = con.sql(sql)
        except Exception as e:  # DuckDB's own message names the table or column
            _fail(str(e).splitlines()[0])
        if rel is None:
            return
        _print_rows(rel.columns, rel.fetchall(), title=None)
        return
    tables = list_tables(data)
    if not tables:
        console.print(f"No tables under {data}/ yet: run `retrosight run` first.")
        return
    overview = Table(title=f"Tables under {data}/")
    for col in ("view", "rows", "schema", "file"):
        overview.add_column(col)
    for t in tables:
        overview.add_row(f"{t.stage}.{t.table}", str(t.rows), f"{t.schema_name} v{t.schema_version}", str(t.path))
    console.print(overview)
    for t in tables:
        if t.schema_name != "trajectories":
            continue
        view = f'"{t.stage}"."{t.table}"'
        q = (
            "SELECT split, source, count(*) AS rows, count(DISTINCT task_id) AS tasks, "
            "round(avg(success::INT), 3) AS success, round(avg(\"return\"), 2) AS \"return\", "
            "round(stddev_samp(\"return\"), 2) AS std, min(\"return\") AS min, "
            "max(\"return\") AS max, round(avg(num_turns), 2) AS turns "
            f"FROM {view} GROUP BY ALL ORDER BY ALL"
        )
        rel = con.sql(q)
        _print_rows(rel.columns, rel.fetchall(), title=f"{t.stage}.{t.table}: reward and success")
    traj = next((t for t in tables if t.schema_name == "trajectories"), None)
    if traj is not None:
        described = con.sql(f'DESCRIBE "{traj.stage}"."{traj.table}"').fetchall()
        _print_rows(["column", "type"], [(r[0], r[1]) for r in described], title="Trajectory schema")


def _print_rows(columns: list[str], rows: list[tuple], title: str | None) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(str(c))
    for r in rows:
        table.add_row(*("" if v is None else str(v) for v in r))
    console.print(table)


@app.command("import")
def import_cmd(
    file: Annotated[Path, typer.Argument(help="JSONL or Parquet of chat-format trajectories.")],
    env: Annotated[Optional[str], typer.Option(help="Environment name for rows that lack one.")] = None,
    on_error: Annotated[str, typer.Option(help="quarantine: keep bad rows with their reason; raise: stop at the first.")] = "quarantine",
    out: Annotated[Path, typer.Option(help="Output directory.")] = Path("data/import"),
) -> None:
    """Import logged trajectories, validating every row."""
    from tasks.ingest import ImportValidationError, write_import

    if on_error not in ("quarantine", "raise"):
        _fail("--on-error must be 'quarantine' or 'raise'")
    if not file.exists():
        _fail(f"{file}: no such file")
    try:
        counts = write_import(file, out, env=env, on_error=on_error)
    except (ImportValidationError, ValueError) as e:
        _fail(str(e))
    console.print(
        f"{file}: {counts['rows_in']} rows read, {counts['imported']} imported, "
        f"{counts['quarantined']} quarantined -> {out}/"
    )
    if counts["quarantined"]:
        console.print("See why: retrosight inspect --sql \"SELECT row, field, reason FROM import.quarantine\"")


def main() -> None:
    # No telemetry from the ephemeral server: this machine may have no route out, and no run
    # should depend on one.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The ephemeral API's first start on a new machine compiles the server and migrates a new
    # database; Prefect's 20 s default was seen to run out on 2 cores.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    app()


if __name__ == "__main__":
    sys.exit(main())
