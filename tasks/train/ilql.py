"""ILQL (Snell et al. 2022) as Hindsight Regenerations trains its agent (HR 4.3, B.4, Table 3).

Token-level MDP: each agent token a_t is an action, the state s_t everything before it. Heads on the
policy's last hidden state at s_t: two Q heads Q_1, Q_2 [vocab], their Polyak-averaged targets
Qt_1, Qt_2, and V [1]. With s_{t+1} the state before the next agent token (the other party's reply
is part of it) and r_t the reward of a_t:

    L_Q   = sum_k mean_t ( r_t + gamma_t * V(s_{t+1}) - Q_k(s_t, a_t) )^2      V(s_{t+1}) detached, 0 after the last action
    L_V   = mean_t |tau - 1(u_t < 0)| * u_t^2,  u_t = min_k Qt_k(s_t, a_t) - V(s_t)   (the tau-expectile, tau = 0.8)
    L_CQL = sum_k mean_t CE( Q_k(s_t, .), a_t )                                      (weight 0 by default)
    L_BC  = mean_t CE( logits(s_t, .), a_t )                                         pi_beta, the LM head
    loss  = L_Q + L_V + cql_weight * L_CQL + bc_weight * L_BC
    after every optimizer step: Qt_k <- polyak * Q_k + (1 - polyak) * Qt_k

The extracted policy (models/ilql.py, what evaluate and the hf backend play) has logits
log pi_beta(a|s) + beta * (min_k Qt_k(s, a) - V(s)).

Only the agent's tokens are actions (the chat template's assistant mask, its end-of-turn token
included): system, user and tool tokens are read as part of states, never scored. Q and V losses
train the shared trunk too (ILQL's default).

Rewards: the trajectory's labelled reward (`reward_column`) on its last agent token, the end of its
final turn, and 0 on every other token: HR's MDP has one deterministic terminal reward, and the
training table carries one reward per trajectory (no per-turn step rewards). That action is
terminal: its target is r alone. A conversation cut at the model's context has lost its end, so its
last kept action has neither a reward nor a next state and carries no Q loss (it keeps its V loss).

Discount: per token by default (`discount_per: token`): HR's MDP is token-level and ILQL's code
applies gamma at every action index, so a reward T agent tokens away is worth gamma^T (Table 3's
gamma = 0.99 also prices the length of replies). `discount_per: turn` applies gamma once per agent
turn, at its end-of-turn token (1 inside a turn), for a dialogue-level horizon.

HR's overloaded alpha: Table 3's "ILQL alpha = 0.0" is read as ILQL's CQL weight (`cql_weight` 0:
the term is off), as the ILQL paper writes alpha; read as the temperature of HR's extraction formula
pi ~ pi_beta * exp(alpha (Q - V)) it would make pi = pi_beta, no RL at all. That temperature is
`beta` here, which HR does not give (default 1). Table 3's "target network update alpha 0.005" is
`polyak`.

Policy term: HR extracts from pi_beta, "a base LLM fine-tuned on the data", and names no AWAC
term; ILQL's code has an advantage-weighted token loss. Here pi_beta is the policy's own LM head,
fine-tuned by plain cross-entropy on the agent tokens (`bc_weight`) beside the heads, no weighting.
"""
from __future__ import annotations

from dataclasses import dataclass

import polars as pl
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainerCallback

from models.ilql import IlqlForCausalLM
from storage.schema import from_table
from tasks.train.distributed import world_size
from tasks.train.sft import IGNORE, PadCollator, tokenize_chats, train_sft


@dataclass
class Transitions:
    """A batch's actions, in row-major order: action i is token positions[i] + 1 of row rows[i]."""

    rows: torch.Tensor
    positions: torch.Tensor  # where s_t's hidden state is
    actions: torch.Tensor  # a_t
    next: torch.Tensor  # the index of s_{t+1} among these, -1 after a row's last action
    reward: torch.Tensor  # r_t
    discount: torch.Tensor  # gamma_t: gamma (per token, or at a turn's end) and 0 after the last action
    q_mask: torch.Tensor  # False on a truncated conversation's last kept action


def transitions(labels: torch.Tensor, reward: torch.Tensor, truncated: torch.Tensor, gamma: float, discount_per: str = "token") -> Transitions:
    """labels [B, T] (IGNORE off the agent's tokens), reward [B], truncated [B] -> the batch's transitions."""
    is_action = labels[:, 1:] != IGNORE  # position i predicts token i + 1
    rows, positions = is_action.nonzero(as_tuple=True)
    index = torch.arange(len(rows), device=labels.device)
    has_next = torch.cat([rows[1:] == rows[:-1], rows.new_zeros(min(1, len(rows)), dtype=torch.bool)])
    turn_end = ~F.pad(is_action, (0, 1))[rows, positions + 1]  # the token after it is not the agent's
    if discount_per == "token":
        step = torch.full(rows.shape, gamma, device=labels.device)
    elif discount_per == "turn":
        step = torch.where(turn_end, gamma, 1.0)
    else:
        raise ValueError(f"discount_per must be 'token' or 'turn', not {discount_per!r}")
    cut = truncated[rows].bool()
    return Transitions(
        rows=rows, positions=positions, actions=labels[rows, positions + 1], next=torch.where(has_next, index + 1, -1),
        reward=torch.where(~has_next & ~cut, reward[rows].float(), 0.0), discount=torch.where(has_next, step, 0.0),
        q_mask=has_next | ~cut,
    )


def bellman_targets(t: Transitions, v: torch.Tensor) -> torch.Tensor:
    """r_t + gamma_t * V(s_{t+1}), V detached: [N]."""
    v_next = torch.where(t.next >= 0, v.detach().float()[t.next.clamp(min=0)], 0.0)
    return t.reward + t.discount * v_next


def expectile_loss(u: torch.Tensor, tau: float) -> torch.Tensor:
    """|tau - 1(u < 0)| * u^2 per element: with tau > 0.5, V below the target costs more than above."""
    return torch.where(u < 0, 1 - tau, tau) * u**2


def _taken(values: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """values [2, N, vocab] at the taken actions: [2, N]."""
    return values.float().gather(-1, actions.expand(values.shape[0], -1).unsqueeze(-1)).squeeze(-1)


def ilql_loss(heads: dict, t: Transitions, tau: float, cql_weight: float = 0.0, bc_weight: float = 1.0) -> tuple[torch.Tensor, dict]:
    """heads at the batch's states (IlqlForCausalLM.heads): logits [N, vocab], q and target_q
    [2, N, vocab], v [N]. Returns the loss and its parts (floats, for the log)."""
    q, v, n = _taken(heads["q"], t.actions), heads["v"].float(), len(t.actions)
    m = t.q_mask.float()
    q_loss = (((bellman_targets(t, v) - q) ** 2) * m).sum() / m.sum().clamp_min(1)  # each head's mean, summed
    v_loss = expectile_loss(_taken(heads["target_q"], t.actions).min(0).values - v, tau).mean()
    cql = torch.zeros(()) if not cql_weight else (  # off by default: a softmax over the vocabulary per head and token saved
        F.cross_entropy(heads["q"].flatten(0, 1).float(), t.actions.repeat(heads["q"].shape[0]), reduction="sum") / n
    )
    bc = F.cross_entropy(heads["logits"].float(), t.actions)
    loss = q_loss + v_loss + cql_weight * cql + bc_weight * bc
    parts = {"q_loss": q_loss.item(), "v_loss": v_loss.item(), "cql_loss": cql.item(), "bc_loss": bc.item(), "q": q.mean().item(), "v": v.mean().item()}
    return loss, parts


class IlqlCollator(PadCollator):
    """Right-padded batches (never packed: transitions must not run across sequences), with each
    trajectory's reward and whether it was truncated."""

    def __call__(self, batch: list[dict]) -> dict[str, torch.Tensor]:
        out = super().__call__(batch)
        out["reward"] = torch.tensor([b["reward"] for b in batch], dtype=torch.float32)
        out["truncated"] = torch.tensor([b["truncated"] for b in batch], dtype=torch.bool)
        return out


class PolyakUpdate(TrainerCallback):
    def __init__(self, rate: float):
        self.rate = rate

    def on_step_end(self, args, state, control, model=None, **kwargs):  # after each optimizer step
        model.polyak(self.rate)


class IlqlTrainer(Trainer):
    """The HF Trainer with the loss above; logs its parts and the mean Q and V of the taken actions."""

    loss_is_scaled_for_ga = False  # compute_loss returns a micro-batch mean (see refit.py)

    def __init__(self, *args, ilql, **kwargs):
        super().__init__(*args, **kwargs)
        self.ilql, self._seen = ilql, []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        p = self.ilql
        t = transitions(inputs["labels"], inputs["reward"], inputs["truncated"], p.gamma, p.discount_per)
        hidden = model.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
        loss, parts = ilql_loss(model.heads(hidden[t.rows, t.positions]), t, p.tau, p.cql_weight, p.bc_weight)
        self._seen.append(parts)
        return loss

    def log(self, logs: dict, *args, **kwargs) -> None:
        if self._seen and "loss" in logs:
            for key in self._seen[0]:
                logs[key] = round(sum(s[key] for s in self._seen) / len(self._seen), 6)
            self._seen = []
        super().log(logs, *args, **kwargs)


def train(model, tokenizer, table, cfg, seed: int) -> dict:
    """ILQL on the training table's trajectories with a reward (in `reward_column`). Returns the
    trained IlqlForCausalLM as "model" (run_train saves it in the base policy's place)."""
    p = cfg.ilql
    if world_size() > 1:  # ZeRO-3 partitions the heads, and the Polyak update would see empty shards
        raise ValueError("ilql trains in one process only; set train.nproc_per_node: 1")
    rated = table.filter(pl.col(p.reward_column).is_not_null())
    context = model.config.max_position_embeddings
    examples, truncated = [], 0
    for messages, reward in zip((r["messages"] for r in from_table(rated.select("messages"))), rated[p.reward_column].to_list()):
        tokenized = tokenize_chats(tokenizer, [messages], context)  # one at a time: which ones were cut
        ex = tokenized.examples[0]
        if any(label != IGNORE for label in ex["labels"][1:]):  # a trajectory without an agent token has no action
            examples.append({**ex, "reward": float(reward), "truncated": bool(tokenized.truncated)})
            truncated += tokenized.truncated
    if not examples:  # nothing to learn from: run_train keeps the base model
        return {"rows": 0, "rows_skipped": table.height, "truncated": 0, "curve": []}
    ilql = IlqlForCausalLM.from_policy(model, p.beta)
    curve = train_sft(
        ilql, tokenizer, examples, seed=seed, trainer_cls=IlqlTrainer, collator=IlqlCollator(tokenizer.pad_token_id),
        # never packed (transitions would run across sequences), never under DeepSpeed (ZeRO-3's empty
        # placeholder parameters would make the Polyak update a silent no-op)
        callbacks=(PolyakUpdate(p.polyak),), ilql=p, **{**cfg.trainer_kwargs(), "padding_free": False, "deepspeed": None},
    )
    return {"rows": len(examples), "rows_skipped": table.height - len(examples), "truncated": truncated, "curve": curve, "model": ilql}
