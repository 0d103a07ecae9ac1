"""One trajectory's lineage, followed through the lineage columns of the stage tables.

original (collect or import) -> summary -> relabel (counterfactual at a turn) -> regeneration
-> label (reward) -> training row (standardized reward, weight). Every derived row names the
row it came from (`parent_id`, `relabel_id`, `trajectory_id`), so this is a handful of joins.
"""
from __future__ import annotations

import re

import duckdb

TRAJECTORY_STAGES = ("collect", "import", "regenerate")
TRAJECTORY_COLUMNS = 'trajectory_id, task_id, split, source, parent_id, branch_turn, relabel_id, "return", success, num_turns'


class LineageError(LookupError):
    pass


def _views(con: duckdb.DuckDBPyConnection) -> set[str]:
    rows = con.sql("SELECT schema_name, view_name FROM duckdb_views() WHERE NOT internal").fetchall()
    return {f'"{s}".{v}' for s, v in rows}


def _of(views: set[str], stages: tuple[str, ...], table: str) -> list[str]:
    """The views of `table` written by `stages`, in iteration 1 and in every later one (iterationK_<stage>)."""
    return sorted(v for v in views for s in stages if re.fullmatch(rf'"(iteration\d+_)?{s}"\.{table}', v))


def _union(views: list[str], columns: str = "*") -> str:
    return "(" + " UNION ALL BY NAME ".join(f"SELECT {columns} FROM {v}" for v in views) + ")"


def _rows(con, sql: str, params: list) -> list[dict]:
    rel = con.execute(sql, params)
    cols = [d[0] for d in rel.description]
    return [dict(zip(cols, r)) for r in rel.fetchall()]


def resolve_id(con: duckdb.DuckDBPyConnection, prefix: str) -> str:
    """A trajectory id from its full value or a unique prefix (ids are long content hashes)."""
    views = _of(_views(con), TRAJECTORY_STAGES, "trajectories")
    if not views:
        raise LineageError("no trajectory tables at this revision: run the pipeline first")
    union = " UNION ".join(f"SELECT trajectory_id FROM {v} WHERE starts_with(trajectory_id, ?)" for v in views)
    ids = [r[0] for r in con.execute(union, [prefix] * len(views)).fetchall()]
    if not ids:
        raise LineageError(f"no trajectory with id '{prefix}' (in {', '.join(views)})")
    if len(ids) > 1:
        raise LineageError(f"'{prefix}' matches {len(ids)} trajectories; give more of the id")
    return ids[0]


def lineage(con: duckdb.DuckDBPyConnection, trajectory_id: str) -> dict:
    """{"chain": [root, ..., the trajectory], "summary", "relabels", "labels", "training", "children"}."""
    views = _views(con)
    tid = resolve_id(con, trajectory_id)
    union = _union(_of(views, TRAJECTORY_STAGES, "trajectories"), TRAJECTORY_COLUMNS)

    def trajectory(i: str) -> dict | None:
        found = _rows(con, f"SELECT * FROM {union} WHERE trajectory_id = ?", [i])
        return found[0] if found else None

    chain = [trajectory(tid)]
    while chain[0]["parent_id"] is not None:
        parent = trajectory(chain[0]["parent_id"])
        if parent is None:  # the parent's table is not at this revision
            break
        chain.insert(0, parent)
    ids = [t["trajectory_id"] for t in chain]
    root = ids[0]
    out: dict = {"chain": chain, "summary": None, "relabels": [], "labels": [], "training": [], "children": []}
    if found_views := _of(views, ("summarize",), "summaries"):
        found = _rows(con, f"SELECT summary, status, reason, backend, model FROM {_union(found_views)} WHERE trajectory_id = ?", [root])
        out["summary"] = found[0] if found else None
    marks = ", ".join("?" * len(ids))
    if relabels := _of(views, ("relabel",), "relabels"):
        # The relabels that led down this chain, or every relabel of an original.
        wanted = [t["relabel_id"] for t in chain if t["relabel_id"]]
        if wanted:
            out["relabels"] = _rows(con, f'SELECT * FROM {_union(relabels)} WHERE relabel_id IN ({", ".join("?" * len(wanted))}) ORDER BY branch_turn, rank', wanted)
        else:
            out["relabels"] = _rows(con, f"SELECT * FROM {_union(relabels)} WHERE trajectory_id = ? ORDER BY branch_turn, rank", [root])
    if '"label".labels' in views:
        out["labels"] = _rows(con, f'SELECT trajectory_id, source, env_reward, reward, labeler, model, status, reason FROM "label".labels WHERE trajectory_id IN ({marks})', ids)
    if '"standardize".train' in views:
        out["training"] = _rows(
            con,
            f'SELECT trajectory_id, reward, standardized_reward, weight, group_size, group_mean, group_std, standardize_status '
            f'FROM "standardize".train WHERE trajectory_id IN ({marks})',
            ids,
        )
    if (regenerated := _of(views, ("regenerate",), "trajectories")) and len(chain) == 1:
        out["children"] = _rows(con, f"SELECT {TRAJECTORY_COLUMNS} FROM {_union(regenerated)} WHERE parent_id = ? ORDER BY branch_turn, trajectory_id", [root])
    return out
