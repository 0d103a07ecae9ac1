"""StepAgent-Inverse's discriminator (Eq. 9-11): D(s, a) = P(expert | s, a), trained by binary
cross-entropy with label 1 on the expert's (s, a) and 0 on the agent's:

    L_D = - E_expert[ log D(s, a) ] - E_agent[ log(1 - D(s, a)) ]

Eq. 10 takes a sup over D with D -> 1 on the agent's samples (GAIL's convention), yet Algorithm 1
rewards the policy with log D and Section 5 says the agent maximises D's output: the two agree
only if D is the probability that the step is the expert's and Eq. 11 is minimised, which is L_D
(the same fixed point, and bounded). The policy's reward is then log D(s, a) of its own action.

The model is HOPE's critic's (critic.py): the policy's weights with transformers'
sequence-classification head, a linear layer [hidden, 1] read at the action's last token,
D = sigmoid(score). StepAgent gives no architecture; the policy's own body is the natural one,
as for the critic. D reads (s, a) as the policy does, the chat template over the state and the
action (online_dpo.encode's sequence, its state's start cut to the context).

Each practice row is one expert pair and one agent pair at the same state, so a batch is balanced;
an expert action practised k times is counted k times, as often as the agent's samples there.
"""
from __future__ import annotations

import torch

from tasks.train import critic


def load(base: str, seed: int):
    """A new discriminator on the policy at `base` (its head random, from `seed`: every rank draws
    the same head whatever it ran before) and its tokenizer."""
    torch.manual_seed(seed)
    return critic.load_critic(base, base=True)


def labelled(pairs: list[dict]) -> tuple[list[dict], torch.Tensor]:
    """The batch's expert sequences (label 1) then its agent sequences (label 0), as collator rows."""
    seqs = [p["expert"] for p in pairs] + [p["agent"]["input_ids"] for p in pairs]
    return [{"input_ids": s, "labels": s} for s in seqs], torch.tensor([1.0] * len(pairs) + [0.0] * len(pairs))


def logits(model, batch: dict) -> torch.Tensor:
    """score(s, a) for each row of a padded batch: D = sigmoid(score)."""
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1).float()


def loss(scores: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
    """L_D on a batch of scores (logits) and labels; and how often D > 0.5 on exactly the expert's."""
    return critic.soft_bce(scores, labels), ((scores > 0) == (labels > 0.5)).float().mean().item()


def update(model, collate, pairs: list[dict]) -> dict:
    """One step of L_D on the batch (Algorithm 1, lines 8-9). `model` is the Optimised
    discriminator (stepagent_inverse.py): called, it runs forward; step(loss) updates."""
    model.module.train()
    rows, labels = labelled(pairs)
    value, accuracy = loss(logits(model, collate(rows)), labels.to(model.device))
    model.step(value)
    return {"loss": value.item(), "accuracy": accuracy}


@torch.no_grad()
def probabilities(model, collate, pairs: list[dict]) -> torch.Tensor:
    """D(s, a) of the batch's agent actions."""
    model.module.eval()
    return torch.sigmoid(logits(model, collate([{"input_ids": p["agent"]["input_ids"], "labels": p["agent"]["input_ids"]} for p in pairs])))
