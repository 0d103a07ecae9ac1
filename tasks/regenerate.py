"""regenerate (forward regeneration): splice each counterfactual into its prefix and play on.

The prefix is the logged one, observations included (never asked again); the counterfactual is
executed in the environment, and the current policy completes the episode. Every new trajectory
names its parent, the turn it branched at and the relabel it came from.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from envs.twenty_questions.kb import load_kb
from models.base import SamplingParams
from storage.parquet import read_table, write_table
from storage.schema import to_table
from tasks.params import Params
from tasks.roles import generation_stats, policy_generator, require_oracle
from tasks.rollout import Episode, LMAgent, Simulator, derive_seed, episode_from_prefix, episode_stats, play
from tasks.simulator import check_simulator, make_simulator, simulator_stats


def splice(params: Params, parent: dict, relabel: dict, simulator: Simulator | None = None) -> Episode:
    """The parent's prefix up to the branch turn with the counterfactual executed in its place."""
    return splice_all(params, [(parent, relabel)], simulator)[0]


def splice_all(params: Params, pairs: list[tuple[dict, dict]], simulator: Simulator | None = None) -> list[Episode]:
    """splice for many (parent, relabel) pairs; the simulator answers every counterfactual in one batch."""
    kb, episodes = load_kb(), []
    for parent, relabel in pairs:
        ep = episode_from_prefix(
            kb, parent, relabel["branch_turn"], derive_seed(params.seed, "regenerate", relabel["relabel_id"]),
            params.env.max_turns, params.env.show_candidates,
        )
        ep.source, ep.parent_id = "regeneration", parent["trajectory_id"]
        ep.branch_turn, ep.relabel_id = relabel["branch_turn"], relabel["relabel_id"]
        episodes.append(ep)
    texts = [relabel["counterfactual_text"] for _, relabel in pairs]
    answers = simulator.answer(episodes, [Episode.read(t)[1] for t in texts]) if simulator and episodes else [None] * len(episodes)
    for ep, text, answer in zip(episodes, texts, answers, strict=True):
        ep.apply(text, answer)
    return episodes


def run_regenerate(params: Params, trajectories: Path, relabels: Path, model_dir: Path, out_dir: Path) -> dict:
    """Writes out_dir/trajectories.parquet (source = regeneration) and out_dir/metrics.json."""
    require_oracle(params, "forward")
    t0 = time.time()
    g = params.regenerate
    parents = {t["trajectory_id"]: t for t in read_table(trajectories, "trajectories").to_pylist()}
    relabel_rows = [r for r in read_table(relabels, "relabels").to_pylist() if r["status"] == "ok"]  # the rest have no counterfactual
    missing = [r["relabel_id"] for r in relabel_rows if r["trajectory_id"] not in parents]
    if missing:
        raise ValueError(f"{relabels}: {len(missing)} relabels name a trajectory not in {trajectories} (first: relabel {missing[0]})")
    generator = policy_generator(params, model_dir, g.batch_size)
    simulator = make_simulator(params, load_kb())
    episodes = splice_all(params, [(parents[r["trajectory_id"]], r) for r in relabel_rows], simulator)
    for ep in episodes:
        ep.policy_id = generator.model_id  # the continuation's policy (the prefix is the parent's)
    ended_at_branch = sum(ep.done for ep in episodes)
    play(episodes, LMAgent(generator, SamplingParams(**g.sampling.model_dump())), derive_seed(params.seed, "regenerate"), "regenerate", simulator)
    rows = sorted((e.to_row() for e in episodes), key=lambda r: r["trajectory_id"])
    write_table(to_table(rows, "trajectories"), out_dir / "trajectories.parquet", "trajectories")
    used_parents = [parents[r["trajectory_id"]] for r in relabel_rows]
    metrics = {
        "regenerations": len(rows),
        "ended_at_branch": ended_at_branch,
        "regenerated": episode_stats(episodes),
        "parents": {
            "trajectories": len({p["trajectory_id"] for p in used_parents}),
            "success_rate": sum(bool(p["success"]) for p in used_parents) / max(1, len(used_parents)),
            "mean_return": sum(p["return"] for p in used_parents) / max(1, len(used_parents)),
        },
        **generation_stats(generator),
        **simulator_stats(simulator),
        "seconds": round(time.time() - t0, 1),
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    check_simulator("regenerate", simulator, metrics)
    return metrics
