"""What changed between two revisions: params, and per table its rows and reward distributions."""
from __future__ import annotations

import numpy as np

from storage.catalog import open_catalog, quote_ident
from storage.revisions import Revision, params_diff

# The columns whose distributions are compared, by schema: rewards and weights, and where relabels branch.
COMPARED_COLUMNS = {
    "relabels": ["branch_turn"],
    "trajectories": ["return"],
    "labels": ["reward"],
    "training": ["reward", "standardized_reward", "weight"],
    "export": ["reward", "standardized_reward", "weight"],
}


def _columns(con, view: str) -> set[str]:
    return {r[0] for r in con.execute(f"DESCRIBE {view}").fetchall()}


def _values(con, view: str, column: str) -> np.ndarray:
    if column not in _columns(con, view):  # an older schema version
        return np.array([])
    rows = con.execute(f"SELECT {quote_ident(column)} FROM {view} WHERE {quote_ident(column)} IS NOT NULL").fetchall()
    return np.array([r[0] for r in rows], dtype=float)


def describe(values: np.ndarray) -> dict | None:
    if values.size == 0:
        return None
    q10, q50, q90 = np.quantile(values, [0.1, 0.5, 0.9])
    return {
        "n": int(values.size),
        "mean": float(values.mean()),
        "std": float(values.std(ddof=1)) if values.size > 1 else 0.0,
        "p10": float(q10),
        "p50": float(q50),
        "p90": float(q90),
    }


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float | None:
    """Largest gap between the two empirical CDFs (0 = same distribution, 1 = disjoint)."""
    if a.size == 0 or b.size == 0:
        return None
    grid = np.union1d(a, b)
    cdf_a = np.searchsorted(np.sort(a), grid, side="right") / a.size
    cdf_b = np.searchsorted(np.sort(b), grid, side="right") / b.size
    return float(np.max(np.abs(cdf_a - cdf_b)))


def _status_counts(con, view: str) -> dict[str, int]:
    if "status" not in _columns(con, view):
        return {}
    return dict(con.execute(f"SELECT status, count(*) FROM {view} GROUP BY status ORDER BY status").fetchall())


def diff(a: Revision, b: Revision) -> dict:
    """{"params": {key: (a, b)}, "tables": {"<stage>.<table>": {...}}} for revisions a and b."""
    infos_a = {f"{t.stage}.{t.table}": t for t in a.tables()}
    infos_b = {f"{t.stage}.{t.table}": t for t in b.tables()}
    con_a, con_b = open_catalog(infos=list(infos_a.values())), open_catalog(infos=list(infos_b.values()))
    tables = {}
    for name in sorted(set(infos_a) | set(infos_b), key=lambda n: (n not in infos_a, n)):
        ta, tb = infos_a.get(name), infos_b.get(name)
        stage, table = name.split(".", 1)
        view = f"{quote_ident(stage)}.{quote_ident(table)}"
        entry: dict = {"rows": (ta.rows if ta else None, tb.rows if tb else None), "columns": {}, "status": None}
        schema = (ta or tb).schema_name
        for col in COMPARED_COLUMNS.get(schema, []):
            va = _values(con_a, view, col) if ta else np.array([])
            vb = _values(con_b, view, col) if tb else np.array([])
            entry["columns"][col] = {"a": describe(va), "b": describe(vb), "ks": ks_statistic(va, vb)}
        if schema in ("summaries", "relabels", "labels"):
            entry["status"] = (_status_counts(con_a, view) if ta else {}, _status_counts(con_b, view) if tb else {})
        tables[name] = entry
    return {"params": params_diff(a.params(), b.params()), "tables": tables}
