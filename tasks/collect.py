"""collect ("logging trajectories"): roll the policy out, m trajectories per task.

Every live episode is generated in one batch per step. Each trajectory has its own seed, and
rows are written in a fixed order, so a rerun with the same seed writes identical bytes.

For scale, the episodes split into `collect.scale.shards` contiguous shards (`shard_episodes`),
each played by `collect_shard` with a generator of its own: a shard's rows depend only on the
shard, never on the process or machine that ran it, so the merged table is the same whether the
shards ran one after another here or on a Dask cluster (flows/collect.py). A different shard
count batches the episodes differently, and the hf backend's float arithmetic varies with the
batch, so it may write other (equally valid) rows; one shard is the unsharded run.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from models.base import SamplingParams
from models.cache import ResponseCache
from storage.parquet import write_table
from storage.schema import to_table
from tasks.params import Params
from tasks.roles import (
    Outcome,
    check_failure_rate,
    generation_stats,
    policy_generator,
    sum_stats,
)
from tasks.rollout import (
    Episode,
    LMAgent,
    derive_seed,
    episode_stats,
    new_episode,
    play,
    stats_by_split,
)
from tasks.simulator import make_simulator, merged_simulator_stats

ShardMap = Callable[[Callable[..., "ShardResult"], list[tuple]], list["ShardResult"]]


@dataclass
class ShardResult:
    """What one shard hands back to be merged: its finished episodes and its calls' accounting."""

    episodes: list[Episode]
    policy_id: str
    generation: dict  # the policy's generation_stats
    simulator_outcomes: list[Outcome] | None  # None: the environment's oracle answered
    simulator_generation: dict


def shard_episodes(params: Params, shards: int) -> list[list[tuple[str, int, int]]]:
    """(split, task's index in its split, k) of every episode, in the table's order, cut into
    `shards` contiguous pieces of near-equal size: the same pieces on every run, whoever plays them."""
    c, env = params.collect, params.env.environment()
    specs = [(split, i, k) for split in c.splits for i in range(len(env.tasks(split)[: c.limit_tasks])) for k in range(c.m)]
    return [specs[i * len(specs) // shards : (i + 1) * len(specs) // shards] for i in range(shards)]


def collect_shard(params: Params, model_dir: Path, index: int, shards: int) -> ShardResult:
    """Plays shard `index` of `shards` with a generator and simulator of its own."""
    c, env = params.collect, params.env.environment()
    generator = policy_generator(params, model_dir, c.batch_size)
    agent = LMAgent(generator, SamplingParams(**c.sampling.model_dump()))
    episodes = []
    for split, i, k in shard_episodes(params, shards)[index]:
        task = env.tasks(split)[i]
        episodes.append(ep := new_episode(env, task, derive_seed(params.seed, "collect", split, task.id, k)))
        if c.temperatures is not None:
            ep.sampling = logging_sampling(params, k)
    simulator = make_simulator(params)
    play(episodes, agent, derive_seed(params.seed, "collect"), "collect", simulator)
    return ShardResult(
        episodes, generator.model_id, generation_stats(generator),
        None if simulator is None else simulator.outcomes, {} if simulator is None else generation_stats(simulator.gen),
    )


def logging_sampling(params: Params, k: int) -> SamplingParams:
    """Trajectory k's sampling with collect.temperatures: collect's, at temperature number k (cycling)."""
    c = params.collect
    return SamplingParams(**{**c.sampling.model_dump(), "temperature": c.temperatures[k % len(c.temperatures)]})


def _in_order(fn: Callable[..., ShardResult], calls: list[tuple]) -> list[ShardResult]:
    return [fn(*args) for args in calls]


def run_collect(params: Params, model_dir: Path, out_dir: Path, map_shards: ShardMap | None = None) -> dict:
    """Writes out_dir/trajectories.parquet and out_dir/metrics.json. `map_shards(collect_shard,
    calls)` runs the shards and returns their results in order; by default one after another
    in this process (flows/collect.py passes one that fans them out over a Dask cluster)."""
    t0 = time.time()
    shards = params.collect.scale.shards
    if shards > 1:
        ResponseCache(params.cache.path)  # created (schema, WAL mode) once, before the shards open it together
    results = (map_shards or _in_order)(collect_shard, [(params, model_dir, i, shards) for i in range(shards)])
    episodes = [e for r in results for e in r.episodes]
    rows = sorted((e.to_row() for e in episodes), key=lambda r: (r["split"], r["task_id"], r["seed"]))
    write_table(to_table(rows, "trajectories"), out_dir / "trajectories.parquet", "trajectories")
    metrics = {
        "policy_id": results[0].policy_id,
        "trajectories": len(rows),
        "tasks": len({(r["split"], r["task_id"]) for r in rows}),
        **stats_by_split(episodes),
        # the logging temperatures side by side: the spread of rewards each adds to a task's group
        **({"by_temperature": {f"{t:g}": episode_stats([e for e in episodes if e.sampling.temperature == t])
                               for t in params.collect.temperatures}} if params.collect.temperatures else {}),
        **sum_stats([r.generation for r in results]),  # cache hits; prompt tokens the hf backend reused from the previous turn
        "seconds": round(time.time() - t0, 1),
    }
    metrics.update(merged_simulator_stats(results))
    if shards > 1:
        metrics["shards"] = shards
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    if "simulator_calls" in metrics:
        check_failure_rate("collect", "simulator", params.roles.simulator, metrics["simulator_calls"])
    return metrics
