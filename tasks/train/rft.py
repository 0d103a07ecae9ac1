"""RFT, rejection-sampling fine-tuning (Yuan et al. 2023; a baseline of StepAgent's Table 2):
SFT on the policy's own successful rollouts.

    loss = - E_{tau logged, success(tau)} [ sum_t log pi(a_t | x, tau_{t-1}) ]

The rollouts are collect's, the policy playing in the environment: the training table's logged
rows. Hindsight regenerations are not the policy's rollouts, so RFT never takes them (its `data`
is always logged; alpha and aggregate_multiple are refused). A trajectory succeeds when its
labelled reward reads as a win by the environment's own rule (Environment.won: TwentyQuestions a
right guess within max_turns, ScienceWorld a score of 100), or, with `success_threshold` set, when
its `weight` (the reward scaled to [0, 1] over the environment's range) is at least that. A
numeric default would mean another thing in each environment: a 20Q win at the last turn weighs
0.05, a ScienceWorld half-score 0.5. Rows without a reward are never successes; every row not
kept is counted by why.

How it differs from filtered_bc (filtered_bc.py), the other cloning filter: filtered BC keeps a
share of the rows ranked by reward, ceil(top_fraction * rated rows), relative to the table: with
few wins it fills the share with the best failures (all but the floor's), with many it leaves
wins out, and it takes regenerations unless `data: logged`. RFT's cut is absolute: every success
and no failure, however many or few there are, and nothing when no episode won (the base model is
kept and the metrics say so). Past the selection the two are the same, plain SFT on the kept rows
(filtered_bc.clone).

StepAgent's RFT (after ETO) adds the successful rollouts to the expert set and retrains from the
base; here the base's SFT data is bootstrap's demonstrations, already learnt, and RFT, like every
train method, fine-tunes train.base_model on its rows alone.
"""
from __future__ import annotations

from collections.abc import Callable

import polars as pl

from tasks.train import filtered_bc


def select(table: pl.DataFrame, won: Callable[[float], bool], threshold: float | None = None) -> tuple[pl.DataFrame, dict]:
    """The logged rows that succeeded (in the table's order), and the rest counted: regenerations,
    rows without a reward, failures. `won` is the environment's win rule on a reward; with
    `threshold`, a success is a weight at least that instead."""
    logged = table.filter(pl.col("source") != "regeneration")
    rated = logged.filter(pl.col("reward").is_not_null())
    if threshold is None:
        success = pl.Series([won(r) for r in rated["reward"].to_list()], dtype=pl.Boolean)
    else:
        success = rated["weight"].fill_null(-1.0) >= threshold
    kept = rated.filter(success)
    return kept, {
        "successes": kept.height, "failures": rated.height - kept.height, "no_reward": logged.height - rated.height,
        "regenerations_dropped": table.height - logged.height,
        "success_rule": "Environment.won" if threshold is None else f"weight >= {threshold:g}",
    }


def train(model, tokenizer, table, cfg, seed: int, won: Callable[[float], bool]) -> dict:
    """won: the environment's win rule (run_train passes Environment.won)."""
    kept, counts = select(table, won, cfg.success_threshold)
    return {**filtered_bc.clone(model, tokenizer, table, kept, cfg, seed), **counts}
