"""Supervised fine-tuning on chat trajectories, loss on the agent's tokens only.

The loss mask comes from the chat template's {% generation %} blocks. TRL has been seen to drop
such masks silently under some settings, so `tokenize_chats` fails loudly when a conversation's
mask is empty or does not cover exactly the assistant turns.

Training faults: a NaN/inf or diverging loss stops training with `TrainingDiverged`; with a
checkpoint directory, training checkpoints every few steps and a rerun resumes from the newest
complete checkpoint, repeating the uninterrupted run to the byte.
"""
from __future__ import annotations

import contextlib
import math
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import (
    AttentionInterface,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from models.hf import native_bf16
from models.tiny import IGNORE
from storage.schema import from_table


class MaskError(ValueError):
    pass


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf or grew past max_loss_ratio; training stopped and nothing was saved."""

    def __init__(self, step: int, loss: float, why: str):
        super().__init__(why)
        self.step, self.loss, self.why = step, loss, why
        self.method: str | None = None  # set by run_train, which knows the method's name

    def __str__(self) -> str:
        who = f"train {self.method}" if self.method else "training"
        return (
            f"{who}: {self.why}; training stopped and no model was saved for this method. "
            "Try a lower learning_rate (train.learning_rate, or the method's own learning_rate) or a longer warmup "
            "(train.warmup_ratio), and look for NaN/inf weights in the training table."
        )


class LossGuard(TrainerCallback):
    """Raises TrainingDiverged at a logged loss that is NaN/inf, or once the median of the last
    `window` logged losses exceeds max_loss_ratio times the first logged loss in magnitude.

    The median, so that one noisy step never stops a run (persuasion's quick look stopped at its
    critic's second step: 0.198, then 2.63, on four pairs), while a loss that keeps rising, or
    jumps and stays up, moves it within a few logs; the rule waits for `window` logs, so a run
    shorter than that stops on NaN/inf alone. The first loss, because a run can diverge at its
    second step (a learning rate of 10 took a loss from 6 to 1660), so any median of early losses
    would hold the diverged ones. Magnitude, because reward-weighted losses can be negative:
    Swift's falls without bound once negative weights win (-651 where it began near -60). Default
    runs stayed within 2.9x; a first loss whose weighted terms happen to cancel near 0 would make
    the rule trip early (raise max_loss_ratio, or null to turn it off). The Trainer must log with
    logging_nan_inf_filter off, or it replaces a NaN step's loss by the mean of the others.
    `train_loss` (the mean over the run, logged at the end) covers the steps after the last
    logging step."""

    def __init__(self, max_loss_ratio: float | None, window: int = 5):
        self.max_loss_ratio, self.window = max_loss_ratio, window

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        for key in ("loss", "train_loss"):
            if key in logs and not math.isfinite(logs[key]):
                raise TrainingDiverged(state.global_step, logs[key], f"the loss is {logs[key]} at step {state.global_step}")
        # From the log history, which checkpoints keep: a resumed run compares the same losses.
        logged = [e for e in state.log_history if "loss" in e]
        if "loss" not in logs or not self.max_loss_ratio or len(logged) < self.window:
            return
        first, recent = logged[0], statistics.median(e["loss"] for e in logged[-self.window :])
        if first["loss"] and abs(recent) > self.max_loss_ratio * abs(first["loss"]):
            raise TrainingDiverged(
                state.global_step, recent,
                f"the median of the last {self.window} logged losses diverged to {recent:.4g} at step {state.global_step}, more than "
                f"max_loss_ratio = {self.max_loss_ratio:g} times the first logged loss ({first['loss']:.4g} at step {first['step']}) in magnitude",
            )


CHECKPOINT_DONE = "complete"  # written into a checkpoint folder after everything else
EPOCH_RNG = "epoch_rng.pt"


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest checkpoint the Trainer finished writing (a killed run can leave a partial one)."""
    done = [p for p in folder.glob("checkpoint-*") if (p / CHECKPOINT_DONE).exists()]
    return max(done, key=lambda p: int(p.name.rsplit("-", 1)[1]), default=None)


class ExactResume(TrainerCallback):
    """Completes the HF Trainer's checkpoints so that a resumed run repeats the uninterrupted one.

    The Trainer restores the RNG state after resuming mid-epoch, but the resumed epoch draws its
    batch order (the length-grouped sampler uses the global RNG) from the RNG as it stands in the
    new process: in the first epoch that is the same state, in later ones it is not, so it skipped
    the wrong batches (seen: resuming at step 18 of 24, 2 epochs, gave other weights). So each
    checkpoint keeps the RNG state at the start of its epoch, put back before the resumed epoch
    draws its order. The Trainer's extra save at the last step is dropped: the caller saves the
    finished model, after LossGuard has seen the last steps' loss.
    """

    def __init__(self, epoch_rng: torch.Tensor | None):
        self.restore, self.epoch_rng = epoch_rng, None

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.restore is not None:
            torch.set_rng_state(self.restore)
            self.restore = None
        self.epoch_rng = torch.get_rng_state()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps and state.global_step % state.save_steps:
            control.should_save = False

    def on_save(self, args, state, control, **kwargs):
        if not args.should_save:  # another rank of a multi-process run: the main one writes checkpoints
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        torch.save(self.epoch_rng, folder / EPOCH_RNG)
        (folder / CHECKPOINT_DONE).touch()


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


PACKED_ATTENTION = "retrosight_packed_sdpa"
# What a packed batch gives the model in place of an attention mask (PadCollator._packed).
PACKED_KEYS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _packed_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, cu_seq_lens_q=None, **kwargs):
    """Causal SDPA run per sequence of a padding-free batch (one packed row, boundaries in
    cu_seq_lens_q). Without flash attention's varlen kernels, the stock SDPA path would attend
    over the whole packed row under a dense block-diagonal mask, (sum of lengths)^2 work."""
    lengths = cu_seq_lens_q.diff().tolist()
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    # split, not slicing: a slice's backward writes into a zero tensor the size of the whole row
    out = [
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa)
        for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2))
    ]
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


# Not in transformers' mask registry, so models build no attention mask for it.
AttentionInterface.register(PACKED_ATTENTION, _packed_sdpa)


class PadCollator:
    """Right-padded batches; with padding_free, the batch's sequences packed into one row with
    position_ids and sequence boundaries (cu_seq_lens_*), no padding and no attention mask."""

    def __init__(self, pad_id: int, padding_free: bool = False):
        self.pad_id, self.padding_free = pad_id, padding_free

    def __call__(self, batch: list[dict]) -> dict[str, torch.Tensor]:
        if self.padding_free:
            return self._packed(batch)
        width = max(len(b["input_ids"]) for b in batch)

        def pad(seq: list[int], value: int) -> list[int]:
            return seq + [value] * (width - len(seq))  # right padding for training

        out = {
            "input_ids": torch.tensor([pad(b["input_ids"], self.pad_id) for b in batch]),
            "labels": torch.tensor([pad(b["labels"], IGNORE) for b in batch]),
            "attention_mask": torch.tensor([[1] * len(b["input_ids"]) + [0] * (width - len(b["input_ids"])) for b in batch]),
        }
        return self._extras(batch, out)

    @staticmethod
    def _extras(batch: list[dict], out: dict) -> dict:
        for key in ("weight", "target"):  # a trajectory's weight (Refit, Swift); a pair's target (the critic)
            if key in batch[0]:
                out[key] = torch.tensor([b[key] for b in batch], dtype=torch.float32)
        return out

    def _packed(self, batch: list[dict]) -> dict:
        lengths = [len(b["input_ids"]) for b in batch]
        bounds = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        out = {
            "input_ids": torch.tensor([[t for b in batch for t in b["input_ids"]]]),
            # A sequence's first label never counts: the token before it in the row ends the previous sequence.
            "labels": torch.tensor([[t for b in batch for t in [IGNORE, *b["labels"][1:]]]]),
            "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0),
            "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": max(lengths), "max_length_k": max(lengths),
        }
        return self._extras(batch, out)


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
    max_loss_ratio: float | None = None,
    checkpoint_dir: Path | None = None,
    checkpoint_steps: int = 10,
    padding_free: bool = False,
    max_steps: int | None = None,
    trainer_cls: type[Trainer] = Trainer,
    collator: PadCollator | None = None,
    callbacks: tuple[TrainerCallback, ...] = (),
    **trainer_kwargs,
) -> list[dict]:
    """Train in place with the HF Trainer (or a subclass with its own loss, such as Refit's);
    returns the logged loss curve. `deepspeed` is a ZeRO config file, used only on GPUs.
    `collator` batches the examples (default: PadCollator; DPO's pairs have their own).

    With `checkpoint_dir`, a checkpoint (weights, optimizer, scheduler, RNG, data position) is
    written there every `checkpoint_steps` steps, rounded up to a multiple of the logging interval
    (a resumed run then averages the same steps into each logged loss), and training resumes from
    the newest complete one there.

    `padding_free` packs each batch into one row (no padding; attention per sequence): the same
    loss and gradients to float rounding, not to the bit (tests/test_packed.py, per trainer),
    faster where lengths in a batch differ. The train stage's default (`train.padding_free`).

    `max_steps` trains exactly that many optimizer steps instead of `epochs` passes (the HF
    Trainer's max_steps: passes repeated, the last one cut short)."""
    steps = max_steps or math.ceil(len(examples) / batch_size) * epochs
    logging_steps = max(1, int(steps // 20))
    resume = None
    if checkpoint_dir is not None:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        resume = latest_checkpoint(checkpoint_dir)
        for partial in checkpoint_dir.glob("checkpoint-*"):
            if not (partial / CHECKPOINT_DONE).exists():
                shutil.rmtree(partial)
    with contextlib.nullcontext(checkpoint_dir) if checkpoint_dir else tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=str(out),
            per_device_train_batch_size=batch_size,
            num_train_epochs=epochs,
            max_steps=max_steps or -1,  # -1: by epochs
            learning_rate=learning_rate,
            lr_scheduler_type="cosine",
            warmup_steps=int(warmup_ratio * steps),
            weight_decay=weight_decay,
            logging_steps=logging_steps,
            logging_nan_inf_filter=False,  # LossGuard must see a NaN step's loss
            save_strategy="steps" if checkpoint_dir else "no",
            save_steps=math.ceil(checkpoint_steps / logging_steps) * logging_steps,
            save_total_limit=2,  # the older one stands in if the newer was cut short
            report_to="none",
            seed=seed,
            data_seed=seed,
            use_cpu=not torch.cuda.is_available(),
            bf16=native_bf16() if bf16 == "auto" else bf16,
            train_sampling_strategy="group_by_length",  # batches of similar length: less padding
            remove_unused_columns=False,  # keep per-trajectory weights for reward-weighted losses
            # Batches are padded in this process: a loader worker's threads would come on top of
            # runtime.threads, and the tables are small enough that none is needed.
            dataloader_num_workers=0,
            # Under torchrun on CPU too: DeepSpeed's CPU accelerator over gloo (tasks/train/launch.py).
            deepspeed=deepspeed if torch.cuda.is_available() or torch.distributed.is_torchelastic_launched() else None,
        )
        trainer = trainer_cls(
            model=model,
            args=args,
            train_dataset=_ListDataset(examples),
            data_collator=collator or PadCollator(tokenizer.pad_token_id, padding_free),
            callbacks=[LossGuard(max_loss_ratio), *callbacks] + ([ExactResume(torch.load(resume / EPOCH_RNG) if resume else None)] if checkpoint_dir else []),
            **trainer_kwargs,
        )
        if padding_free:
            attention = model.config._attn_implementation
            model.set_attn_implementation(PACKED_ATTENTION)
        try:
            trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        finally:
            if padding_free:  # the saved model must not name an attention only this module registers
                model.set_attn_implementation(attention)
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
    tokenized = tokenize_chats(tokenizer, [r["messages"] for r in from_table(table.select("messages"))], model.config.max_position_embeddings)
    curve = train_sft(model, tokenizer, tokenized.examples, seed=seed, max_steps=cfg.gradient_steps, **cfg.trainer_kwargs())
    return {"rows": table.height, "truncated": tokenized.truncated, "curve": curve}
