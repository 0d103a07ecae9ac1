"""HOPE's process critic Q(s, a) (HOPE Eq. 1): the base policy with a scalar head, trained with
soft binary cross-entropy against the buffer's Monte Carlo targets in [0, 1].

    loss = - E[ q log sigmoid(Q(s, a)) + (1 - q) log(1 - sigmoid(Q(s, a))) ]

The model is transformers' sequence-classification head on the policy's architecture
(AutoModelForSequenceClassification, num_labels 1): the policy's weights, and a linear layer
[hidden, 1] without bias, randomly initialised (HOPE 2.7), read at the last token of the state
and action (the action's end-of-turn token). Q(s, a) is the sigmoid of that score.

head_init "probe" fits that head before any fine-tuning: Eq. 1 on the frozen policy's features
at the scored token, a logistic regression solved by L-BFGS (linear probing, then fine-tuning:
LP-FT, Kumar et al. 2022). A random head (HOPE's) sends large, arbitrary gradients into the
body while the head is still wrong; on the project's small policies that erased what the
features carry and the critic scored every pair alike (README, "Does hindsight help?").
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DynamicCache, Trainer

from tasks.train.sft import train_sft


UNTRAINED = "UNTRAINED.txt"  # in a critic's model folder: why the critic stage left it untrained


def untrained(path: str | Path) -> str | None:
    """Why the critic at `path` was not trained (its zero head scores every pair 0.5), or None."""
    marker = Path(path) / UNTRAINED
    return marker.read_text().strip() if marker.exists() else None


def load_critic(path: str, base: bool = False):
    """The critic at `path`, or with base=True a new one on the policy at `path` (its head new)."""
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    if base:
        model.config.architectures = [type(model).__name__]
    return model, AutoTokenizer.from_pretrained(path)


def scorer(path: str):
    """The critic at `path` as best-of-N's and the actor's score function: (state, action
    message) pairs -> Q (score_pairs)."""
    model, tokenizer = load_critic(path)
    return lambda pairs: score_pairs(model, tokenizer, pairs)


def soft_bce(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Eq. 1 on a batch: scores [B] (logits), targets [B] in [0, 1]."""
    return F.binary_cross_entropy_with_logits(scores.float(), targets.float())


class CriticTrainer(Trainer):
    """The HF Trainer with Eq. 1; batches carry each pair's `target`. A packed batch (one row, no
    padding) is scored at each sequence's last token, where the padded head reads a row's last
    non-pad token."""

    loss_is_scaled_for_ga = False  # compute_loss returns a micro-batch mean (see refit.py)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        targets = inputs.pop("target")
        inputs.pop("labels")
        if "cu_seq_lens_q" in inputs:
            # The Trainer's bf16 autocast wraps model.forward only: the body and head called
            # directly here take it explicitly (without it, fp32 and about 10x slower on CPU).
            with self.accelerator.autocast():
                hidden = model.base_model(**inputs).last_hidden_state[0]
                scores = model.score(hidden[inputs["cu_seq_lens_q"][1:].long() - 1]).squeeze(-1)
            outputs = None
        else:
            outputs = model(**inputs)
            scores = outputs.logits.squeeze(-1)
        loss = soft_bce(scores, targets)
        return (loss, outputs) if return_outputs else loss


def encode(tokenizer, prompt: list[dict], action: dict) -> list[int]:
    """The state and action as the policy reads them: the chat template over prompt + action."""
    return list(tokenizer.apply_chat_template([*prompt, action], tokenize=True, return_dict=True)["input_ids"])


def train(model, tokenizer, examples: list[dict], seed: int, **trainer_kwargs) -> list[dict]:
    """examples: {"input_ids", "target"}. Trains in place (tasks.train.sft.train_sft's settings);
    returns the loss curve."""
    rows = [{"input_ids": e["input_ids"], "labels": e["input_ids"], "target": e["target"]} for e in examples]
    return train_sft(model, tokenizer, rows, seed=seed, trainer_cls=CriticTrainer, **trainer_kwargs)


def _batches(model, tokenizer, sequences: list[list[int]], batch_size: int):
    """Right-padded batches (ids, mask, lengths); a sequence longer than the model's context is
    read from its last `context` tokens, where the action is."""
    pad, context = tokenizer.pad_token_id, model.config.max_position_embeddings
    for i in range(0, len(sequences), batch_size):
        chunk = [s[-context:] for s in sequences[i : i + batch_size]]
        width = max(map(len, chunk))
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in chunk])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk])
        yield ids, mask, [len(s) for s in chunk]


@torch.no_grad()
def score(model, tokenizer, sequences: list[list[int]], batch_size: int = 32) -> list[float]:
    """Q(s, a) = sigmoid(score) for each encoded state and action, in order."""
    model.eval()
    out: list[float] = []
    for ids, mask, _ in _batches(model, tokenizer, sequences, batch_size):
        out += torch.sigmoid(model(input_ids=ids, attention_mask=mask).logits.squeeze(-1).float()).tolist()
    return out


@torch.no_grad()
def features(model, tokenizer, sequences: list[list[int]], batch_size: int = 32) -> torch.Tensor:
    """The body's last hidden state at each sequence's scored (last) token: [n, hidden], in order.
    Batches go by length (less padding) and are put back in order."""
    model.eval()
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out = []
    for ids, mask, lengths in _batches(model, tokenizer, [sequences[i] for i in order], batch_size):
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        out.append(hidden[torch.arange(len(lengths)), torch.tensor(lengths) - 1].float())
    return torch.cat(out)[torch.argsort(torch.tensor(order))]


def fit_linear(x: torch.Tensor, y: torch.Tensor, l2: float, bias: bool = False, max_iter: int = 500) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights (and bias, else 0) minimising Eq. 1 of x @ w + b against y, + l2 * |w|^2, by
    L-BFGS from zero."""
    w = torch.zeros(x.shape[1] + bias, requires_grad=True)
    optimizer = torch.optim.LBFGS([w], max_iter=max_iter, line_search_fn="strong_wolfe")

    def split():
        return (w[:-1], w[-1]) if bias else (w, torch.zeros(()))

    def closure():
        optimizer.zero_grad()
        weights, b = split()
        loss = soft_bce(x @ weights + b if bias else x @ weights, y) + l2 * (weights * weights).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return tuple(t.detach() for t in split())


def fit_head(model, tokenizer, examples: list[dict], l2: float = 1e-3) -> dict:
    """LP-FT's first step: the head that minimises Eq. 1 (+ l2 * |w|^2) on the frozen body's
    features of `examples` ({"input_ids", "target"}), by L-BFGS from zero; written into
    model.score. Returns Eq. 1 on the examples under the zero head (log 2) and under the fit."""
    x = features(model, tokenizer, [e["input_ids"] for e in examples])
    y = torch.tensor([e["target"] for e in examples], dtype=torch.float32)
    w, _ = fit_linear(x, y, l2)
    with torch.no_grad():
        model.score.weight.copy_(w.detach().to(model.score.weight.dtype)[None])
        return {"pairs": len(examples), "loss_zero_head": round(soft_bce(torch.zeros_like(y), y).item(), 4),
                "loss_fit_head": round(soft_bce(x @ w, y).item(), 4)}


@torch.no_grad()
def score_pairs(model, tokenizer, pairs: list[tuple[list[dict], dict]]) -> list[float]:
    """Q(s, a) for (state messages, action message) pairs, in order, as `score` gives it. The
    candidates of one state (best-of-N's n, the actor's two) share the state's encoding: it is
    run once and its keys and values serve every action after it, so a turn costs the state once
    and not n times. A pair whose state the template renders differently once the action
    follows, or that is longer than the context, is scored whole by `score`."""
    model.eval()
    context = model.config.max_position_embeddings
    out: list[float | None] = [None] * len(pairs)
    groups: dict[str, list[int]] = {}
    for i, (state, _) in enumerate(pairs):
        groups.setdefault(json.dumps(state, sort_keys=True, default=str), []).append(i)
    whole: list[int] = []
    for members in groups.values():
        state = pairs[members[0]][0]
        prefix = list(tokenizer.apply_chat_template(state, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])
        actions, shared = [], []
        for i in members:
            ids = encode(tokenizer, state, pairs[i][1])
            if ids[: len(prefix)] == prefix and len(ids) <= context and len(ids) > len(prefix):
                actions.append(ids[len(prefix) :])
                shared.append(i)
            else:
                whole.append(i)
        if not shared:
            continue
        cache = DynamicCache(config=model.config)
        model.model(input_ids=torch.tensor([prefix]), past_key_values=cache, use_cache=True)
        cache.reorder_cache(torch.zeros(len(shared), dtype=torch.long))  # the state's keys and values for each action
        width, pad = max(map(len, actions)), tokenizer.pad_token_id
        ids = torch.tensor([a + [pad] * (width - len(a)) for a in actions])
        mask = torch.tensor([[1] * len(prefix) + [1] * len(a) + [0] * (width - len(a)) for a in actions])
        positions = torch.arange(len(prefix), len(prefix) + width).expand(len(shared), -1)
        hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True).last_hidden_state
        last = hidden[torch.arange(len(shared)), torch.tensor([len(a) - 1 for a in actions])]
        for i, q in zip(shared, torch.sigmoid(model.score(last).squeeze(-1).float()).tolist()):
            out[i] = q
    if whole:
        for i, q in zip(whole, score(model, tokenizer, [encode(tokenizer, *pairs[i]) for i in whole])):
            out[i] = q
    return out  # type: ignore[return-value]
