"""standardize: turn labelled rewards into training weights.

Swift (per-context): over the m trajectories of one context x (a task), z = (r - mean) / std
with the unbiased (m - 1) standard deviation. Two cases the paper leaves open are decided here:
- std = 0 (every trajectory of the context got the same reward): no trajectory is better than
  another, so each gets z = 0 and status "tied" (as GRPO does), rather than dividing by ~0.
- m = 1: the sample standard deviation is undefined; z = 0 and status "singleton".
Refit's weight is the labelled reward min-max scaled to [0, 1] over the table: Refit assumes a
non-negative reward, and the environment's returns are <= 0 (all equal rewards give weight 1,
plain SFT). Rows without a reward (labelling failed) keep a null weight with status "no_reward" and are left
out of every statistic. Also global z-scores and min-max scaling, and optional clipping.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Literal

import polars as pl

from storage.parquet import write_table
from storage.schema import to_table
from storage.validate import StageInputs, row_json
from tasks.plots import histogram, write_plot

Mode = Literal["per_context", "global", "min_max"]


def standardize(
    df: pl.DataFrame,
    mode: Mode = "per_context",
    reward: str = "reward",
    group_by: tuple[str, ...] = ("env", "task_id"),
    clip: float | None = None,
) -> pl.DataFrame:
    """`df` plus group_size, group_mean, group_std, standardized_reward and standardize_status."""
    if reward not in df.columns:
        raise ValueError(f"standardize: no column {reward!r} (columns: {', '.join(df.columns)})")
    if clip is not None and clip <= 0:
        raise ValueError(f"standardize: clip must be > 0, got {clip}")
    r = pl.col(reward)
    present = r.is_not_null()
    over = list(group_by) if mode == "per_context" else None

    def window(e: pl.Expr) -> pl.Expr:
        return e.over(over) if over else e

    n = window(present.sum()).cast(pl.Int64)
    mean = window(r.mean())
    std = window(r.std(ddof=1))
    if mode == "min_max":
        lo, hi = r.min(), r.max()
        value = pl.when(hi > lo).then((r - lo) / (hi - lo)).otherwise(0.0)
        status = pl.when(hi > lo).then(pl.lit("ok")).otherwise(pl.lit("tied"))
    else:
        value = pl.when(n < 2).then(0.0).when(std == 0).then(0.0).otherwise((r - mean) / std)
        status = pl.when(n < 2).then(pl.lit("singleton")).when(std == 0).then(pl.lit("tied")).otherwise(pl.lit("ok"))
    if clip is not None:
        value = value.clip(-clip, clip)
    return df.with_columns(
        group_size=n,
        group_mean=mean,
        group_std=std,
        standardized_reward=pl.when(present).then(value).otherwise(None),
        standardize_status=pl.when(present).then(status).otherwise(pl.lit("no_reward")),
    )


def counts(df: pl.DataFrame) -> dict[str, int]:
    """How many rows fell in each case, for the stage's report."""
    return dict(df.group_by("standardize_status").len().sort("standardize_status").iter_rows())


def refit_weight(df: pl.DataFrame, reward: str = "reward") -> pl.DataFrame:
    r = pl.col(reward)
    lo, hi = r.min(), r.max()
    return df.with_columns(weight=pl.when(r.is_null()).then(None).when(hi > lo).then((r - lo) / (hi - lo)).otherwise(1.0))


TRAINING_COLUMNS = [
    "trajectory_id", "task_id", "split", "source", "parent_id", "relabel_id", "messages", "reward",
    "standardized_reward", "weight", "group_size", "group_mean", "group_std", "standardize_status",
]


def weight_histograms(df: pl.DataFrame) -> dict[str, list[dict]]:
    """The training weights as DVC plots: Swift's standardized reward (bins of 0.25 around 0)
    and Refit's weight (bins of 0.05 over [0, 1]); rows without a reward are left out."""
    return {
        "standardized_reward": histogram(df["standardized_reward"].to_list(), "standardized_reward", 0.25, -1.0, 1.0),
        "weight": histogram(df["weight"].to_list(), "weight", 0.05, 0.0, 1.0),
    }


def run_standardize(params, trajectory_files: list[Path], labels: Path, out_dir: Path) -> dict:
    """Joins trajectories with their labels; writes train.parquet (the training table),
    export/train.parquet (for datasets / TRL), metrics.json and the histograms
    plots/standardized_reward.json and plots/weight.json."""
    t0 = time.time()
    s = params.standardize
    inputs = StageInputs()
    frames = []
    for path in trajectory_files:
        kept = inputs.read(path, "trajectories")
        frames.append(pl.from_arrow(kept).with_columns(_file=pl.lit(str(path)), _row=pl.Series(inputs.file_rows(path, kept))))
    trajs = pl.concat(frames, how="vertical")
    rows_in = trajs.height
    trajs = trajs.filter(pl.col("split").is_in(s.splits))
    lab = inputs.read_polars(labels, "labels").select("trajectory_id", "reward", "status")
    joined = trajs.join(lab, on="trajectory_id", how="left")
    # A trajectory whose label row is missing or was quarantined has no reward to standardize.
    unlabelled = joined.filter(pl.col("status").is_null())
    for (path,), rows in unlabelled.group_by("_file", maintain_order=True):
        raws = row_json(rows.drop("_file", "_row", "reward", "status").to_arrow(), list(range(rows.height)))
        inputs.add(path, to_table([
            {"source_file": path, "row": row, "field": "trajectory_id", "reason": f"no usable label row in {labels} (missing, or quarantined there)", "raw": raw}
            for row, raw in zip(rows["_row"], raws)
        ], "quarantine"))
    joined = joined.filter(pl.col("status").is_not_null()).drop("_file", "_row")
    out = standardize(joined, mode=s.mode, group_by=("env", "task_id"), clip=s.clip)
    out = refit_weight(out).select(TRAINING_COLUMNS).sort("task_id", "trajectory_id")
    write_table(out.to_arrow(), out_dir / "train.parquet", "training")
    export = out.select("messages", "reward", "standardized_reward", "weight", "trajectory_id", "task_id", "source")
    write_table(export.to_arrow(), out_dir / "export" / "train.parquet", "export")
    for name, hist in weight_histograms(out).items():
        write_plot(hist, out_dir / "plots" / f"{name}.json")
    z = out["standardized_reward"].drop_nulls()
    metrics = {
        "inputs": inputs.write(out_dir),
        "rows_in": rows_in,
        "rows_other_splits": rows_in - trajs.height,
        "rows_out": out.height,
        "mode": s.mode,
        "clip": s.clip,
        "by_source": dict(sorted(out.group_by("source").len().iter_rows())),
        "status": counts(out),
        "contexts": out["task_id"].n_unique(),
        "contexts_with_variance": out.filter(pl.col("standardize_status") == "ok")["task_id"].n_unique(),
        "standardized_reward": {"min": z.min(), "max": z.max(), "mean": z.mean()} if len(z) else None,
        "seconds": round(time.time() - t0, 1),
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics
