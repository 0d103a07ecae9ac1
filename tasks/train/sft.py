"""Supervised fine-tuning on chat trajectories, loss on the agent's tokens only.

The loss mask comes from the chat template's {% generation %} blocks. TRL has been seen to drop
such masks silently under some settings, so `tokenize_chats` fails loudly when a conversation's
mask is empty or does not cover exactly the assistant turns.
"""
from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainingArguments

from models.hf import native_bf16

IGNORE = -100


class MaskError(ValueError):
    pass


@dataclass
class TokenizedChats:
    examples: list[dict]  # input_ids, labels
    truncated: int  # conversations cut at max_length (their tail turns carry no loss)


def tokenize_chats(
    tokenizer: PreTrainedTokenizerBase, conversations: list[list[dict]], max_length: int
) -> TokenizedChats:
    examples, truncated = [], 0
    for i, messages in enumerate(conversations):
        enc = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
        n_assistant = sum(1 for m in messages if m["role"] == "assistant")
        if n_assistant and not any(mask):
            raise MaskError(f"conversation {i}: assistant-token mask is empty; the chat template lacks {{% generation %}}")
        expected = "".join(m["content"] + tokenizer.eos_token for m in messages if m["role"] == "assistant")
        supervised = tokenizer.decode([t for t, k in zip(ids, mask) if k], skip_special_tokens=False)
        if supervised != expected:
            raise MaskError(f"conversation {i}: the loss mask does not cover exactly the assistant turns")
        if len(ids) > max_length:
            ids, mask, truncated = ids[:max_length], mask[:max_length], truncated + 1
        labels = [t if k else IGNORE for t, k in zip(ids, mask)]
        examples.append({"input_ids": ids, "labels": labels})
    return TokenizedChats(examples, truncated)


class PadCollator:
    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(b["input_ids"]) for b in batch)

        def pad(seq: list[int], value: int) -> list[int]:
            return seq + [value] * (width - len(seq))  # right padding for training

        out = {
            "input_ids": torch.tensor([pad(b["input_ids"], self.pad_id) for b in batch]),
            "labels": torch.tensor([pad(b["labels"], IGNORE) for b in batch]),
            "attention_mask": torch.tensor([[1] * len(b["input_ids"]) + [0] * (width - len(b["input_ids"])) for b in batch]),
        }
        if "weight" in batch[0]:  # reward-weighted training (Refit, Swift)
            out["weight"] = torch.tensor([b["weight"] for b in batch], dtype=torch.float32)
        return out


def train_sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: list[dict],
    *,
    epochs: float,
    batch_size: int,
    learning_rate: float,
    warmup_ratio: float,
    weight_decay: float,
    bf16: bool | str,
    seed: int,
    deepspeed: str | None = None,
    trainer_cls: type[Trainer] = Trainer,
    **trainer_kwargs,
) -> list[dict]:
    """Train in place with the HF Trainer (or a subclass with its own loss, such as Refit's);
    returns the logged loss curve. `deepspeed` is a ZeRO config file, used only on GPUs."""
    steps = math.ceil(len(examples) / batch_size) * epochs
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=batch_size,
            num_train_epochs=epochs,
            learning_rate=learning_rate,
            lr_scheduler_type="cosine",
            warmup_steps=int(warmup_ratio * steps),
            weight_decay=weight_decay,
            logging_steps=max(1, int(steps // 20)),
            save_strategy="no",
            report_to="none",
            seed=seed,
            data_seed=seed,
            use_cpu=not torch.cuda.is_available(),
            bf16=native_bf16() if bf16 == "auto" else bf16,
            train_sampling_strategy="group_by_length",  # batches of similar length: less padding
            remove_unused_columns=False,  # keep per-trajectory weights for reward-weighted losses
            deepspeed=deepspeed if torch.cuda.is_available() else None,
        )
        trainer = trainer_cls(
            model=model,
            args=args,
            train_dataset=_ListDataset(examples),
            data_collator=PadCollator(tokenizer.pad_token_id),
            **trainer_kwargs,
        )
        trainer.train()
        return [e for e in trainer.state.log_history if "loss" in e]


class _ListDataset(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def train(model, tokenizer, table, cfg, seed: int) -> dict:
    """The SFT algorithm on a training table: every trajectory, weight 1."""
    if table.height == 0:
        return {"rows": 0, "truncated": 0, "curve": []}
    tokenized = tokenize_chats(tokenizer, table["messages"].to_list(), model.config.max_position_embeddings)
    curve = train_sft(model, tokenizer, tokenized.examples, seed=seed, **cfg.trainer_kwargs())
    return {"rows": table.height, "truncated": tokenized.truncated, "curve": curve}
