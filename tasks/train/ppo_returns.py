"""PPO with a token-level value head fit to Monte Carlo returns, on logged multi-turn episodes: NLAC's
PPO baseline, which "additionally learns a token-level value function on Monte-Carlo rollouts as a
baseline" (NLAC 6.2).

An episode is one sequence whose every assistant token is an action token (SFT's mask); its reward
R (`reward_column`) is terminal: the training table carries one reward a trajectory and no step
rewards, and NLAC's are sparse. Turn k of an episode's T agent turns is worth, from there on,

    G_k     = gamma^(T-1-k) R                              every token of turn k targets it (gamma 1: every token R)
    V_t     = the value head on the body's hidden state before token t: V(s, a_<t), zero at the start
    A_t     = G_t - V_old,t                                 V_old: the batch's first forward; whitened over the global batch
    L       = mean_i mean_t max(-A_t ratio_t, -A_t clip(ratio_t, 1 - eps, 1 + eps))
              + kl_coef mean_i mean_t KL_t + value_coef mean_i mean_t (V_t - G_t)^2 / 2

with ratio_t against pi_old, the model as given (its per-token log-probabilities taken once at the
start), and KL_t the k3 estimate to the reference (the model as given unless another is passed),
each a mean over an episode's tokens, then over episodes (ppo.clipped_objective).

- Gamma once per agent turn, not per token: a turn is the environment's step, and per-token
  discounting would price the length of replies (ILQL's `discount_per: token` does, on purpose).
  With the default 1 the tokens of an episode share one target and V learns the return expected
  from the state; the advantages still differ by token through V.
- A conversation cut at the model's context keeps its targets: its kept turns are still k of T.
- The value head sits on the policy's body (ppo.PolicyWithValue, token-level) and is dropped after
  training: the train stage saves and evaluate plays the policy alone.
- Advantages whitened (TRL and CleanRL): the head starts at 0, so every first advantage would be R.
- Steps, ranks and the equal-step budget as GRPO's (grpo.py: `optimise`, `plan`); TRL's PPO
  trainer is gone from TRL 1.x and was generation-driven.
"""
from __future__ import annotations

import torch

from tasks.train import grpo, ppo
from tasks.train.sft import IGNORE


def turn_of_tokens(labels: list[int]) -> list[int]:
    """Each action token's agent turn (0-based), in order: the runs of labelled tokens (a turn's text
    and its end-of-turn token; the other parties' tokens between them). The first label never counts."""
    turns, turn, inside = [], -1, False
    for label in labels[1:]:
        acting = label != IGNORE
        if acting and not inside:
            turn += 1
        if acting:
            turns.append(turn)
        inside = acting
    return turns


def value_targets(labels: list[int], n_turns: int, reward: float, gamma: float) -> list[float]:
    """G_k = gamma^(n_turns-1-k) R for each action token of turn k: the Monte Carlo return of a
    terminal reward R from that turn on. n_turns counts the episode's agent turns before any cut."""
    return [gamma ** (n_turns - 1 - k) * reward for k in turn_of_tokens(labels)]


def ppo_returns_loss(outputs, n: int, adv, old, ref, returns, clip_epsilon: float, kl_coef: float, value_coef: float) -> tuple[torch.Tensor, dict]:
    """The module docstring's L on one batch of n episodes: outputs (log-probs [N], rows [N], V [N]),
    adv, old, ref and returns (G) per token [N]. Returns L and its parts."""
    logps, rows, values = outputs
    policy, kl, clipped = ppo.clipped_objective(logps, rows, n, old, ref, adv, clip_epsilon)
    value = 0.5 * ppo.per_action((values - returns) ** 2, rows, n).mean()
    parts = {"policy_loss": policy.item(), "kl": kl.item(), "value_loss": value.item(), "clip_fraction": clipped.item()}
    return policy + kl_coef * kl + value_coef * value, parts


def train(model, tokenizer, table, cfg, seed: int, reference=None) -> dict:
    """PPO on Monte Carlo returns over the table's episodes; trains `model` in place (its value head
    is discarded). `reference`: the KL's reference policy (None: the model as given)."""
    p = cfg.ppo_returns
    encoded, counts = grpo.episodes(tokenizer, table, p.reward_column, model.config.max_position_embeddings)
    result = {**counts, "rows": len(encoded), "rows_skipped": table.height - len(encoded), "gamma": p.gamma}
    if not encoded:  # nothing to learn from: run_train keeps the base model
        return {**result, **grpo.summary([]), "mean_advantage": None, "curve": []}
    examples = grpo.with_logps(model, reference, tokenizer, [{**e, "returns": value_targets(e["labels"], e["turns"], e["reward"], p.gamma)} for e in encoded])
    raw: list[float] = []  # each global batch's mean G - V_old over its tokens, before whitening

    def targets(rows, device):
        return torch.tensor([g for r in rows for g in r["returns"]], device=device)

    def advantage(outputs, rows):
        returns, values = targets(rows, outputs[2].device), outputs[2].detach()
        total = torch.stack([(returns - values).sum(), returns.new_tensor(float(len(returns)))]).double()
        if torch.distributed.is_initialized():  # over every rank's tokens, as the whitening's
            torch.distributed.all_reduce(total)
        raw.append((total[0] / total[1]).item())
        return ppo.advantages(returns, values, p.whiten_advantages)

    def loss(outputs, rows, a, old, ref):
        value, parts = ppo_returns_loss(outputs, len(rows), a, old, ref, targets(rows, outputs[2].device), p.clip_epsilon, p.kl_coef, p.value_coef)
        return value, {**parts, "advantage": raw[-1]}

    curve = grpo.optimise(ppo.PolicyWithValue(model, token_level=True), tokenizer, examples, cfg, p, seed, advantage, loss)
    return {**result, **grpo.summary(curve), "mean_advantage": round(sum(raw) / len(raw), 6), "final_value_loss": curve[-1]["value_loss"], "curve": curve}
