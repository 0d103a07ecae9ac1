"""NLAC, Natural Language Actor-Critic (notes/nlac.md, Algorithm 1): one model is the policy and
its language critic, trained by two NLLs on transitions drawn from a prioritised replay buffer.

    L1(s_t, a_t, r_t, s_t+1) = - log M_theta( y_t | p_critic(s_t, a_t) ),   y_t ~ B_L M_theta_bar(. | s_t, a_t)   (Eq. 5)
    L2(s_t)                  = - log pi_theta( a_t^r | s_t ),   a_t^r ~ pi^r(. | s_t, a_t, Q_L^theta(s_t, a_t))       (Eq. 6)
    theta_bar <- tau * theta + (1 - tau) * theta_bar, after every step                                      (Alg. 1, line 10)
    P(i) = p_i^alpha / sum_k p_k^alpha,   p_i = L1_i + epsilon,   w_i = (N P(i))^-beta / max_j (N P(j))^-beta   (PER)

- KL(B_L M_theta_bar || M_theta) is, up to a constant, the NLL of a target sampled from the backup:
  one target per transition (k = 1), the whole critique (Future and Optimality), since the paper
  merges the successor model and the evaluator into one critic output.
- Both losses are SFT on one assistant message after a prompt, the mask on that message alone
  (online_dpo.encode): L1's prompt is the critic's (s_t, a_t, the critic instruction; never the next
  observation the target saw), L2's the policy's own s_t (never a_t or its critique).
- `update: separate` is Algorithm 1's lines 8-9: a step on the batch's weighted L1 at lambda1, then
  a step on its L2 (at the weights after the first) at lambda2, each by an AdamW of its own, so
  each loss's gradient is scaled by its own moments and neither sets the other's step size.
  `joint` takes one AdamW step on L1 + L2 at lambda1 (the two steps taken together): there the
  larger loss's gradient sets the step, on the tiny model the critique's.
- The targets and refinements of a batch are generated at the weights of that step
  (`examples_for` is called with theta and theta-bar as they stand): the roles on the `policy`
  backend read them in process, the oracle's do not depend on them. theta-bar is kept either way.
- A transition's new priority is its L1 in the step's forward pass, before the update; one whose
  target failed keeps its priority. PER draws with replacement, so a batch may repeat a transition.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tasks.train.online_dpo import encode, sequence_logps
from tasks.train.sft import IGNORE, MaskError, PadCollator, TrainingDiverged

# ---- prioritised replay (Schaul et al. 2016) ----


def probabilities(priorities: np.ndarray, alpha: float) -> np.ndarray:
    """P(i) = p_i^alpha / sum_k p_k^alpha."""
    scaled = np.power(priorities, alpha)
    return scaled / scaled.sum()


def draw(priorities: np.ndarray, n: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """n indices drawn with replacement by P(i)."""
    return rng.choice(len(priorities), size=n, replace=True, p=probabilities(priorities, alpha))


def importance_weights(priorities: np.ndarray, drawn: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    """(N P(i))^-beta for the drawn indices, over its largest value in the buffer (the least likely
    transition's), so every weight is at most 1 and only scales the step down."""
    p = probabilities(priorities, alpha)
    n = len(priorities)
    return np.power(n * p[drawn], -beta) / np.power(n * p.min(), -beta)


def reprioritised(priorities: np.ndarray, drawn: np.ndarray, l1: list[float | None], epsilon: float) -> np.ndarray:
    """The priorities after a step: each drawn transition's L1 + epsilon (the last draw of a
    repeated one wins); a transition without an L1 keeps its priority."""
    out = priorities.copy()
    for i, loss in zip(drawn, l1, strict=True):
        if loss is not None:
            out[i] = loss + epsilon
    return out


# ---- target network ----


@torch.no_grad()
def ema_step(target: torch.nn.Module, model: torch.nn.Module, tau: float) -> None:
    """theta_bar <- tau * theta + (1 - tau) * theta_bar, parameter by parameter."""
    for bar, theta in zip(target.parameters(), model.parameters(), strict=True):
        bar.lerp_(theta.detach().to(bar.dtype), tau)


# ---- losses ----


@dataclass
class Example:
    """One drawn transition's two SFT targets (None where the role that writes it failed)."""

    critic_prompt: list[dict]  # p_critic(s_t, a_t)
    target: str | None  # L1's: the backup's critique
    policy_prompt: list[dict]  # s_t
    refined: str | None  # L2's: a_t^r
    record: dict = field(default_factory=dict)  # what the samples table keeps of it


def encoded(tokenizer, prompt: list[dict], text: str | None, context: int) -> dict | None:
    """prompt + the text as an assistant message, labels on that message alone; None without a
    text or when the text alone exceeds the context."""
    if text is None:
        return None
    try:
        return encode(tokenizer, prompt, {"role": "assistant", "content": text}, context)[0]
    except MaskError:
        return None


def nll(model, tokenizer, rows: list[dict], token_mean: bool) -> torch.Tensor:
    """Each row's NLL of its labelled tokens: [B], the mean per token or the sum."""
    batch = PadCollator(tokenizer.pad_token_id)(rows)
    device = next(model.parameters()).device
    logp = sequence_logps(model, batch["input_ids"].to(device), batch["attention_mask"].to(device), batch["labels"].to(device))
    if not token_mean:
        return -logp
    counts = (batch["labels"][:, 1:] != IGNORE).sum(1).to(logp.device)
    return -logp / counts


def _weighted(model, tokenizer, rows: list[dict | None], weights: torch.Tensor, token_mean: bool) -> tuple[torch.Tensor, list[float | None]]:
    """The importance-weighted mean NLL over the rows that have one, and each row's NLL (None without)."""
    have = [i for i, r in enumerate(rows) if r is not None]
    if not have:
        return torch.zeros((), device=weights.device), [None] * len(rows)
    losses = nll(model, tokenizer, [rows[i] for i in have], token_mean)
    per: list[float | None] = [None] * len(rows)
    for i, v in zip(have, losses.detach().tolist()):
        per[i] = v
    return (weights[have] * losses).mean(), per


# ---- Algorithm 1, lines 7-11 ----


def train(
    model, target, tokenizer, priorities: np.ndarray, examples_for: Callable[[np.ndarray, int], list[Example]], *, steps: int, batch_size: int,
    learning_rate: float, weight_decay: float, max_grad_norm: float | None, tau: float, alpha: float, beta: float, epsilon: float,
    token_mean: bool, bf16: bool, seed: int, update: str = "separate", learning_rate_l2: float | None = None,
) -> dict:
    """Trains `model` (theta) in place and moves `target` (theta-bar) after it; `examples_for(drawn
    indices, step)` writes the drawn transitions' targets with the roles, at the weights as they
    stand. Returns the loss curve by step, every sample's record (with its weight, priority when
    drawn, L1 and L2), the buffer's new priorities and how often each transition was drawn."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    context = model.config.max_position_embeddings
    if update not in ("separate", "joint"):
        raise ValueError(f"update: {update!r}, expected separate or joint")
    l1_opt = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay)
    l2_opt = torch.optim.AdamW(model.parameters(), lr=learning_rate_l2 or learning_rate, weight_decay=weight_decay) if update == "separate" else None
    priorities, draws = priorities.astype(np.float64).copy(), np.zeros(len(priorities), dtype=np.int64)
    curve, samples = [], []
    for step in range(steps):
        drawn = draw(priorities, batch_size, alpha, rng)
        weights = importance_weights(priorities, drawn, alpha, beta)
        model.eval()
        examples = examples_for(drawn, step)
        model.train()
        critic_rows = [encoded(tokenizer, e.critic_prompt, e.target, context) for e in examples]
        policy_rows = [encoded(tokenizer, e.policy_prompt, e.refined, context) for e in examples]
        w = torch.tensor(weights, dtype=torch.float32, device=device)
        if l2_opt is None:  # joint: one step on L1 + L2
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                l1, l1_each = _weighted(model, tokenizer, critic_rows, w, token_mean)
                l2, l2_each = _weighted(model, tokenizer, policy_rows, w, token_mean)
            _step(l1_opt, model, l1 + l2, max_grad_norm, step)
        else:  # Algorithm 1's line 8, then line 9 at the weights line 8 left
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                l1, l1_each = _weighted(model, tokenizer, critic_rows, w, token_mean)
            _step(l1_opt, model, l1, max_grad_norm, step)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                l2, l2_each = _weighted(model, tokenizer, policy_rows, w, token_mean)
            _step(l2_opt, model, l2, max_grad_norm, step)
        loss = l1.detach() + l2.detach()
        ema_step(target, model, tau)
        for e, i, wi, a, b in zip(examples, drawn, weights, l1_each, l2_each, strict=True):
            samples.append({**e.record, "step": step, "weight": float(wi), "priority": float(priorities[i]), "l1": a, "l2": b})
        np.add.at(draws, drawn, 1)
        priorities = reprioritised(priorities, drawn, l1_each, epsilon)
        curve.append({"step": step + 1, "loss": round(loss.item(), 6), "l1": _mean(l1_each), "l2": _mean(l2_each),
                      "l1_samples": sum(v is not None for v in l1_each), "l2_samples": sum(v is not None for v in l2_each)})
    return {"curve": curve, "samples": samples, "priorities": priorities, "draws": draws}


def _step(optimizer, model, loss: torch.Tensor, max_grad_norm: float | None, step: int) -> None:
    """One optimizer step on `loss`; none when no row had a target (a zero without a graph)."""
    if not math.isfinite(loss.item()):
        raise TrainingDiverged(step, loss.item(), f"the NLAC loss is {loss.item()} at step {step}")
    if not loss.requires_grad:
        return
    optimizer.zero_grad()
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()


def _mean(values: list[float | None]) -> float | None:
    have = [v for v in values if v is not None]
    return round(sum(have) / len(have), 6) if have else None
