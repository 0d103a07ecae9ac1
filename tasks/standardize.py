"""standardize: turn labelled rewards into training weights.

Swift (per-context): over the m trajectories of one context x (a task), z = (r - mean) / std
with the unbiased (m - 1) standard deviation. Two cases the paper leaves open are decided here:
- std = 0 (every trajectory of the context got the same reward): no trajectory is better than
  another, so each gets z = 0 and status "tied" (as GRPO does), rather than dividing by ~0.
- m = 1: the sample standard deviation is undefined; z = 0 and status "singleton".
Rows without a reward (labelling failed) keep a null weight with status "no_reward" and are left
out of every statistic. Also global z-scores and min-max scaling, and optional clipping.
"""
from __future__ import annotations

from typing import Literal

import polars as pl

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
