"""expert: StepAgent's expert trajectories (its T), as data.

StepAgent learns from expert trajectories (ETO's releases, GPT-4's runs) that no machine here can
fetch. Every environment ships a scripted expert among its behaviour policies (Environment.policies
"expert"): it plays `expert.m` episodes of each task of `expert.splits` (StepAgent, as ETO: the
train split, one trajectory a task) against the environment itself, as bootstrap's
demonstrations are played, and the episodes are written in the trajectory format. With
`expert.source` naming a file, a user's expert trajectories are imported instead, through the
import path (tasks/ingest.py: every row checked, a bad row quarantined with its field and reason);
an imported row of another environment or of a split outside `expert.splits` is quarantined too
(rows in = rows kept + rows quarantined).

A failed expert episode stays in the table with its success flag and is counted: practice uses the
successful ones and says how many it skipped. Seeds come from the run's seed, so a rerun writes the
same bytes.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow as pa

from storage.parquet import write_table
from storage.schema import to_table
from tasks.ingest import BadRow, ImportValidationError, import_trajectories
from tasks.params import Params, ParamsError
from tasks.rollout import ScriptedAgent, derive_seed, new_episode, play

EXPERT = "expert"  # the scripted policy every shipped environment offers under this name


def play_expert(params: Params) -> list[dict]:
    """The environment's scripted expert on the first limit_tasks tasks of every split, m times
    each: the trajectories' rows, in a fixed order."""
    env, e = params.env.environment(), params.expert
    try:
        policies = env.policies(params.bootstrap.noisy.model_dump())  # the expert ignores the noise rates
    except NotImplementedError as err:
        raise ParamsError(f"expert: {err}; import expert trajectories instead with expert.source") from None
    if EXPERT not in policies:
        raise ParamsError(f"expert: environment {env.name} offers no scripted {EXPERT} policy (it offers {', '.join(sorted(policies))}); "
                         "import expert trajectories instead with expert.source")
    expert = policies[EXPERT]
    episodes = [
        new_episode(env, task, derive_seed(params.seed, "expert", split, task.id, k))
        for split in e.splits
        for task in env.tasks(split)[: e.limit_tasks]
        for k in range(e.m)
    ]
    play(episodes, ScriptedAgent(lambda rng: expert), derive_seed(params.seed, "expert"), "expert")
    return sorted((ep.to_row() for ep in episodes), key=lambda r: (r["split"], r["task_id"], r["seed"]))


def import_expert(params: Params, source: Path) -> tuple[pa.Table, pa.Table]:
    """A user's expert trajectories through the import path: (kept, quarantine). Besides the
    import's own checks, a row of another environment, or of a split outside expert.splits, is
    quarantined with its row and reason."""
    name, splits = params.env.name, params.expert.splits

    def ours(row: dict) -> None:
        if row["env"] != name:
            raise BadRow("env", f"{row['env']!r}, but the run's environment is {name!r} (env.name): practice compares actions by its rules")
        if row["split"] not in splits:
            raise BadRow("split", f"{row['split']!r} is not in expert.splits ({', '.join(splits)}): StepAgent learns from those splits' experts")

    if not source.is_file():
        raise ParamsError(f"expert.source {source}: no such file")
    try:
        return import_trajectories(source, env=name, on_error="quarantine", check=ours)
    except ImportValidationError as err:  # a file that cannot be imported at all, named
        raise ParamsError(f"expert.source: {err}") from None


def outcome_stats(rows: list[dict]) -> dict:
    """Counts and turns of the expert's trajectories; success is true, false, or (an import that
    does not say) unknown."""
    n = len(rows)
    turns = [r["num_turns"] for r in rows]
    return {
        "trajectories": n,
        "tasks": len({(r["split"], r["task_id"]) for r in rows}),
        "successes": sum(r["success"] is True for r in rows),
        "failures": sum(r["success"] is False for r in rows),
        "success_unknown": sum(r["success"] is None for r in rows),
        "success_rate": round(sum(r["success"] is True for r in rows) / n, 4) if n else None,
        "mean_turns": round(sum(turns) / n, 4) if n else None,
        "max_turns": max(turns, default=None),
        "steps": sum(turns),  # Eq. 4's prefixes, one per expert action
    }


def run_expert(params: Params, out_dir: Path) -> dict:
    """Writes out_dir/trajectories.parquet, out_dir/quarantine.parquet and out_dir/metrics.json."""
    t0 = time.time()
    e = params.expert
    out_dir.mkdir(parents=True, exist_ok=True)
    if e.source is None:
        rows = play_expert(params)
        table, quarantine = to_table(rows, "trajectories"), to_table([], "quarantine")
        source = {"policy": f"scripted:{EXPERT}", "splits": e.splits, "m": e.m, "limit_tasks": e.limit_tasks}
    else:
        table, quarantine = import_expert(params, Path(e.source))
        rows = table.to_pylist()
        source = {"file": e.source, "rows_in": table.num_rows + quarantine.num_rows, "imported": table.num_rows, "quarantined": quarantine.num_rows}
    write_table(quarantine, out_dir / "quarantine.parquet", "quarantine")
    if not rows:
        why = f"every row of {e.source} was quarantined (see {out_dir / 'quarantine.parquet'})" if e.source else "expert.splits hold no task"
        raise ParamsError(f"expert: no expert trajectory: {why}")
    write_table(table, out_dir / "trajectories.parquet", "trajectories")
    source["by_split"] = {split: outcome_stats([r for r in rows if r["split"] == split]) for split in dict.fromkeys(r["split"] for r in rows)}
    metrics = {"source": source, **outcome_stats(rows), "seconds": round(time.time() - t0, 1)}
    if metrics["failures"]:
        print(f"expert: {metrics['failures']} of {metrics['trajectories']} expert trajectories failed; they are kept, flagged, and practice skips them", flush=True)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics

