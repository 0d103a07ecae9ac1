"""GRPO (Shao et al. 2024, DeepSeekMath) on logged multi-turn episodes: NLAC's GRPO baseline, whose
baseline is "the average reward across 4 different rollouts" of a task (NLAC 6.2).

The table holds the policy's own rollouts, several a task: a task's episodes are its group (collect's
`m` episodes a task sets its size; NLAC's is 4). An episode is one sequence whose every assistant
token is an action token (SFT's mask: system and observation tokens are read, never scored), and
its reward R_i (`reward_column`) comes at its end:

    A_i     = R_i - mean_group(R)                          (/ std_group(R), the sample std, with scale_rewards)
    ratio_t = pi(a_t | s, a_<t) / pi_old(a_t | s, a_<t)   pi_old: the model as given, per token, taken once at the start
    KL_t    = ref_t / pi_t - log(ref_t / pi_t) - 1         k3, to the reference (the model as given unless another is passed)
    L       = mean_i mean_t max(-A_i ratio_t, -A_i clip(ratio_t, 1 - eps, 1 + eps)) + kl_coef mean_i mean_t KL_t

- Every assistant token of episode i gets A_i: one reward an episode, DeepSeekMath's outcome
  supervision, over all the episode's turns.
- A group whose rewards are all equal (a lone episode's too) has A = 0 everywhere: no policy
  gradient. Its episodes are left out altogether, so the KL term does not pull on them and no step
  goes to them (DAPO's dynamic sampling does the same); metrics.json counts them.
- Means over an episode's tokens, then over episodes (DeepSeekMath's 1/|o_i|), and the ratio always
  against the policy that played, for every batch of every pass: the clip bounds the drift from the
  data's own policy (ppo.clipped_objective, StepAgent-Inverse's PPO pieces).
- Steps: train.epochs passes over the episodes in global batches of train.batch_size a rank,
  ppo_epochs optimizer steps on each; or exactly `gradient_steps` optimizer steps, whatever the
  table's size (NLAC gives every method the same number).
- Not TRL's GRPOTrainer: it samples its own completions for a prompt dataset and scores them
  (single-turn, or its own tool loop), and its loss lives inside the trainer; logged multi-turn
  episodes, observation tokens between the turns, have no place in it, and TRL 1.x has no PPO
  trainer. The episodes are TRL's conversational format, masked as its SFT's assistant_only_loss.
- One process trains with torch's AdamW; on ranks (torchrun) the policy is a DeepSpeed engine
  under train.deepspeed, each rank takes its share of every global batch (stepagent_inverse.py).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import polars as pl
import torch

from models.hf import native_bf16
from storage.schema import from_table
from tasks.train import ppo, stepagent_inverse
from tasks.train.distributed import rank, world_size
from tasks.train.sft import IGNORE, PadCollator, TrainingDiverged, tokenize_chats


def episodes(tokenizer, table: pl.DataFrame, column: str, context: int) -> tuple[list[dict], dict]:
    """The table's episodes with a reward in `column`, encoded with SFT's assistant mask (each
    {input_ids, labels, task_id, reward, turns: its assistant messages}), in the table's order, and
    the counts: without a reward, without an agent token, cut at the model's context."""
    if column not in table.columns:
        raise ValueError(f"the episodes' reward column {column!r} is not in the table (its columns: {', '.join(table.columns)}); "
                         "reward_column: weight or reward read the training table, return a trajectory table")
    rated = table.filter(pl.col(column).is_not_null())
    out, counts = [], {"no_reward": table.height - rated.height, "no_action": 0, "truncated": 0}
    for row, reward in zip(from_table(rated.select("task_id", "messages")), rated[column].to_list()):
        tokenized = tokenize_chats(tokenizer, [row["messages"]], context)  # one at a time: which ones were cut
        ex = tokenized.examples[0]
        if all(label == IGNORE for label in ex["labels"][1:]):  # the first label never counts (nothing predicts it)
            counts["no_action"] += 1
            continue
        counts["truncated"] += tokenized.truncated
        turns = sum(m["role"] == "assistant" for m in row["messages"])
        out.append({**ex, "task_id": row["task_id"], "reward": float(reward), "turns": turns})
    return out, counts


def group_advantages(groups: list[str], rewards: list[float], scale: bool) -> list[float | None]:
    """Each episode's A = R - its group's mean (divided by the group's sample std with `scale`);
    None where the group's rewards are all equal, a lone episode's too: no signal to learn."""
    members: dict[str, list[float]] = {}
    for g, r in zip(groups, rewards):
        members.setdefault(g, []).append(r)
    out = []
    for g, r in zip(groups, rewards):
        rs = members[g]
        if max(rs) == min(rs):
            out.append(None)
            continue
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((x - mean) ** 2 for x in rs) / (len(rs) - 1))
        out.append((r - mean) / std if scale else r - mean)
    return out


def with_logps(policy, reference, tokenizer, examples: list[dict]) -> list[dict]:
    """Each example with pi_old's per-token log-probabilities ("old": the policy as given) and the
    reference's ("ref": the same unless another model is passed), both before any step."""
    old = ppo.behaviour_logps(policy, tokenizer, examples)
    ref = old if reference is None else ppo.behaviour_logps(reference, tokenizer, examples)
    return [{**e, "old": o, "ref": r} for e, o, r in zip(examples, old, ref)]


def plan(n: int, batch_size: int, ranks: int, epochs: float, ppo_epochs: int, gradient_steps: int | None, seed: int) -> list[tuple[list[int], int]]:
    """Global batches of episode indices (stepagent_inverse.batches), each with its optimizer steps:
    `epochs` passes, ppo_epochs steps a batch; or with gradient_steps exactly that many steps, passes
    repeated as needed and the last batch's steps cut short."""
    if gradient_steps is None:
        return [(b, ppo_epochs) for b in stepagent_inverse.batches(n, batch_size, ranks, epochs, seed)]
    count, per_pass = math.ceil(gradient_steps / ppo_epochs), math.ceil(n / (batch_size * ranks))
    chosen = stepagent_inverse.batches(n, batch_size, ranks, math.ceil(count / per_pass), seed)[:count]
    return [(b, min(ppo_epochs, gradient_steps - i * ppo_epochs)) for i, b in enumerate(chosen)]


class Policy(torch.nn.Module):
    """The policy as Optimised runs it: forward gives its action tokens' log-probabilities [N] and
    rows [N] (ppo.action_logps)."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def forward(self, input_ids, attention_mask, labels):
        logps, rows, _ = ppo.action_logps(self.policy, input_ids, attention_mask, labels)
        return logps, rows


Advantage = Callable[[tuple, list[dict]], torch.Tensor]
Loss = Callable[[tuple, list[dict], torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict]]


def optimise(module, tokenizer, examples: list[dict], cfg, p, seed: int, advantage: Advantage, loss: Loss) -> list[dict]:
    """Trains `module` (Policy, or ppo.PolicyWithValue) in place on `examples` (with "old" and "ref"),
    batch by batch of plan(): A = advantage(outputs, rows) from a batch's first forward, fixed for its
    steps, then each step's (L, parts) = loss(outputs, rows, A, old, ref). Returns the curve, one
    point an optimizer step: L and its parts, averaged over the ranks."""
    me, ranks = rank(), world_size()
    if ranks > 1 and not cfg.deepspeed:
        raise ValueError("on several ranks the policy trains under DeepSpeed, which averages the ranks' gradients: set train.deepspeed")
    t = cfg.train
    steps = plan(len(examples), t.batch_size, ranks, t.epochs, p.ppo_epochs, p.gradient_steps, seed)
    model = stepagent_inverse.Optimised(
        module, module.policy.config.hidden_size, sum(k for _, k in steps), t.batch_size, learning_rate=t.learning_rate,
        weight_decay=t.weight_decay, warmup_ratio=t.warmup_ratio, bf16=native_bf16() if t.bf16 == "auto" else t.bf16, deepspeed=cfg.deepspeed,
    )
    collate, curve = PadCollator(tokenizer.pad_token_id), []
    model.module.train()
    for batch, k in steps:
        mine = [examples[i] for i in batch[me::ranks]]
        inputs = collate([{"input_ids": e["input_ids"], "labels": e["labels"]} for e in mine])
        old, ref = (torch.tensor([x for e in mine for x in e[key]], device=model.device) for key in ("old", "ref"))
        adv = None
        for _ in range(k):
            outputs = model(**inputs)
            if adv is None:
                adv = advantage(outputs, mine)
            value, parts = loss(outputs, mine, adv, old, ref)
            model.step(value)
            point = stepagent_inverse._mean_over_ranks({"loss": value.item(), **parts}, model.device)
            if not math.isfinite(point["loss"]):
                raise TrainingDiverged(len(curve) + 1, point["loss"], f"the loss is {point['loss']} at step {len(curve) + 1}")
            curve.append({"step": len(curve) + 1, **{key: round(v, 6) for key, v in point.items()}})
    return curve


def summary(curve: list[dict]) -> dict:
    """The metrics every PPO-style trainer here reports beside its own."""
    return {
        "steps": len(curve), "first_loss": curve[0]["loss"] if curve else None, "final_loss": curve[-1]["loss"] if curve else None,
        "final_kl": curve[-1]["kl"] if curve else None, "final_clip_fraction": curve[-1]["clip_fraction"] if curve else None,
        "mean_clip_fraction": round(sum(c["clip_fraction"] for c in curve) / len(curve), 6) if curve else None,
    }


def grpo_loss(outputs, rows: list[dict], adv, old, ref, clip_epsilon: float, kl_coef: float) -> tuple[torch.Tensor, dict]:
    """The module docstring's L on one batch: outputs (log-probs [N], rows [N]), adv, old and ref per
    token [N]. Returns L and its parts."""
    logps, token_rows = outputs
    policy, kl, clipped = ppo.clipped_objective(logps, token_rows, len(rows), old, ref, adv, clip_epsilon)
    parts = {"policy_loss": policy.item(), "kl": kl.item(), "clip_fraction": clipped.item(),
             "advantage": sum(r["advantage"] for r in rows) / len(rows)}
    return policy + kl_coef * kl, parts


def train(model, tokenizer, table, cfg, seed: int, reference=None) -> dict:
    """GRPO on the table's episodes, grouped by task_id; trains `model` in place. `reference`: the
    KL's reference policy (None: the model as given)."""
    p = cfg.grpo
    encoded, counts = episodes(tokenizer, table, p.reward_column, model.config.max_position_embeddings)
    adv = group_advantages([e["task_id"] for e in encoded], [e["reward"] for e in encoded], p.scale_rewards)
    kept = [{**e, "advantage": a} for e, a in zip(encoded, adv) if a is not None]
    sizes = Counter(e["task_id"] for e in encoded)
    flat = {e["task_id"] for e, a in zip(encoded, adv) if a is None}  # equal rewards are the whole group's
    result = {
        **counts, "rows": len(kept), "rows_skipped": table.height - len(kept), "groups": len(sizes), "groups_zero_variance": len(flat),
        "episodes_zero_variance": len(encoded) - len(kept), "group_sizes": {str(k): v for k, v in sorted(Counter(sizes.values()).items())},
        "mean_advantage": round(sum(e["advantage"] for e in kept) / len(kept), 6) if kept else None,
        "mean_abs_advantage": round(sum(abs(e["advantage"]) for e in kept) / len(kept), 6) if kept else None,
    }
    if not kept:  # nothing to learn from: run_train keeps the base model
        return {**result, **summary([]), "curve": []}
    kept = with_logps(model, reference, tokenizer, kept)

    def advantage(outputs, rows):
        return torch.tensor([r["advantage"] for r in rows], device=outputs[0].device)[outputs[1]]

    def loss(outputs, rows, a, old, ref):
        return grpo_loss(outputs, rows, a, old, ref, p.clip_epsilon, p.kl_coef)

    curve = optimise(Policy(model), tokenizer, kept, cfg, p, seed, advantage, loss)
    return {**result, **summary(curve), "curve": curve}
