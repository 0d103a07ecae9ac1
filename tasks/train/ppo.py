"""PPO (Schulman et al. 2017) on one-step episodes: StepAgent-Inverse's policy step (Algorithm 1,
line 10).

Each (state s, action a) the policy practised is an episode of one step: s an expert prefix, a
the whole assistant turn, whose tokens are the episode's token-level actions. The reward
r = max(log D(s, a), reward_floor) (D: discriminator.py) comes at the action's last token; with no
other reward and gamma = lambda = 1 every token's return is r, and V(s), read at the state's last
token, is the baseline of them all:

    A       = r - V_old(s)                               whitened over the global batch (whiten)
    ratio_t = pi(a_t | s, a_<t) / pi_old(a_t | s, a_<t)
    L_clip  = mean_a mean_t max(-A ratio_t, -A clip(ratio_t, 1 - eps, 1 + eps))
    KL_t    = ref_t / pi_t - log(ref_t / pi_t) - 1       Schulman's k3 estimate of KL(pi || ref), >= 0
    L       = L_clip + kl_coef mean_a mean_t KL_t + value_coef mean_a (V(s) - r)^2 / 2

- pi_old, the behaviour policy, is the policy that practised, the start-of-iteration policy, which
  is also pi_ref: its per-token log-probabilities are recomputed once at the start of reflection
  (behaviour_logps), not read from practice's agent_logp, which sums the action's tokens (the
  ratio and the KL are per token) and comes from practice.model, which need not be the stage's
  base_model (at practice's default T = 1, top_p = 1 it is otherwise exact). The ratio is taken
  against the policy that sampled the action for every batch, so the clip bounds the drift from
  the data's own policy across the whole pass, not only within a batch's epochs.
- The KL is a loss term (as GRPO), not a reward penalty (as InstructGPT): every token's return
  stays r and the baseline one V(s) per state.
- Means over each action's tokens, then over actions (GRPO's): an action weighs the same whatever
  its length, and with equal shares the ranks' mean of their means is the global batch's.
- Advantages whitened (TRL and CleanRL do): a value head starting at 0 would make every
  advantage of the first batches negative (log D <= 0), and the scale of log D sets none of the
  step size. One action in the global batch, or all alike: every advantage 0.
- The value head sits on the policy's body (TRL's AutoModelForCausalLMWithValueHead), zero at the
  start: one forward gives the action's log-probabilities and V(s); its loss reaches the body
  scaled by value_coef.
"""
from __future__ import annotations

import torch

from tasks.train.sft import IGNORE, PadCollator


def action_logps(policy, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor, every_token: bool = False):
    """log pi of each labelled (action) token, flat in row order [N], each token's row [N], and the
    body's hidden state at each row's last state token (the one before its action's first) [B, H],
    or with every_token at the position before each action token [N, H] (where a token-level value
    reads V(s, a_<t): ppo_returns.py). The output layer runs on the action's positions only, as
    online_dpo.sequence_logps."""
    hidden = policy.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]
    target = labels[:, 1:]
    keep = target != IGNORE
    acting = hidden[keep]
    logits = policy.get_output_embeddings()(acting).float()
    logps = logits.log_softmax(-1).gather(1, target[keep].unsqueeze(1)).squeeze(1)
    states = acting if every_token else hidden[torch.arange(len(keep), device=keep.device), keep.int().argmax(1)]
    return logps, keep.nonzero()[:, 0], states


class PolicyWithValue(torch.nn.Module):
    """The policy and a scalar value head on its body; forward: (log-probs [N], rows [N], V(s) [B]),
    or with token_level V(s, a_<t) at every action token [N]."""

    def __init__(self, policy, token_level: bool = False):
        super().__init__()
        self.policy, self.token_level = policy, token_level
        self.value = torch.nn.Linear(policy.config.hidden_size, 1)
        torch.nn.init.zeros_(self.value.weight)
        torch.nn.init.zeros_(self.value.bias)

    def forward(self, input_ids, attention_mask, labels):
        logps, rows, state = action_logps(self.policy, input_ids, attention_mask, labels, self.token_level)
        return logps, rows, self.value(state).squeeze(-1).float()


@torch.no_grad()
def behaviour_logps(policy, tokenizer, sequences: list[dict], batch_size: int = 16) -> list[list[float]]:
    """log pi_old of each encoded action's tokens, per sequence, in order."""
    policy.eval()
    collate, out = PadCollator(tokenizer.pad_token_id), []
    for i in range(0, len(sequences), batch_size):
        b = collate(sequences[i : i + batch_size])
        logps, rows, _ = action_logps(policy, b["input_ids"], b["attention_mask"], b["labels"])
        out += [logps[rows == j].tolist() for j in range(len(b["input_ids"]))]
    return out


def rewards(p_expert: torch.Tensor, floor: float) -> torch.Tensor:
    """Algorithm 1's reward log D(s, a), no lower than `floor` (log 0 is -inf)."""
    return torch.log(p_expert).clamp_min(floor)


def advantages(rewards: torch.Tensor, values: torch.Tensor, whiten: bool) -> torch.Tensor:
    """A = r - V(s); whitened with the mean and (population) std over every rank's share."""
    a = rewards - values
    if not whiten:
        return a
    stats = torch.stack([a.sum(), (a * a).sum(), a.new_tensor(float(len(a)))]).double()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(stats)
    mean = stats[0] / stats[2]
    std = (stats[1] / stats[2] - mean * mean).clamp_min(0).sqrt()
    return ((a - mean) / (std + 1e-8)).to(a.dtype)


def per_action(x: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """The mean of per-token values over each action's tokens: [n]."""
    sums = torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, rows, x)
    return sums / torch.bincount(rows, minlength=n).to(x.dtype)


def clipped_objective(logps, rows, n: int, old, ref, adv, clip_epsilon: float):
    """L_clip, the k3 KL to ref and the share of clipped tokens, each a mean over an action's tokens,
    then over the n actions: per-token logps, old, ref and adv [N] with each token's row [N]. What
    every PPO-style trainer here shares (grpo.py and ppo_returns.py: an action is a whole episode)."""
    ratio = (logps - old).exp()
    clipped = torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip_epsilon, 1 + clip_epsilon))
    log_ratio = ref - logps
    share = ((ratio - 1).abs() > clip_epsilon).to(ratio.dtype)
    return per_action(clipped, rows, n).mean(), per_action(log_ratio.exp() - log_ratio - 1, rows, n).mean(), per_action(share, rows, n).mean()


def ppo_loss(logps, rows, old, ref, adv, values, returns, clip_epsilon: float, kl_coef: float, value_coef: float):
    """The module docstring's L on one batch: per-token logps, old and ref [N] with each token's
    row [N]; adv, values and returns (r) per action [B]. Returns L and its parts."""
    policy, kl, clipped = clipped_objective(logps, rows, len(adv), old, ref, adv[rows], clip_epsilon)
    value = 0.5 * ((values - returns) ** 2).mean()
    stats = {"policy_loss": policy.item(), "kl": kl.item(), "value_loss": value.item(), "clip_fraction": clipped.item()}
    return policy + kl_coef * kl + value_coef * value, stats


def update(model, batch: dict, old: torch.Tensor, returns: torch.Tensor, *, epochs: int, clip_epsilon: float, kl_coef: float,
           value_coef: float, whiten: bool) -> dict:
    """PPO's `epochs` steps on one batch of actions, pi_old = pi_ref (`old`, per token). `model` is
    the Optimised PolicyWithValue (stepagent_inverse.py). A is fixed from the first epoch's V,
    before this batch's first step. Returns the last epoch's parts of L."""
    model.module.train()
    adv = None
    for _ in range(epochs):
        logps, rows, values = model(**batch)
        old, returns = old.to(logps.device), returns.to(values.device)
        if adv is None:
            adv = advantages(returns, values.detach(), whiten)
        loss, stats = ppo_loss(logps, rows, old, old, adv, values, returns, clip_epsilon, kl_coef, value_coef)
        model.step(loss)
    return stats
