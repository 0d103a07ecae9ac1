"""Refit: reward-weighted fine-tuning on logged trajectories (and the loss Swift reuses).

    loss = - E_trajectories[ w * sum_t log pi(a_t | x, tau_{t-1}) ]

w is the trajectory's reward r (Refit) or its per-context standardized reward (Swift, which may
be negative). Only the agent's tokens carry loss: labels are -100 on system, user/observation
and padding tokens (the mask comes from tasks.train.sft.tokenize_chats). "sequences" averages
w * sequence-NLL over trajectories, the paper's objective up to a constant; "tokens" divides
by the number of supervised tokens instead, the scale TRL's SFT loss has.

Negative weights (Swift) push a trajectory's tokens down, and -log p has no upper bound: on the
default run the Swift loss fell to -651 in two epochs and the policy stopped playing. So a token
of a negatively weighted trajectory stops contributing once its probability is below
`push_down_floor` (its NLL is capped at -log floor); positively weighted tokens are untouched.
The paper has no such cap (its |z| <= 1.15 at m = 3 bounds the scale, not the direction).
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import Trainer

from storage.schema import from_table
from tasks.train.sft import IGNORE, tokenize_chats, train_sft

Norm = Literal["sequences", "tokens"]


def weighted_action_nll(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, norm: Norm = "sequences",
    push_down_floor: float | None = None, cu_seq_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, T, V]; labels [B, T] (IGNORE off the agent's tokens); weights [B]. A padding-free
    batch is one packed row (logits [1, N, V], labels [1, N]) with its sequences' boundaries
    cu_seq_lens [B + 1] (see tasks.train.sft.PadCollator)."""
    b, t, v = logits.shape
    targets = labels[:, 1:]
    token_nll = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, v), targets.reshape(-1), ignore_index=IGNORE, reduction="none"
    ).view(b, t - 1)
    mask = (targets != IGNORE).float()
    if cu_seq_lens is not None:
        # Position i predicts token i + 1, so it counts for that token's trajectory.
        seq_of = torch.repeat_interleave(torch.arange(len(weights), device=labels.device), cu_seq_lens.diff().long())[1:]
    if push_down_floor is not None:
        capped = token_nll.clamp(max=-math.log(push_down_floor))
        negative = (weights < 0).unsqueeze(1) if cu_seq_lens is None else (weights < 0)[seq_of].unsqueeze(0)
        token_nll = torch.where(negative, capped, token_nll)
    if cu_seq_lens is None:
        seq_nll = (token_nll * mask).sum(dim=1)  # -sum_t log pi(a_t | ...)
    else:
        seq_nll = token_nll.new_zeros(len(weights)).index_add(0, seq_of, (token_nll * mask)[0])
    weighted = weights.to(seq_nll.dtype) * seq_nll
    if norm == "sequences":
        return weighted.mean()
    if norm == "tokens":
        return weighted.sum() / mask.sum().clamp_min(1.0)
    raise ValueError(f"norm must be 'sequences' or 'tokens', not {norm!r}")


class RewardWeightedTrainer(Trainer):
    """The HF Trainer with the loss above; batches carry a `weight` per trajectory."""

    # compute_loss returns a micro-batch mean and ignores num_items_in_batch, so the Trainer must divide it
    # by the gradient-accumulation steps. Left at None it would not: the model's forward takes **kwargs, which
    # the Trainer reads as "the loss is already normalised over the accumulated batch".
    loss_is_scaled_for_ga = False

    def __init__(self, *args, norm: Norm = "sequences", push_down_floor: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.norm, self.push_down_floor = norm, push_down_floor

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        weights = inputs.pop("weight")
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = weighted_action_nll(outputs.logits, labels, weights, self.norm, self.push_down_floor, inputs.get("cu_seq_lens_q"))
        return (loss, outputs) if return_outputs else loss


def train_weighted(model, tokenizer, table, cfg, seed: int, column: str) -> dict:
    """Reward-weighted fine-tuning with per-trajectory weights from `column`. Rows without a
    weight (unlabelled) and rows of weight 0 (no gradient) are left out and counted."""
    import polars as pl

    usable = table.filter(pl.col(column).is_not_null() & (pl.col(column) != 0))
    if usable.height == 0:  # e.g. every context tied: there is nothing to learn from
        return {"rows": 0, "rows_skipped": table.height, "truncated": 0, "curve": []}
    tokenized = tokenize_chats(tokenizer, [r["messages"] for r in from_table(usable.select("messages"))], model.config.max_position_embeddings)
    examples = [{**ex, "weight": float(w)} for ex, w in zip(tokenized.examples, usable[column].to_list())]
    curve = train_sft(model, tokenizer, examples, seed=seed, trainer_cls=RewardWeightedTrainer, norm=cfg.norm, push_down_floor=cfg.push_down_floor, **cfg.trainer_kwargs())
    return {"rows": usable.height, "rows_skipped": table.height - usable.height, "truncated": tokenized.truncated, "curve": curve}


def train(model, tokenizer, table, cfg, seed: int) -> dict:
    """Refit: the weight is the labelled reward scaled to [0, 1] (standardize's `weight`)."""
    return train_weighted(model, tokenizer, table, cfg, seed, "weight")
