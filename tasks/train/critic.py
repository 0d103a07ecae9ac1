"""HOPE's process critic Q(s, a) (HOPE Eq. 1): the base policy with a scalar head, trained with
soft binary cross-entropy against the buffer's Monte Carlo targets in [0, 1].

    loss = - E[ q log sigmoid(Q(s, a)) + (1 - q) log(1 - sigmoid(Q(s, a))) ]

The model is transformers' sequence-classification head on the policy's architecture
(AutoModelForSequenceClassification, num_labels 1): the policy's weights, and a linear layer
[hidden, 1] without bias, randomly initialised (HOPE 2.7), read at the last token of the state
and action (the action's end-of-turn token). Q(s, a) is the sigmoid of that score.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, AutoTokenizer, Trainer

from tasks.train.sft import train_sft


def load_critic(path: str, base: bool = False):
    """The critic at `path`, or with base=True a new one on the policy at `path` (its head new)."""
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    if base:
        model.config.architectures = [type(model).__name__]
    return model, AutoTokenizer.from_pretrained(path)


def scorer(path: str):
    """The critic at `path` as best-of-N's score function: (state, action message) pairs -> Q."""
    model, tokenizer = load_critic(path)
    return lambda pairs: score(model, tokenizer, [encode(tokenizer, state, action) for state, action in pairs])


def soft_bce(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Eq. 1 on a batch: scores [B] (logits), targets [B] in [0, 1]."""
    return F.binary_cross_entropy_with_logits(scores.float(), targets.float())


class CriticTrainer(Trainer):
    """The HF Trainer with Eq. 1; batches carry each pair's `target`."""

    loss_is_scaled_for_ga = False  # compute_loss returns a micro-batch mean (see refit.py)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        targets = inputs.pop("target")
        inputs.pop("labels")
        outputs = model(**inputs)
        loss = soft_bce(outputs.logits.squeeze(-1), targets)
        return (loss, outputs) if return_outputs else loss


def encode(tokenizer, prompt: list[dict], action: dict) -> list[int]:
    """The state and action as the policy reads them: the chat template over prompt + action."""
    return list(tokenizer.apply_chat_template([*prompt, action], tokenize=True, return_dict=True)["input_ids"])


def train(model, tokenizer, examples: list[dict], seed: int, **trainer_kwargs) -> list[dict]:
    """examples: {"input_ids", "target"}. Trains in place (tasks.train.sft.train_sft's settings);
    returns the loss curve."""
    rows = [{"input_ids": e["input_ids"], "labels": e["input_ids"], "target": e["target"]} for e in examples]
    return train_sft(model, tokenizer, rows, seed=seed, trainer_cls=CriticTrainer, **trainer_kwargs)


@torch.no_grad()
def score(model, tokenizer, sequences: list[list[int]], batch_size: int = 32) -> list[float]:
    """Q(s, a) = sigmoid(score) for each encoded state and action, in order. A sequence longer
    than the model's context is read from its last `context` tokens, where the action is."""
    model.eval()
    out: list[float] = []
    pad, context = tokenizer.pad_token_id, model.config.max_position_embeddings
    for i in range(0, len(sequences), batch_size):
        chunk = [s[-context:] for s in sequences[i : i + batch_size]]
        width = max(map(len, chunk))
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in chunk])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk])
        out += torch.sigmoid(model(input_ids=ids, attention_mask=mask).logits.squeeze(-1).float()).tolist()
    return out
