"""Swift: Refit's loss with the per-context standardized reward as the weight.

    loss = - E[ z(x, tau) * sum_t log pi(a_t | x, tau_{t-1}) ],  z = (r - mean_x) / std_x

Trajectories worse than their context's mean get a negative weight, so their actions are pushed
down, not only the better ones pulled up. z comes from the standardize stage (its status column
says where std = 0 or m = 1 made z = 0; those rows carry no gradient and are skipped).
"""
from __future__ import annotations

from tasks.train.refit import train_weighted


def train(model, tokenizer, table, cfg, seed: int) -> dict:
    return train_weighted(model, tokenizer, table, cfg, seed, "standardized_reward")
