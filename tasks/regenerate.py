"""regenerate (forward regeneration): splice each counterfactual into its prefix and play on.

The prefix is the logged one, observations included (never asked again); the counterfactual is
executed in the environment (its simulator answers it). Then either the current policy plays
the episode on against the simulator (roles.forward.backend: policy, as HOPE does), or an LLM
forward model writes the rest of the game, both sides (HR). Every new trajectory names its
parent, the turn it branched at and the relabel it came from.

The forward model knows the hidden state (it answers for the simulator), but the agent's lines
it writes must not use it: the environment's parser refuses such a continuation (in
TwentyQuestions, a guess of the secret before the answers justify it) and it is sampled again.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from envs.base import Environment
from models.base import SamplingParams
from storage.parquet import write_table
from storage.schema import from_table, to_table
from storage.validate import StageInputs, row_json
from tasks.params import Params
from tasks.roles import account, call_requests, check_failure_rate, generation_stats, make_generator, policy_generator
from tasks.rollout import Episode, LMAgent, Simulator, ask, derive_seed, episode_from_prefix, episode_stats, play
from tasks.simulator import check_simulator, make_simulator, simulator_stats


def splice(params: Params, parent: dict, relabel: dict, simulator: Simulator | None = None) -> Episode:
    """The parent's prefix up to the branch turn with the counterfactual executed in its place."""
    return splice_all(params, [(parent, relabel)], simulator)[0]


def splice_all(params: Params, pairs: list[tuple[dict, dict]], simulator: Simulator | None = None) -> list[Episode]:
    """splice for many (parent, relabel) pairs; the simulator answers every counterfactual in one batch."""
    env, episodes = params.env.environment(), []
    for parent, relabel in pairs:
        ep = episode_from_prefix(env, parent, relabel["branch_turn"], derive_seed(params.seed, "regenerate", relabel["relabel_id"]))
        ep.source, ep.parent_id = "regeneration", parent["trajectory_id"]
        ep.branch_turn, ep.relabel_id = relabel["branch_turn"], relabel["relabel_id"]
        episodes.append(ep)
    texts = [relabel["counterfactual_text"] for _, relabel in pairs]
    answers = ask(simulator, episodes, texts)
    for ep, text, answer in zip(episodes, texts, answers, strict=True):
        ep.apply(text, answer)
    return episodes


def forward_llm(params: Params, episodes: list[Episode], env: Environment) -> tuple[list[Episode], dict]:
    """HR's forward model: an LLM writes the rest of each spliced game, both sides. Returns the
    completed episodes and the accounting; a game it could not complete is left out of the
    table and listed with its reason."""
    role = params.roles.forward
    gen = make_generator(role, params.cache.path)
    todo = [ep for ep in episodes if not ep.done]
    requests = [env.forward_request(ep.game) for ep in todo]
    seeds = [derive_seed(role.seed, "forward", ep.relabel_id) for ep in todo]
    outcomes = call_requests(gen, requests, seeds, role)
    failed = []
    for ep, o in zip(todo, outcomes):
        ep.policy_id = f"forward:{gen.model_id}"
        if o.status != "ok":
            failed.append({"relabel_id": ep.relabel_id, "status": o.status, "reason": o.reason})
            continue
        for text, answer in o.value:
            ep.apply(text, answer)
    done = [ep for ep in episodes if ep.done]
    return done, {"forward_calls": account(outcomes, gen), "forward_failures": failed}


def ok_relabels(inputs: StageInputs, relabels: Path, parents: dict[str, dict], where: str) -> list[dict]:
    """The relabels table's rows with a counterfactual (status ok). A relabel whose trajectory is
    not in `parents` (never logged, or quarantined when read) has no prefix to splice into or
    prompt with: quarantined, naming the trajectory and `where` it was looked for."""
    table = inputs.read(relabels, "relabels")
    orphans = [i for i, t in enumerate(table.column("trajectory_id").to_pylist()) if t not in parents]
    file_rows = inputs.file_rows(relabels, table)
    inputs.add(str(relabels), to_table([
        {"source_file": str(relabels), "row": file_rows[i], "field": "trajectory_id", "raw": raw,
         "reason": f"names trajectory {table['trajectory_id'][i]}, which is not in {where} (or was quarantined there)"}
        for i, raw in zip(orphans, row_json(table, orphans))
    ], "quarantine"))
    skip = set(orphans)
    return [r for i, r in enumerate(table.to_pylist()) if r["status"] == "ok" and i not in skip]  # the rest have no counterfactual


def run_regenerate(params: Params, trajectories: Path, relabels: Path, model_dir: Path, out_dir: Path) -> dict:
    """Writes out_dir/trajectories.parquet (source = regeneration) and out_dir/metrics.json."""
    t0 = time.time()
    g, env = params.regenerate, params.env.environment()
    inputs = StageInputs()
    parents = {t["trajectory_id"]: t for t in from_table(inputs.read(trajectories, "trajectories"))}
    relabel_rows = ok_relabels(inputs, relabels, parents, str(trajectories))
    simulator = make_simulator(params)
    episodes = splice_all(params, [(parents[r["trajectory_id"]], r) for r in relabel_rows], simulator)
    ended_at_branch = sum(ep.done for ep in episodes)
    extra: dict = {}
    if params.roles.forward.backend == "policy":
        # HOPE: the current policy plays on against the simulator.
        generator = policy_generator(params, model_dir, g.batch_size)
        for ep in episodes:
            ep.policy_id = generator.model_id  # the continuation's policy (the prefix is the parent's)
        play(episodes, LMAgent(generator, SamplingParams(**g.sampling.model_dump())), derive_seed(params.seed, "regenerate"), "regenerate", simulator)
        extra.update(generation_stats(generator))
    else:
        episodes, extra = forward_llm(params, episodes, env)
    rows = sorted((e.to_row() for e in episodes), key=lambda r: r["trajectory_id"])
    write_table(to_table(rows, "trajectories"), out_dir / "trajectories.parquet", "trajectories")
    used_parents = [parents[r["trajectory_id"]] for r in relabel_rows]
    metrics = {
        "inputs": inputs.write(out_dir),
        "relabels": len(relabel_rows),
        "regenerations": len(rows),
        "ended_at_branch": ended_at_branch,
        "regenerated": episode_stats(episodes),
        "parents": {
            "trajectories": len({p["trajectory_id"] for p in used_parents}),
            "success_rate": sum(bool(p["success"]) for p in used_parents) / max(1, len(used_parents)),
            "mean_return": sum(p["return"] for p in used_parents) / max(1, len(used_parents)),
        },
        **extra,
        **simulator_stats(simulator),
        "seconds": round(time.time() - t0, 1),
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    check_simulator("regenerate", simulator, metrics)
    if "forward_calls" in metrics:
        check_failure_rate("regenerate", "forward", params.roles.forward, metrics["forward_calls"])
    return metrics
