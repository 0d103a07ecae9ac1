"""Packed batches (padding_free: true) beside padded ones for the trainers whose batches are states
of many lengths: HOPE's critic, and the DPO of HOPE's actor and StepAgent-Implicit (one trainer,
online_dpo.fit).

    python bench/packed_throughput.py [--pairs 96] [--repeats 2] [--threads 2] [--only critic|dpo]

The shipped TwentyQuestions base trains one epoch on the same rows, padded and packed, with
params.yaml's settings (critic: batch, learning rate, bf16: auto; dpo: the actor's, and its
kl_beta). The rows are states of 1 to 12 turns and a question, as the buffer's and practice's
are: the critic's with seeded random targets and a scalar head (tasks.train.critic.load_critic),
DPO's a chosen and a rejected question of different lengths with the frozen base's
log-probabilities. Rows are interleaved over --repeats rounds and the median is reported, as the
machine may be shared. Prints seconds a step, padded/packed, the first logged loss of each (the
same to bf16 rounding) and the load.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.params import load_params
from tasks.train import critic, online_dpo

BASE = ROOT / "models" / "base" / "twenty_questions" / "model"
QUESTIONS = ["QUESTION: Is it a fruit?", "REASON: Only large things are left.\nQUESTION: Is it bigger than a car?"]


def states(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        state = [{"role": "system", "content": "You play twenty questions. Ask one yes-no question per turn."}]
        for turn in range(rng.randint(1, 12)):
            state += [{"role": "user", "content": f"Turn {turn + 1} of 20."},
                      {"role": "assistant", "content": f"REASON: Ask about size.\nQUESTION: Is it bigger than a {rng.choice(['cat', 'car', 'house'])}?"}]
        state.append({"role": "user", "content": f"Answer: {rng.choice(['yes', 'no'])}."})
        out.append(state)
    return out


def action(text: str) -> dict:
    return {"role": "assistant", "content": text}


def critic_step(packed: bool, n: int, params) -> tuple[float, float, int]:
    """Seconds of one epoch of the critic on a fresh copy of the base, its first logged loss, its steps."""
    cfg = params.critic
    torch.manual_seed(0)
    model, tokenizer = critic.load_critic(str(BASE), base=True)
    rng = random.Random(1)
    rows = [{"input_ids": online_dpo.encode(tokenizer, s, action(QUESTIONS[0]), 1024)[0]["input_ids"], "target": rng.random()}
            for s in states(n, seed=0)]
    t = time.perf_counter()
    curve = critic.train(model, tokenizer, rows, seed=0, epochs=1, batch_size=cfg.batch_size, learning_rate=cfg.learning_rate,
                         warmup_ratio=cfg.warmup_ratio, weight_decay=cfg.weight_decay, bf16=cfg.bf16, padding_free=packed)
    return time.perf_counter() - t, next(c["loss"] for c in curve if "loss" in c), -(-n // cfg.batch_size)


def dpo_step(packed: bool, n: int, params) -> tuple[float, float, int]:
    """The same for the actor's DPO (online_dpo.fit, StepAgent-Implicit's trainer too)."""
    cfg = params.actor
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(BASE), dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(str(BASE), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(BASE))
    pairs = [tuple(online_dpo.encode(tokenizer, s, action(q), 1024)[0] for q in QUESTIONS) for s in states(n, seed=0)]
    rows = online_dpo.pair_rows(reference, tokenizer, pairs)
    t = time.perf_counter()
    curve = online_dpo.fit(model, tokenizer, rows, seed=0, beta=cfg.kl_beta, epochs=1, batch_size=cfg.batch_size,
                           learning_rate=cfg.learning_rate, warmup_ratio=cfg.warmup_ratio, weight_decay=cfg.weight_decay,
                           bf16=cfg.bf16, padding_free=packed)
    return time.perf_counter() - t, next(c["loss"] for c in curve if "loss" in c), -(-n // cfg.batch_size)


TRAINERS = {"critic": critic_step, "dpo": dpo_step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=sorted(TRAINERS), help="one trainer's rows alone")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    params = load_params(ROOT / "params.yaml")
    trainers = [args.only] if args.only else list(TRAINERS)
    times = {(t, k): [] for t in trainers for k in ("padded", "packed")}
    first_loss = {}
    with tempfile.TemporaryDirectory() as out:
        os.chdir(out)  # the Trainer's scratch output stays out of the repository
        for r in range(args.repeats):
            for trainer, kind in times:
                seconds, first_loss[trainer, kind], steps = TRAINERS[trainer](kind == "packed", args.pairs, params)
                times[trainer, kind].append(seconds / steps)
                print(f"round {r + 1}/{args.repeats} {trainer} {kind}: {seconds / steps:.3f} s a step", flush=True)
        os.chdir(ROOT)
    print(f"{args.pairs} pairs, {args.threads} threads, load {os.getloadavg()[0]:.1f}")
    print(f"{'trainer':8} {'batches':8} {'s a step':>9} {'padded/this':>12} {'first loss':>11}")
    for trainer in trainers:
        padded = statistics.median(times[trainer, "padded"])
        for kind in ("padded", "packed"):
            this = statistics.median(times[trainer, kind])
            print(f"{trainer:8} {kind:8} {this:9.3f} {padded / this:12.2f} {first_loss[trainer, kind]:11.4f}")


if __name__ == "__main__":
    main()
