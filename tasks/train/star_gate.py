"""STaR-GATE (Andukuri et al. 2024; a baseline of Refit/Swift): SFT on each question's best trajectory.

    loss = - E_x [ sum_t log pi(a_t | x, tau*_{t-1}) ],  tau*(x) = argmax_{tau logged on x} r(x, tau)

Refit's Eq. 5 with the reward replaced by an indicator that the trajectory is its question's most
rewarding one. The paper leaves the selection open (gap 7: argmax, threshold or top-k); this is the
argmax, one trajectory per question, from the same logged trajectories every arm trains on (m = 3
a question at three temperatures). Ranking is by labelled reward, highest first; ties by the
lowest trajectory_id, a content hash: the same on every run, and blind to which temperature
logged the trajectory or where it sits in the table. A trajectory without a reward is never
picked; a question none of whose trajectories has one gives no row. Every question with a reward
gives its best, however low: STaR-GATE's "most rewarding" is relative to the question's runs.
The context is the question: (split, task_id).
"""
from __future__ import annotations

import polars as pl

from tasks.train import filtered_bc


def ranked(table: pl.DataFrame) -> pl.DataFrame:
    """The rows with a reward, best first: by reward, highest first; ties by the lowest trajectory_id."""
    return table.filter(pl.col("reward").is_not_null()).sort(["reward", "trajectory_id"], descending=[True, False])


def select(table: pl.DataFrame) -> pl.DataFrame:
    """Each question's best trajectory (module docstring), in (split, task_id) order."""
    return ranked(table).group_by("split", "task_id", maintain_order=True).first().sort("split", "task_id").select(table.columns)


def train(model, tokenizer, table, cfg, seed: int) -> dict:
    kept = select(table)
    return {**filtered_bc.clone(model, tokenizer, table, kept, cfg, seed), "questions": kept.height}
