"""HOPE's actor update (HOPE Eq. 2): sigmoid DPO on critic-ranked pairs against a frozen reference.

    loss = - log sigmoid( beta * [ (log pi(a+|s) - log ref(a+|s)) - (log pi(a-|s) - log ref(a-|s)) ] )

a+ and a- are the candidates the critic scored highest and lowest at state s; beta is the KL
coefficient (`actor.kl_beta`, HOPE's code 0.03). log pi(a|s) sums the log-probabilities of the
action's tokens only: the state (earlier turns included, whose agent messages the SFT mask would
cover) carries no loss. The reference's log-probabilities are computed once per batch of pairs,
before the update, from the frozen starting policy (HOPE: pi_0).

The same loss, masks, pair collator and trainer serve StepAgent-Implicit (stepagent_implicit.py),
whose chosen action is the expert's and rejected one the policy's own at the same state.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import Trainer

from tasks.train.sft import IGNORE, PACKED_KEYS, MaskError, PadCollator, train_sft


def encode(tokenizer, prompt: list[dict], action: dict, context: int) -> tuple[dict, bool]:
    """The chat template over prompt + action, labels on the action's tokens alone (its content and
    end-of-turn token). A sequence longer than `context` keeps its last `context` tokens (the
    action whole, the state's start cut); returns (input_ids and labels, whether it was cut)."""
    enc = tokenizer.apply_chat_template([*prompt, action], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
    state = list(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])
    if ids[: len(state)] != state:
        raise MaskError("the chat template renders the state differently once the action follows it")
    labels = [t if k and i >= len(state) else IGNORE for i, (t, k) in enumerate(zip(ids, mask))]
    if all(t == IGNORE for t in labels):
        raise MaskError("the action has no token under the assistant mask; the chat template lacks {% generation %}")
    cut = len(ids) > context
    if cut:
        if len(ids) - len(state) > context:
            raise MaskError(f"the action alone is longer than the model's {context} positions")
        ids, labels = ids[-context:], labels[-context:]
    return {"input_ids": ids, "labels": labels}, cut


def sequence_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor, **packed) -> torch.Tensor:
    """Sum of log p(token) over each sequence's labelled tokens: [B] for a padded batch, one per
    sequence for a packed one (attention_mask None, `packed` PadCollator's position_ids and
    cu_seq_lens_*). The output layer and softmax run on the action's positions only: a state is
    most of a sequence and carries no loss."""
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, **packed).last_hidden_state[:, :-1]
    target = labels[:, 1:]
    keep = target != IGNORE
    logits = model.get_output_embeddings()(hidden[keep]).float()
    logp = logits.log_softmax(-1).gather(1, target[keep].unsqueeze(1)).squeeze(1)
    if packed:  # the label at row position j + 1 is of the sequence whose span holds j + 1
        bounds = packed["cu_seq_lens_q"].to(target.device)
        positions = torch.arange(1, target.shape[1] + 1, device=target.device, dtype=bounds.dtype)
        rows, n = torch.bucketize(positions, bounds[1:], right=True).unsqueeze(0).expand_as(target)[keep], len(bounds) - 1
    else:
        rows, n = torch.arange(len(target), device=target.device).unsqueeze(1).expand_as(target)[keep], len(target)
    return torch.zeros(n, dtype=logp.dtype, device=logp.device).index_add(0, rows, logp)


def dpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, beta: float):
    """Eq. 2 on a batch of log-probabilities [B]; returns the mean loss and the implicit rewards
    beta * (log pi - log ref) of chosen and rejected."""
    r_chosen, r_rejected = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
    return -F.logsigmoid(r_chosen - r_rejected).mean(), r_chosen.detach(), r_rejected.detach()


class PairCollator(PadCollator):
    """A batch of pairs as one padded (or, padding_free, packed) batch: the chosen rows, then the
    rejected ones, with the reference's log-probabilities in the same order."""

    def __call__(self, batch: list[dict]) -> dict[str, torch.Tensor]:
        rows = [{"input_ids": b["input_ids"], "labels": b["labels"]} for b in batch]
        rows += [{"input_ids": b["rejected_input_ids"], "labels": b["rejected_labels"]} for b in batch]
        out = super().__call__(rows)
        out["ref_logps"] = torch.tensor([b["ref_chosen"] for b in batch] + [b["ref_rejected"] for b in batch], dtype=torch.float32)
        return out


class DPOTrainer(Trainer):
    """The HF Trainer with Eq. 2; logs the implicit rewards' margin and how often chosen leads."""

    loss_is_scaled_for_ga = False  # compute_loss returns a micro-batch mean (see refit.py)

    def __init__(self, *args, beta: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.beta, self._seen = beta, []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ref = inputs.pop("ref_logps")
        packed = {k: inputs[k] for k in PACKED_KEYS if k in inputs}
        logps = sequence_logps(model, inputs["input_ids"], inputs.get("attention_mask"), inputs["labels"], **packed)
        n = ref.shape[0] // 2
        loss, r_chosen, r_rejected = dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], self.beta)
        self._seen.append(((r_chosen - r_rejected).mean().item(), (r_chosen > r_rejected).float().mean().item()))
        return loss

    def log(self, logs: dict, *args, **kwargs) -> None:
        if "loss" in logs:
            seen = torch.tensor([sum(m for m, _ in self._seen), sum(a for _, a in self._seen), len(self._seen)], dtype=torch.float64)
            if self.args.world_size > 1:  # every rank logs the loss together: each saw its share of the pairs
                torch.distributed.all_reduce(seen)
            if seen[2] > 0:
                logs["margin"] = round(float(seen[0] / seen[2]), 6)
                logs["accuracy"] = round(float(seen[1] / seen[2]), 4)
            self._seen = []
        super().log(logs, *args, **kwargs)


@torch.no_grad()
def reference_logps(ref_model, tokenizer, sequences: list[dict], batch_size: int = 16) -> list[float]:
    """log ref(a|s) for each encoded sequence, in order."""
    ref_model.eval()
    collate = PadCollator(tokenizer.pad_token_id)
    out: list[float] = []
    for i in range(0, len(sequences), batch_size):
        b = collate(sequences[i : i + batch_size])
        out += sequence_logps(ref_model, b["input_ids"], b["attention_mask"], b["labels"]).tolist()
    return out


def pair_rows(ref_model, tokenizer, pairs: list[tuple[dict, dict]]) -> list[dict]:
    """pairs: (chosen, rejected) encodings; returns the training rows, each pair with the
    reference's log-probabilities of its two actions."""
    ref = reference_logps(ref_model, tokenizer, [s for pair in pairs for s in pair])
    return [
        {**c, "rejected_input_ids": r["input_ids"], "rejected_labels": r["labels"], "ref_chosen": ref[2 * i], "ref_rejected": ref[2 * i + 1]}
        for i, (c, r) in enumerate(pairs)
    ]


def fit(model, tokenizer, rows: list[dict], seed: int, beta: float, **trainer_kwargs) -> list[dict]:
    """Trains `model` in place on pair_rows (train_sft's settings, padding_free included; under
    torchrun every rank calls it with the same rows and takes its share of each batch); returns
    the loss curve (with margin and accuracy)."""
    collator = PairCollator(tokenizer.pad_token_id, trainer_kwargs.get("padding_free", False))
    return train_sft(model, tokenizer, rows, seed=seed, trainer_cls=DPOTrainer, collator=collator, beta=beta, **trainer_kwargs)


def train(model, ref_model, tokenizer, pairs: list[tuple[dict, dict]], seed: int, beta: float, **trainer_kwargs) -> list[dict]:
    """pair_rows then fit, in one process."""
    return fit(model, tokenizer, pair_rows(ref_model, tokenizer, pairs), seed, beta, **trainer_kwargs)
