"""Batched vs one-episode-at-a-time rollouts of the same policy, measured side by side.

    python bench/rollout_batching.py [--model data/bootstrap/model] [--episodes 64]

Plays the same episodes (same tasks, same seeds) twice: once with every live episode in one
generate call per step (what collect does), once episode by episode. Prints wall time,
episodes/s, generated turns/s and the speed-up ratio.
"""
from __future__ import annotations

import argparse
import time

import torch

from envs.twenty_questions.kb import load_kb
from models.base import SamplingParams
from models.hf import HFGenerator
from tasks.rollout import LMAgent, derive_seed, new_episode, play


def run(gen: HFGenerator, tasks, batched: bool, sampling: SamplingParams) -> tuple[float, int]:
    kb = load_kb()
    eps = [new_episode(kb, t, "train", derive_seed("bench", t.name, i), 20, False) for i, t in enumerate(tasks)]
    agent = LMAgent(gen, sampling)
    t0 = time.perf_counter()
    if batched:
        play(eps, agent, 0, "batched")
    else:
        for e in eps:
            play([e], agent, 0, "sequential")
    return time.perf_counter() - t0, sum(len(e.turns) for e in eps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="data/bootstrap/model")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = ap.parse_args()
    kb = load_kb()
    tasks = (kb.split("train") * 10)[: args.episodes]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=32)  # as params.yaml's collect
    gen = HFGenerator(args.model, batch_size=512, dtype=args.dtype)
    tb, nb = run(gen, tasks, True, sampling)
    ts, ns = run(gen, tasks, False, sampling)
    print(f"\n{args.episodes} episodes, model {gen.model_id} ({args.dtype}), {torch.get_num_threads()} threads")
    print(f"{'mode':<12}{'seconds':>10}{'episodes/s':>12}{'turns/s':>10}")
    print(f"{'batched':<12}{tb:>10.1f}{args.episodes / tb:>12.2f}{nb / tb:>10.1f}")
    print(f"{'sequential':<12}{ts:>10.1f}{args.episodes / ts:>12.2f}{ns / ts:>10.1f}")
    print(f"speed-up of batching (turns/s ratio): {(nb / tb) / (ns / ts):.1f}x")


if __name__ == "__main__":
    main()
