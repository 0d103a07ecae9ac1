"""Filtered behaviour cloning: SFT on the top fraction of trajectories by reward.

STaR-GATE and rejection-sampling fine-tuning keep only the most rewarding trajectories and clone
them. Ranking is by reward, then trajectory_id, so ties at the cut are broken the same way on
every run. Trajectories without a reward are never kept, and neither are those at the table's
lowest reward when some do better: where most episodes fail, the top fraction would otherwise
be filled with failures tied at the floor, which is cloning the failures.
"""
from __future__ import annotations

import math

import polars as pl

from tasks.train import sft


def select(table: pl.DataFrame, top_fraction: float) -> pl.DataFrame:
    rated = table.filter(pl.col("reward").is_not_null()).sort(["reward", "trajectory_id"], descending=[True, False])
    if rated.is_empty():  # no reward to rank by (every label failed): nothing to clone
        return rated
    top = rated.head(math.ceil(top_fraction * rated.height))
    floor = rated["reward"].min()
    return top.filter(pl.col("reward") > floor) if rated["reward"].max() > floor else top


def clone(model, tokenizer, table: pl.DataFrame, kept: pl.DataFrame, cfg, seed: int) -> dict:
    """Plain SFT on `kept`, the rows of `table` a filter chose (RFT's too); the rest are counted."""
    result = sft.train(model, tokenizer, kept, cfg, seed)
    return {**result, "rows_skipped": table.height - kept.height, "min_reward_kept": kept["reward"].min()}


def train(model, tokenizer, table, cfg, seed: int) -> dict:
    return clone(model, tokenizer, table, select(table, cfg.top_fraction), cfg, seed)
