"""The `retrosight` command line."""
from __future__ import annotations

import json
import os
import sys
import time

_STARTED = time.time()  # the stage timings' start: everything after the interpreter's own start-up

from pathlib import Path  # noqa: E402
from typing import Annotated, NoReturn, Optional  # noqa: E402

import typer  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Hindsight data and offline training for multi-turn LLM agents.")
console = Console()


# Each stage's flow, by module: `retrosight stage NAME` imports only NAME's (the actor's TRL alone
# takes seconds to import, paid otherwise by every stage's process).
STAGE_FLOWS = {
    "bootstrap": "flows.bootstrap:bootstrap_flow",
    "collect": "flows.collect:collect_flow",
    "forward": "flows.forward:forward_flow",
    "summarize": "flows.summarize:summarize_flow",
    "relabel": "flows.relabel:relabel_flow",
    "regenerate": "flows.regenerate:regenerate_flow",
    "proposer": "flows.proposer:proposer_flow",
    "label": "flows.label:label_flow",
    "standardize": "flows.standardize:standardize_flow",
    "buffer": "flows.buffer:buffer_flow",
    "critic": "flows.critic:critic_flow",
    "actor": "flows.actor:actor_flow",
    "expert": "flows.expert:expert_flow",
    "practice": "flows.practice:practice_flow",
    "stepagent": "flows.stepagent:stepagent_flow",
    "stepagent_iteration": "flows.stepagent_iteration:stepagent_iteration_flow",  # foreach: `stepagent_iteration@K`
    "stepagent_select": "flows.stepagent_select:stepagent_select_flow",
    "train": "flows.train:train_flow",
    "evaluate": "flows.evaluate:evaluate_flow",
    "iteration": "flows.iteration:iteration_flow",  # dvc.yaml's foreach: `iteration@K`
    "nlac_iteration": "flows.nlac_iteration:nlac_iteration_flow",  # foreach: `nlac_iteration@K`
}
FOREACH = ("iteration", "stepagent_iteration", "nlac_iteration")  # dvc.yaml's foreach groups: one stage per iteration K


def _stage_flow(group: str):
    import importlib

    module, _, attr = STAGE_FLOWS[group].partition(":")
    return getattr(importlib.import_module(module), attr)


@app.callback()
def _options(
    debug: Annotated[bool, typer.Option("--debug", help="Print the traceback of every failure, expected ones too (they are always in .retrosight/logs/).")] = False,
) -> None:
    if debug:
        from flows.common import DEBUG_ENV

        os.environ[DEBUG_ENV] = "1"  # the stage processes DVC starts inherit it


def _fail(msg: str) -> NoReturn:
    from flows.common import say_error

    say_error(msg)
    raise typer.Exit(2)


def _show(renderable) -> None:
    """Print a table whole. To a file or a pipe rich assumes 80 columns (or $COLUMNS) and cuts
    what does not fit (`0.000±0.0…`); there it gets the width it needs."""
    if console.is_terminal:
        console.print(renderable)
        return
    from rich.measure import Measurement

    needed = Measurement.get(console, console.options.update_width(10**6), renderable).maximum
    Console(width=max(needed, console.width)).print(renderable)  # print(width=) is capped at the console's


def _in_project() -> None:
    if not Path("dvc.yaml").exists():
        _fail(f"no dvc.yaml in {Path.cwd()}: run retrosight from the project's directory")


@app.command()
def run(
    stage: Annotated[Optional[str], typer.Argument(help="Run this stage and what depends on it.")] = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Rerun even if DVC finds nothing changed.")] = False,
    only: Annotated[bool, typer.Option("--only", help="Run just STAGE, nothing after it; refused if its inputs are stale.")] = False,
    set_param: Annotated[Optional[list[str]], typer.Option("--set-param", "-S", help="Override a param for this run, e.g. -S relabel.k=8 (recorded as a DVC experiment).")] = None,
    name: Annotated[Optional[str], typer.Option("--name", "-n", help="Save the run as a DVC experiment with this name.")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="If another run holds this workspace, wait for it instead of refusing.")] = False,
    preset: Annotated[Optional[Path], typer.Option("--preset", help="Lay a params file over params.yaml first, as the benchmarks do (bench/presets/); -S overrides it. Recorded as a DVC experiment.")] = None,
) -> None:
    """Reproduce the pipeline through DVC; stale stages run as Prefect flows, the rest are skipped."""
    from flows import pipeline as p

    _in_project()
    names = p.stage_names()
    if stage is not None and stage not in names and not set_param and not preset:  # with -S, checked after the overrides
        _fail(f"unknown stage '{stage}' (stages: {', '.join(names)})")
    if only and stage is None:
        _fail("--only needs a STAGE")
    try:
        with p.workspace_lock("retrosight " + " ".join(sys.argv[1:]), wait, on_wait=console.print):
            _run(stage, force, only, set_param, name, preset)
    except p.WorkspaceBusy as e:
        _fail(str(e))


def _run(stage: str | None, force: bool, only: bool, set_param: list[str] | None, name: str | None, preset: Path | None = None) -> None:
    from flows import pipeline as p
    from flows.common import log_to_file, stage_roles
    from flows.schedule import run_name
    from storage.revisions import list_versions
    from tasks.params import load_params
    from tasks.roles import check_api_keys

    log_to_file("run")  # once the workspace is ours: a refused run must not truncate the running one's log
    params_file = Path("params.yaml")
    original = params_file.read_text()

    def refuse(message: str) -> None:  # before any work: params.yaml as it was
        params_file.write_text(original)
        _fail(message)

    try:
        if preset is not None:
            p.apply_preset(preset, params_file)
        if set_param:
            p.apply_overrides(set_param, params_file)
        params = load_params()  # fail before any work on a bad params.yaml
    except ValueError as e:  # ParamsError, or an override Hydra cannot apply
        refuse(str(e))
    names = p.stage_names()  # after the overrides: `iterations` adds stages
    if stage is not None and stage not in names:
        refuse(f"unknown stage '{stage}' (stages: {', '.join(names)})")
    if restored := p.restore_cut_lock():
        console.print(restored)
    try:
        if only and (stale := p.stale_upstream(stage)):
            refuse(f"--only {stage}: its inputs are stale ({', '.join(stale)} changed); run `retrosight run {stage}` to rerun them too")
        t0 = time.time()
        experiment = name or (run_name("run", None) if set_param or preset else None)
        if experiment and experiment in {v.name for v in list_versions(Path("."))}:
            refuse(f"--name {experiment}: a version of that name exists (see `retrosight versions`); choose another")
        if stage is None and not force and not experiment and not p.stale_stages():
            console.print(f"Pipeline is up to date; nothing to run ({time.time() - t0:.1f}s).")
            return
        todo = [stage] if only else p.downstream(stage) if stage else names
    except p.StageFailed as e:  # DVC's own error, in the message
        _fail(str(e))
    try:
        check_api_keys(params, stage_roles(todo))  # a stage hours in would meet it, and not know the role
    except ValueError as e:  # MissingAPIKey
        refuse(str(e))
    try:
        result = p.run_pipeline(todo, force=force, preload=params.runtime.preload)
    except p.StageFailed as e:  # a stage's cause is printed above it; DVC's own, in the message
        _fail(str(e))
    for stage_name, outcome in result.items():
        console.print(f"  {stage_name}: {outcome['outcome']}")
    if timed := {s: o for s, o in result.items() if "seconds" in o}:
        _show(_timings_table(timed))
    console.print(f"Done in {time.time() - t0:.1f}s.")
    if experiment:
        what = " ".join([*([f"--preset {preset}"] if preset else []), *(set_param or [])]) or "no overrides"
        try:
            stale = p.save_experiment(experiment, f"retrosight run {stage or ''} {what}".replace("  ", " "))
        except p.StageFailed as e:
            _fail(str(e))
        console.print(f"Saved as DVC experiment [bold]{experiment}[/] (see `retrosight versions`).")
        if stale:
            console.print(
                f"Left stale in it, as in the workspace: {', '.join(stale)} (inputs changed since it ran; its tables are the older ones). "
                f"`retrosight run {stale[0]}` brings it up to date."
            )
    if "evaluate" in result:
        results()


@app.command()
def serve(
    cron: Annotated[str, typer.Option(help='When to run, as a cron expression, e.g. "0 3 * * *".')],
    name: Annotated[str, typer.Option(help="Deployment name; each run's experiment is named after it.")] = "nightly",
    set_param: Annotated[Optional[list[str]], typer.Option("--set-param", "-S", help="Override a param in every scheduled run.")] = None,
    push: Annotated[bool, typer.Option(help="dvc push to the default remote after each run.")] = True,
    tz: Annotated[Optional[str], typer.Option("--timezone", help="Time zone of the cron expression (default UTC).")] = None,
) -> None:
    """Run the pipeline on a schedule: a Prefect deployment served from this workspace.

    Needs a Prefect server (`prefect server start`, then PREFECT_API_URL). Each run is saved as a
    DVC experiment named after it, pushed to the DVC remote, and gets a report under reports/.
    """
    _in_project()
    from prefect.client.schemas.schedules import CronSchedule
    from pydantic import ValidationError

    from flows.schedule import FLOW_NAME
    from flows.schedule import serve as serve_deployment

    try:
        CronSchedule(cron=cron, timezone=tz)
    except ValidationError:
        _fail(f"--cron '{cron}' --timezone {tz or 'UTC'}: not a cron expression (five fields, e.g. \"0 3 * * *\") or an unknown time zone")
    from flows.common import stage_names, stage_roles
    from flows.pipeline import params_with
    from tasks.roles import check_api_keys

    # What every scheduled run will read and need, refused now rather than at 3 am: the params
    # with the overrides applied, and the API keys of the roles the stages call.
    try:
        check_api_keys(params_with(set_param or []), stage_roles(stage_names()))
    except ValueError as e:  # ParamsError, an override Hydra cannot apply, MissingAPIKey
        _fail(str(e))
    if not os.environ.get("PREFECT_API_URL"):
        _fail("serve needs a Prefect server: start one with `prefect server start` and set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api)")
    console.print(f"Serving {FLOW_NAME}/{name} on '{cron}'; trigger a run now with `prefect deployment run {FLOW_NAME}/{name}`.")
    serve_deployment(name, cron, set_param or [], push, tz)


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
    _show(table)
    console.print("mean ± standard error over episodes; held-out = all evaluated splits together")


@app.command("stage", hidden=True)
def stage_cmd(name: str) -> None:
    """Run one stage's flow in this process (the `cmd` of each dvc.yaml stage; `group@key` for a foreach item)."""
    group, _, key = name.partition("@")
    if group not in STAGE_FLOWS or bool(key) != (group in FOREACH):
        _fail(f"unknown stage '{name}' (stages: {', '.join(STAGE_FLOWS)}; {', '.join(f'{g}@K' for g in FOREACH)} for an iteration K)")
    if key and not key.isdigit():
        _fail(f"unknown stage '{name}': {group}@K takes a number")
    from flows.relay import relay, started

    if (status := relay(_STARTED)) is not None:  # the run's stage server has the imports: its child runs the stage
        raise typer.Exit(status)
    t_process = started(_STARTED)
    stage_flow, parameters = _stage_flow(group), ({"iteration": int(key)} if key else {})
    import logging

    from flows.common import expected_failure, log_to_file, stage_inputs
    from flows.linking import ERROR_FILE_ENV
    from flows.pipeline import PARENT_TASK_ENV, TIMINGS_FILE_ENV

    inputs = stage_inputs(name)
    log = log_to_file(name, inputs)
    parent = os.environ.get(PARENT_TASK_ENV)
    t_flow = time.time()
    try:
        if parent:
            from flows.linking import run_as_child

            metrics = run_as_child(stage_flow, parent, parameters)
        else:
            metrics = stage_flow(**parameters)
        if timings := os.environ.get(TIMINGS_FILE_ENV):  # for `retrosight run`'s table of where each stage's time went
            work = metrics.get("seconds") if isinstance(metrics, dict) else None
            Path(timings).write_text(json.dumps({"process": t_process, "flow": t_flow, "end": time.time(), "work": work}))
    except Exception as e:
        if not expected_failure(e, inputs):
            raise
        # The reason, in one line; its traceback is in the log (Prefect wrote it there).
        line = f"{e} [traceback: {log}]"
        if error_file := os.environ.get(ERROR_FILE_ENV):  # `retrosight run` ends with the line
            logging.getLogger("retrosight").error("error: %s", line)
            Path(error_file).write_text(line + "\n")
            raise typer.Exit(2) from None
        _fail(line)


def _timings_table(timed: dict[str, dict]) -> Table:
    """Where each stage's seconds went: its own work, and the start-up around it."""
    table = Table(title="Seconds by stage: start-up is DVC until the stage's process, its imports, and Prefect's share of the flow")
    for col in ("stage", "seconds", "work", "start-up", "DVC", "imports", "Prefect", "DVC after"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    keys = ("seconds", "work", "startup", "dvc", "imports", "prefect", "after")
    for name, t in [*timed.items(), ("total", {k: sum(t[k] for t in timed.values()) for k in keys})]:
        table.add_row(name, *(f"{t[k]:.1f}" for k in keys))
    return table


def _revision(rev: Optional[str]):
    from storage.revisions import Revision

    return Revision(Path("."), rev)


@app.command()
def inspect(
    table: Annotated[Optional[str], typer.Argument(help="A table, `<stage>.<table>` or `<table>`: show its schema and first rows.")] = None,
    rev: Annotated[Optional[str], typer.Option("--rev", help="A version from `retrosight versions` (experiment, commit, tag); default the workspace.")] = None,
    sql: Annotated[Optional[str], typer.Option("--sql", help="Run a DuckDB query over the stage tables.")] = None,
    limit: Annotated[int, typer.Option(help="Rows to show of TABLE.")] = 10,
) -> None:
    """Tables with row counts, schema and reward/success statistics; one table; or a SQL query.

    At --rev, files are read from the DVC cache (or the remote), never by checking out.
    """
    from storage.catalog import open_catalog, quote_ident
    from storage.revisions import RevisionError

    revision = _revision(rev)
    try:
        tables = revision.tables()
        con = open_catalog(infos=tables)
        if table and not sql:
            info = revision.table(table)
        stale = revision.stale_stages() if rev else {}
    except (RevisionError, ValueError) as e:
        _fail(str(e))
    for stage, why in stale.items():  # on stderr: --sql output stays clean to pipe on
        Console(stderr=True).print(f"note: at {revision.label}, {stage} is stale ({why} since it ran): its tables are from the older inputs", soft_wrap=True)
    if table and not sql:
        # One record per block: these tables are too wide for columns.
        console.print(f"[bold]{info.stage}.{info.table}[/] at {revision.label}: {info.rows} rows, {info.schema_name} v{info.schema_version}")
        rel = con.sql(f"SELECT * FROM {quote_ident(info.stage)}.{quote_ident(info.table)} LIMIT {int(limit)}")
        for i, row in enumerate(rel.fetchall()):
            record = Table(title=f"row {i}", show_header=False, title_justify="left")
            record.add_column("field", style="bold", no_wrap=True)
            record.add_column("value", overflow="fold")
            for col, value in zip(rel.columns, row):
                text = str(value)
                record.add_row(col, text if len(text) <= 400 else text[:400] + f"... ({len(text)} chars)")
            console.print(record)
        return
    if sql:
        try:
            rel = con.sql(sql)
        except Exception as e:  # DuckDB's own message names the table or column
            _fail(str(e).splitlines()[0])
        if rel is None:
            return
        _print_rows(rel.columns, rel.fetchall(), title=None)
        return
    if not tables:
        console.print(f"No tables at {revision.label} yet: run `retrosight run` first.")
        return
    overview = Table(title=f"Tables at {revision.label}")
    for col in ("view", "rows", "schema", "file"):
        overview.add_column(col)
    for t in tables:
        overview.add_row(f"{t.stage}.{t.table}", str(t.rows), f"{t.schema_name} v{t.schema_version}", _repo_path(t))
    _show(overview)
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


def _repo_path(t) -> str:
    """A table's file in the repository, from its catalog name (storage.catalog.stage_of:
    `iteration2_collect` is data/iteration2/collect/): at a revision, the file read is a copy in
    the DVC cache or a temporary directory, whose path tells a user nothing."""
    iteration, _, stage = t.stage.partition("_") if t.stage.startswith("iteration") else ("", "", t.stage)
    return str(Path("data", iteration, stage, f"{t.table}.parquet"))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{0.0 if abs(v) < 1e-9 else v:.4g}"  # a mean of z-scores is 0 up to rounding
    return "-" if v is None else str(v)


def _key_metrics(metrics: dict) -> str:
    """Held-out success of the base policy and the best fine-tuned one."""
    policies = metrics.get("evaluate", {}).get("policies", {})
    if not policies:
        return ""
    rates = {k: v["heldout"]["success_rate"] for k, v in policies.items()}
    base = rates.pop("bootstrap", None)
    best = max(rates, key=rates.get) if rates else None
    parts = ([f"bootstrap {base:.3f}"] if base is not None else []) + ([f"best {best} {rates[best]:.3f}"] if best else [])
    return ", ".join(parts)


@app.command()
def versions(
    limit: Annotated[int, typer.Option(help="Show the newest N versions.")] = 20,
) -> None:
    """Past runs (DVC experiments and commits of dvc.lock): date, changed params, rows, key metrics."""
    from storage.revisions import Revision, list_versions, params_diff

    found = list_versions(Path("."))
    if not found:
        console.print("No versions yet: `retrosight run -S key=value` or `--name NAME` saves a run as a DVC experiment; `git commit dvc.lock` records one too.")
        return
    table = Table(title="Versions (oldest first); read one with `retrosight inspect TABLE --rev NAME`")
    for col in ("name", "kind", "date", "changed params (vs the version before)", "rows", "held-out success", "stale stages"):
        table.add_column(col, no_wrap=col in ("name", "date"))
    previous, any_stale = None, False
    shown = found[-limit:]
    start = len(found) - len(shown)
    if start:
        previous = Revision(Path("."), found[start - 1].rev).params()
    for v in shown:
        revision = Revision(Path("."), v.rev)
        params = revision.params()
        changed = params_diff(previous, params) if previous is not None else {}
        previous = params
        counts = revision.row_counts()
        rows = "\n".join(f"{k.split('.')[0]} {n}" for k, n in counts.items() if k.split(".")[1] in ("trajectories", "relabels", "labels", "train"))
        if revision.missing:
            rows += f"\n({len(revision.missing)} tables not in cache)"
        lines = [f"{k}: {_fmt(a)} -> {_fmt(b)}" for k, (a, b) in changed.items()]
        if len(lines) > 4:  # `retrosight diff` lists them all
            lines = lines[:3] + [f"... {len(lines) - 3} more"]
        table.add_row(
            v.name, v.kind, v.date.replace("T", " ")[:16],
            "\n".join(lines) or ("(first)" if v is found[0] else "-"),
            rows.strip(), _key_metrics(revision.metrics()),
            ", ".join(stale := revision.stale_stages()) or "-",
        )
        any_stale = any_stale or bool(stale)
    _show(table)
    if any_stale:
        console.print("stale: the stage's inputs changed after it ran, so its tables in that version come from the older inputs")


@app.command()
def lineage(
    trajectory_id: Annotated[str, typer.Argument(help="A trajectory id (or a unique prefix of one).")],
    rev: Annotated[Optional[str], typer.Option("--rev", help="A version from `retrosight versions`; default the workspace.")] = None,
) -> None:
    """One trajectory's lineage: original, summary, relabel, regeneration, label, standardized weight."""
    from rich.tree import Tree

    from storage.catalog import open_catalog
    from storage.lineage import LineageError
    from storage.lineage import lineage as find_lineage
    from storage.revisions import RevisionError

    try:
        revision = _revision(rev)
        found = find_lineage(open_catalog(infos=revision.tables()), trajectory_id)
    except (LineageError, RevisionError, ValueError) as e:
        _fail(str(e))
    labels = {r["trajectory_id"]: r for r in found["labels"]}
    training = {r["trajectory_id"]: r for r in found["training"]}
    relabels = {r["relabel_id"]: r for r in found["relabels"]}

    def describe(t: dict) -> str:
        outcome = "success" if t["success"] else "failure"
        return f"[bold]{t['source']}[/] {t['trajectory_id']}  task {t['task_id']} ({t['split']}), {t['num_turns']} turns, return {_fmt(t['return'])}, {outcome}"

    def attach(node, t: dict) -> None:
        lab = labels.get(t["trajectory_id"])
        if lab:
            node.add(f"label: reward {_fmt(lab['reward'])} by {lab['labeler']} ({lab['model']}), {lab['status']}: {lab['reason']}")
        else:
            node.add("label: none")
        tr = training.get(t["trajectory_id"])
        if tr:
            node.add(
                f"training: standardized reward {_fmt(tr['standardized_reward'])} (group of {tr['group_size']}, mean {_fmt(tr['group_mean'])}, "
                f"std {_fmt(tr['group_std'])}, {tr['standardize_status']}), Refit weight {_fmt(tr['weight'])}"
            )
        else:
            node.add("training: not in the training table (a held-out split, or not labelled)")

    chain = found["chain"]
    tree = Tree(f"lineage of {chain[-1]['trajectory_id']} at {revision.label}")
    node = tree.add(describe(chain[0]))
    summary = found["summary"]
    node.add(f"summary ({summary['backend']}, {summary['status']}): {summary['summary'] or summary['reason']}" if summary else "summary: none")
    attach(node, chain[0])
    for t in chain[1:]:
        r = relabels.get(t["relabel_id"])
        if r:
            node = node.add(
                f"relabel {r['relabel_id']} at turn {r['branch_turn']} ({r['mode']}, {r['proposer']}): "
                f"\"{r['original_action']}\" -> \"{r['counterfactual_action']}\"; rationale: {r['rationale']}"
            )
        node = node.add(describe(t))
        attach(node, t)
    if len(chain) == 1:
        for r in found["relabels"]:
            node.add(f"relabel {r['relabel_id']} at turn {r['branch_turn']}: \"{r['original_action']}\" -> \"{r['counterfactual_action']}\" ({r['status']})")
        for c in found["children"]:
            node.add(f"regeneration {c['trajectory_id']} from turn {c['branch_turn']}: return {_fmt(c['return'])}, {'success' if c['success'] else 'failure'}")
    console.print(tree)


@app.command()
def diff(
    rev_a: Annotated[str, typer.Argument(help="The older version (name from `retrosight versions`, or any git revision).")],
    rev_b: Annotated[str, typer.Argument(help="The newer version; `workspace` for the files on disk.")] = "workspace",
) -> None:
    """What changed between two versions: params, and per table rows and reward distributions."""
    from storage.diff import diff as diff_revisions
    from storage.revisions import RevisionError

    try:
        a, b = _revision(rev_a), _revision(rev_b)
        d = diff_revisions(a, b)
    except (RevisionError, ValueError) as e:
        _fail(str(e))
    params = Table(title=f"params: {rev_a} -> {rev_b}")
    for col in ("param", rev_a, rev_b):
        params.add_column(col)
    for k, (va, vb) in d["params"].items():
        params.add_row(k, _fmt(va), _fmt(vb))
    if d["params"]:
        _show(params)
    else:
        console.print("params: identical")
    from rich import box

    tables = Table(title=f"tables: a = {rev_a}, b = {rev_b}", box=box.SIMPLE_HEAD)
    for col in ("table", "", "rows", "column", "mean", "std", "p10", "p50", "p90", "KS"):
        tables.add_column(col, no_wrap=True, justify="left" if col in ("table", "", "column") else "right")

    def counts(d: dict) -> str:
        return ", ".join(f"{k} {v}" for k, v in d.items()) or "-"

    statuses = []
    for name, t in d["tables"].items():
        columns = list(t["columns"].items()) or [("", None)]
        for i, (label, rows) in enumerate((("a", t["rows"][0]), ("b", t["rows"][1]))):
            for j, (col, stats) in enumerate(columns):
                side = (stats or {}).get("a" if i == 0 else "b") or {}
                tables.add_row(
                    name if i == j == 0 else "", label if j == 0 else "", _fmt(rows) if j == 0 else "", col,
                    *((_fmt(side.get(k)) if stats else "") for k in ("mean", "std", "p10", "p50", "p90")),
                    _fmt(stats["ks"]) if stats and i == 0 else "",
                )
        if t["status"] and t["status"][0] != t["status"][1]:
            statuses.append(f"{name} status: {counts(t['status'][0])} -> {counts(t['status'][1])}")
        tables.rows[-1].end_section = True
    _show(tables)
    for line in statuses:
        console.print(line)
    console.print("KS: the largest gap between the two empirical distributions (0 = identical, 1 = disjoint).")


@app.command()
def report(
    rev: Annotated[Optional[list[str]], typer.Option("--rev", help="Version(s) to plot; two or more are overlaid. Default the workspace.")] = None,
    out: Annotated[Optional[Path], typer.Option(help="HTML file to write (default reports/<rev>.html).")] = None,
    repro: Annotated[Optional[Path], typer.Option(help="A reproduction's results (bench/hindsight_repro.py --results DIR): success by arm and seed.")] = None,
) -> None:
    """One static HTML page with the run's DVC plots (rewards before/after hindsight, weights, loss, success)."""
    from flows.report import default_report_path, write_report

    try:
        path = write_report(rev or None, out or default_report_path(rev or None), repro=repro)
    except ValueError as e:
        _fail(str(e))
    console.print(f"Wrote {path}")


def _print_rows(columns: list[str], rows: list[tuple], title: str | None) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(str(c))
    for r in rows:
        table.add_row(*("" if v is None else str(v) for v in r))
    _show(table)


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
    # torch's threads and their wait policy, before anything loads torch; the stages DVC starts
    # from here inherit them.
    from tasks.runtime import apply_from_file

    apply_from_file()
    app()


if __name__ == "__main__":
    sys.exit(main())
