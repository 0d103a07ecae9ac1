"""Training throughput: the Refit trainer against TRL's SFTTrainer, same model, rows and settings.

    python bench/train_throughput.py [--repeats 2] [--threads N] [--trl-padding-free] [--small]

Rows (each from a fresh copy of the base model, seeded and deterministic as run_train sets up):
  refit  tasks.train.refit.train with params.yaml's config, exactly as run_train calls it: packed
         batches (train.padding_free: true), each batch one row, attention per sequence
         (tasks.train.sft._packed_sdpa)
  refit-padded  the same with train.padding_free: false: padded batches; the same loss to float
         rounding (tests/test_packed.py). With params whose padding_free is false, the two swap:
         refit-packed is the row added.
  trl    trl.SFTTrainer, assistant_only_loss=True, the same batch size, epochs, learning-rate
         schedule, seeds, length-grouped sampler and precision; padded batches
  trl-pf (--trl-padding-free) the same with padding_free=True: one packed row per batch, no
         attention mask. Without flash attention (CPU), transformers turns the packed row's
         position_ids into a dense block-diagonal mask for SDPA, so attention costs
         (sum of lengths)^2 instead of sum of lengths^2.

The data are the rows the default Refit run trains on (weight != 0 in the training table), so
`refit` is the pipeline's own workload. The bench checks that TRL tokenizes them to the same
input_ids and loss mask, that both trainers get the same TrainingArguments where they overlap
and take the same number of optimizer steps. Tokens are counted from that shared tokenization
(total = real tokens, no padding; supervised = tokens with a loss), times epochs, divided by the
wall time of Trainer.train (the training loop); "total s" adds tokenization and trainer set-up.
Rows are interleaved over --repeats rounds and the median is reported, since the machine may be
shared. It also compares both losses on one fixed batch (weights 1, norm "tokens").
Writes bench/out/train_throughput.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import polars as pl
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, set_seed

from models.hf import native_bf16
from storage.schema import from_table
from tasks.params import load_params
from tasks.train import refit
from tasks.train.sft import IGNORE, PadCollator, tokenize_chats

# TrainingArguments both trainers must agree on for the comparison to hold.
SHARED_ARGS = (
    "per_device_train_batch_size", "gradient_accumulation_steps", "num_train_epochs", "learning_rate",
    "lr_scheduler_type", "warmup_steps", "weight_decay", "seed", "data_seed", "bf16", "fp16",
    "train_sampling_strategy", "gradient_checkpointing", "optim", "adam_beta1", "adam_beta2", "adam_epsilon",
    "max_grad_norm", "use_cpu",
)


@contextlib.contextmanager
def timed_train(record: dict):
    """Times Trainer.train (wall and process CPU) for whichever Trainer subclass runs inside."""
    original = Trainer.train

    def train(self, *args, **kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            record["train_s"] = time.perf_counter() - wall
            record["train_cpu_s"] = time.process_time() - cpu
            record["steps"] = self.state.global_step
            record["args"] = {k: getattr(self.args, k) for k in SHARED_ARGS}
            record["loss_curve"] = [e["loss"] for e in self.state.log_history if "loss" in e]

    Trainer.train = train
    try:
        yield
    finally:
        Trainer.train = original


def fresh(model_dir: str, seed: int):
    """As run_train: seeded, deterministic algorithms, a float32 copy of the base model."""
    set_seed(seed)
    torch.use_deterministic_algorithms(True)
    return AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def trl_trainer(model, tokenizer, conversations: list, cfg, seed: int, out: str, padding_free: bool):
    """An SFTTrainer set up like tasks.train.sft.train_sft sets up the HF Trainer."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    t = cfg.train
    steps = math.ceil(len(conversations) / t.batch_size) * t.epochs
    args = SFTConfig(
        output_dir=out,
        per_device_train_batch_size=t.batch_size,
        num_train_epochs=t.epochs,
        learning_rate=t.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=int(t.warmup_ratio * steps),
        weight_decay=t.weight_decay,
        logging_steps=max(1, int(steps // 20)),
        logging_nan_inf_filter=False,
        save_strategy="no",
        report_to="none",
        seed=seed,
        data_seed=seed,
        use_cpu=not torch.cuda.is_available(),
        bf16=native_bf16() if t.bf16 == "auto" else t.bf16,
        train_sampling_strategy="group_by_length",
        gradient_checkpointing=False,  # SFTConfig turns it on by default; the Refit trainer does not use it
        assistant_only_loss=True,
        padding_free=padding_free,
        # padding_free without packing requires no truncation; the rows are shorter than the model's context anyway
        max_length=None if padding_free else model.config.max_position_embeddings,
    )
    data = Dataset.from_list([{"messages": m} for m in conversations])
    return SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)


def run_refit(model_dir: str, table: pl.DataFrame, cfg, seed: int) -> dict:
    tokenizer, model = fresh(model_dir, seed)
    record: dict = {}
    t0 = time.perf_counter()
    with timed_train(record):
        refit.train(model, tokenizer, table, cfg, seed)
    record["total_s"] = time.perf_counter() - t0
    return record


def run_trl(model_dir: str, table: pl.DataFrame, cfg, seed: int, padding_free: bool) -> dict:
    tokenizer, model = fresh(model_dir, seed)
    record: dict = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out, timed_train(record):
        trl_trainer(model, tokenizer, [r["messages"] for r in from_table(table.select("messages"))], cfg, seed, out, padding_free).train()
    record["total_s"] = time.perf_counter() - t0
    return record


def fixed_batch_losses(model_dir: str, conversations: list, examples: list[dict], cfg, seed: int) -> dict:
    """Checks that TRL tokenizes the rows as we do (same input_ids, same loss mask), then compares
    the losses on one batch, weights 1: the Refit loss (norm "tokens", and "sequences" for contrast)
    and TRL's as its training step computes it (num_items_in_batch counted by the Trainer)."""
    tokenizer, model = fresh(model_dir, seed)
    with tempfile.TemporaryDirectory() as out:
        trainer = trl_trainer(model, tokenizer, conversations, cfg, seed, out, padding_free=False)
    theirs = trainer.train_dataset
    for i, ex in enumerate(examples):
        if theirs[i]["input_ids"] != ex["input_ids"] or theirs[i]["labels"] != ex["labels"]:
            raise SystemExit(f"row {i}: TRL's input_ids or labels differ from tokenize_chats'; the comparison would not hold")
    n = min(cfg.train.batch_size, len(examples))
    trl_batch = trainer.data_collator([theirs[i] for i in range(n)])
    n_items = trainer._get_num_items_in_batch([trl_batch], trainer.args.device)
    with torch.no_grad():
        trl_loss = trainer.compute_loss(trainer.model, trl_batch, num_items_in_batch=n_items).item()

    tokenizer, model = fresh(model_dir, seed)
    batch = PadCollator(tokenizer.pad_token_id)([{**ex, "weight": 1.0} for ex in examples[:n]])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        ours = {norm: refit.weighted_action_nll(logits, batch["labels"], batch["weight"], norm).item()
                for norm in ("tokens", "sequences")}
    return {
        "rows": n, "supervised_tokens": int((batch["labels"][:, 1:] != IGNORE).sum()),
        "refit_tokens": ours["tokens"], "refit_sequences": ours["sequences"], "trl": trl_loss,
        "abs_diff": abs(ours["tokens"] - trl_loss), "rel_diff": abs(ours["tokens"] - trl_loss) / abs(trl_loss),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--model", help="base model (default: params' train.base_model)")
    ap.add_argument("--table", default="data/standardize/train.parquet")
    ap.add_argument("--method", default="refit", help="the params.yaml train method whose config Refit uses")
    ap.add_argument("--rows", type=int, help="at most this many of the rows Refit trains on")
    ap.add_argument("--max-messages", type=int, help="cut each conversation to its first N messages")
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--epochs", type=float)
    ap.add_argument("--repeats", type=int, help="interleaved rounds, medians reported (default 2; --small: 1)")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's, one per core)")
    ap.add_argument("--trl-padding-free", action="store_true", help="add TRL with padding_free=True (slow on CPU)")
    ap.add_argument("--small", action="store_true", help="8 rows of 7 messages, batch 4, 1 epoch: for CI")
    ap.add_argument("--out", default="bench/out/train_throughput.json")
    args = ap.parse_args()
    if args.small:
        args.rows, args.max_messages, args.batch_size, args.epochs = 8, 7, 4, 1
    args.repeats = args.repeats or (1 if args.small else 2)
    if args.threads:
        torch.set_num_threads(args.threads)

    params = load_params(args.params)
    model_dir = args.model or params.train.base_model
    cfg = params.train.config_for(params.train.methods[args.method])
    overrides = {k: v for k, v in {"batch_size": args.batch_size, "epochs": args.epochs}.items() if v is not None}
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update=overrides)})
    seed = params.seed

    table = pl.read_parquet(args.table).filter(pl.col("weight").is_not_null() & (pl.col("weight") != 0))
    if args.rows:
        table = table.head(args.rows)
    if args.max_messages:
        table = table.with_columns(pl.col("messages").list.head(args.max_messages))
    conversations = [r["messages"] for r in from_table(table.select("messages"))]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    max_length = AutoModelForCausalLM.from_pretrained(model_dir).config.max_position_embeddings
    examples = tokenize_chats(tokenizer, conversations, max_length).examples
    passes = cfg.train.epochs
    total_tokens = passes * sum(len(ex["input_ids"]) for ex in examples)
    supervised_tokens = passes * sum(sum(t != IGNORE for t in ex["labels"][1:]) for ex in examples)

    loss = fixed_batch_losses(model_dir, conversations, examples, cfg, seed)

    packed = cfg.train.padding_free
    other_name = "refit-padded" if packed else "refit-packed"
    other = cfg.model_copy(update={"train": cfg.train.model_copy(update={"padding_free": not packed})})
    runners = {"refit": lambda: run_refit(model_dir, table, cfg, seed),
               "trl": lambda: run_trl(model_dir, table, cfg, seed, padding_free=False),
               other_name: lambda: run_refit(model_dir, table, other, seed)}
    if args.trl_padding_free:
        runners["trl-pf"] = lambda: run_trl(model_dir, table, cfg, seed, padding_free=True)
    runs: dict[str, list[dict]] = {name: [] for name in runners}
    for round_ in range(args.repeats):
        # Alternate the order: the first Trainer.train of a process pays one-time costs (imports, thread pools).
        for name in list(runners)[:: 1 if round_ % 2 == 0 else -1]:
            runs[name].append(runners[name]())

    for name, recs in runs.items():
        if any(r["args"] != runs["refit"][0]["args"] for r in recs):
            raise SystemExit(f"{name}: TrainingArguments differ from the Refit trainer's: {recs[0]['args']} vs {runs['refit'][0]['args']}")
        if any(r["steps"] != runs["refit"][0]["steps"] for r in recs):
            raise SystemExit(f"{name}: took {recs[0]['steps']} optimizer steps, the Refit trainer {runs['refit'][0]['steps']}")

    summary = {}
    for name, recs in runs.items():
        train_s = statistics.median(r["train_s"] for r in recs)
        summary[name] = {
            "train_s": train_s,
            "train_cpu_s": statistics.median(r["train_cpu_s"] for r in recs),
            "total_s": statistics.median(r["total_s"] for r in recs),
            "tokens_per_s": total_tokens / train_s,
            "supervised_tokens_per_s": supervised_tokens / train_s,
            "all_train_s": [r["train_s"] for r in recs],
            "final_loss": recs[0]["loss_curve"][-1],
        }
    steps = runs["refit"][0]["steps"]
    print(f"\n{len(examples)} rows, {total_tokens:.0f} tokens ({supervised_tokens:.0f} supervised) over {passes:g} epochs, "
          f"batch {cfg.train.batch_size}, {steps} optimizer steps, model {model_dir}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} interleaved round(s)")
    print(f"{'trainer':<14}{'train s':>10}{'cpu s':>10}{'total s':>10}{'tokens/s':>12}{'superv. tok/s':>15}{'refit/this':>11}{'last loss':>11}")
    base = summary["refit"]["tokens_per_s"]
    for name, s in summary.items():
        print(f"{name:<14}{s['train_s']:>10.2f}{s['train_cpu_s']:>10.2f}{s['total_s']:>10.2f}"
              f"{s['tokens_per_s']:>12.1f}{s['supervised_tokens_per_s']:>15.1f}{base / s['tokens_per_s']:>11.2f}{s['final_loss']:>11.4g}")
    ratio = base / summary["trl"]["tokens_per_s"]
    rounds = [b["train_s"] / a["train_s"] for a, b in zip(runs["refit"], runs["trl"])]
    print(f"ratio ours/TRL (tokens/s, training loop): {ratio:.2f} (per round: {', '.join(f'{r:.2f}' for r in rounds)})")
    print(f"ratio ours/TRL (end to end, incl. tokenization and set-up): {summary['trl']['total_s'] / summary['refit']['total_s']:.2f}")
    print(f"refit is {'packed' if packed else 'padded'} (train.padding_free: {str(packed).lower()}); "
          f"{other_name}/TRL (tokens/s, training loop): {summary[other_name]['tokens_per_s'] / summary['trl']['tokens_per_s']:.2f}; "
          f"packed/padded: {(base / summary[other_name]['tokens_per_s']) ** (1 if packed else -1):.2f}")
    print(f"fixed batch ({loss['rows']} rows, {loss['supervised_tokens']} supervised tokens, weights 1): "
          f"refit[tokens] = {loss['refit_tokens']:.8f}  trl = {loss['trl']:.8f}  diff = {loss['abs_diff']:.3g} "
          f"(rel {loss['rel_diff']:.3g}); refit[sequences] = {loss['refit_sequences']:.6f}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join(["python", "bench/train_throughput.py", *sys.argv[1:]]),
        "rows": len(examples), "epochs": passes, "batch_size": cfg.train.batch_size, "steps": steps,
        "total_tokens": total_tokens, "supervised_tokens": supervised_tokens, "threads": torch.get_num_threads(),
        "repeats": args.repeats, "summary": summary, "ratio_ours_over_trl": ratio, "per_round_ratio": rounds, "padding_free": packed,
        "loss_curves": {name: recs[0]["loss_curve"] for name, recs in runs.items()}, "fixed_batch_loss": loss,
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
