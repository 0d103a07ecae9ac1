"""collect ("logging trajectories"): roll the policy out, m trajectories per task.

Every live episode is generated in one batch per step. Each trajectory has its own seed, and
rows are written in a fixed order, so a rerun with the same seed writes identical bytes.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from envs.twenty_questions.kb import load_kb
from models.base import SamplingParams
from storage.parquet import write_table
from storage.schema import to_table
from tasks.params import Params
from tasks.roles import generation_stats, policy_generator
from tasks.simulator import check_simulator, make_simulator, simulator_stats
from tasks.rollout import LMAgent, derive_seed, new_episode, play, stats_by_split


def run_collect(params: Params, model_dir: Path, out_dir: Path) -> dict:
    """Writes out_dir/trajectories.parquet and out_dir/metrics.json."""
    t0 = time.time()
    c, kb = params.collect, load_kb()
    generator = policy_generator(params, model_dir, c.batch_size)
    agent = LMAgent(generator, SamplingParams(**c.sampling.model_dump()))
    episodes = [
        new_episode(kb, task, split, derive_seed(params.seed, "collect", split, task.name, k), params.env.max_turns, params.env.show_candidates)
        for split in c.splits
        for task in kb.split(split)[: c.limit_tasks]
        for k in range(c.m)
    ]
    simulator = make_simulator(params, kb)
    play(episodes, agent, derive_seed(params.seed, "collect"), "collect", simulator)
    rows = sorted((e.to_row() for e in episodes), key=lambda r: (r["split"], r["task_id"], r["seed"]))
    write_table(to_table(rows, "trajectories"), out_dir / "trajectories.parquet", "trajectories")
    metrics = {
        "policy_id": generator.model_id,
        "trajectories": len(rows),
        "tasks": len({(r["split"], r["task_id"]) for r in rows}),
        **stats_by_split(episodes),
        **generation_stats(generator),  # cache hits; prompt tokens the hf backend reused from the previous turn
        **simulator_stats(simulator),
        "seconds": round(time.time() - t0, 1),
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    check_simulator("collect", simulator, metrics)
    return metrics
