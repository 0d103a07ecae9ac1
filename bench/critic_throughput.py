"""HOPE's critic trainer on packed batches (critic.padding_free: true) beside padded ones (the default).

    python bench/critic_throughput.py [--pairs 96] [--repeats 2] [--threads 2]

The shipped TwentyQuestions base with a scalar head (tasks.train.critic.load_critic) trains one
epoch of soft BCE on the same pairs, padded and packed, with params.yaml's critic settings (batch,
learning rate, bf16: auto). The pairs are states of 1 to 12 turns and a question, as the buffer's
are, with seeded random targets. Rows are interleaved over --repeats rounds and the median is
reported, as the machine may be shared. Prints seconds a step, padded/packed, the first logged
loss of each (the same to bf16 rounding) and the load.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.params import load_params
from tasks.train import online_dpo
from tasks.train.critic import load_critic, train

BASE = ROOT / "models" / "base" / "twenty_questions" / "model"


def pairs(tokenizer, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        state = [{"role": "system", "content": "You play twenty questions. Ask one yes-no question per turn."}]
        for turn in range(rng.randint(1, 12)):
            state += [{"role": "user", "content": f"Turn {turn + 1} of 20."},
                      {"role": "assistant", "content": f"REASON: Ask about size.\nQUESTION: Is it bigger than a {rng.choice(['cat', 'car', 'house'])}?"}]
        state.append({"role": "user", "content": f"Answer: {rng.choice(['yes', 'no'])}."})
        ids = online_dpo.encode(tokenizer, state, {"role": "assistant", "content": "QUESTION: Is it a fruit?"}, 1024)[0]["input_ids"]
        rows.append({"input_ids": ids, "target": rng.random()})
    return rows


def one(packed: bool, n: int, cfg) -> tuple[float, float]:
    """Seconds a step of one epoch on a fresh copy of the base, and the first logged loss."""
    torch.manual_seed(0)
    model, tokenizer = load_critic(str(BASE), base=True)
    rows = pairs(tokenizer, n, seed=0)
    with tempfile.TemporaryDirectory() as out:
        os.chdir(out)  # the Trainer's scratch output stays out of the repository
        t = time.perf_counter()
        curve = train(model, tokenizer, rows, seed=0, epochs=1, batch_size=cfg.batch_size, learning_rate=cfg.learning_rate,
              warmup_ratio=cfg.warmup_ratio, weight_decay=cfg.weight_decay, bf16=cfg.bf16, padding_free=packed)
        seconds = time.perf_counter() - t
        os.chdir(ROOT)
    return seconds / -(-n // cfg.batch_size), next(c["loss"] for c in curve if "loss" in c)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_params(ROOT / "params.yaml").critic
    times: dict[str, list[float]] = {"padded": [], "packed": []}
    first_loss: dict[str, float] = {}
    for r in range(args.repeats):
        for name in times:
            seconds, first_loss[name] = one(name == "packed", args.pairs, cfg)
            times[name].append(seconds)
            print(f"round {r + 1}/{args.repeats} {name}: {seconds:.3f} s a step", flush=True)
    padded, packed = (statistics.median(times[k]) for k in ("padded", "packed"))
    print(f"critic, {args.pairs} pairs, batch {cfg.batch_size}, bf16 {cfg.bf16}, {args.threads} threads, load {os.getloadavg()[0]:.1f}")
    print(f"{'':8} {'s a step':>9} {'padded/this':>12} {'first loss':>11}")
    print(f"{'padded':8} {padded:9.3f} {1.0:12.2f} {first_loss['padded']:11.4f}")
    print(f"{'packed':8} {packed:9.3f} {padded / packed:12.2f} {first_loss['packed']:11.4f}")


if __name__ == "__main__":
    main()
