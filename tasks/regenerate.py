"""regenerate (forward regeneration): splice each counterfactual into its prefix and play on.

The prefix is the logged one, observations included (never asked again); the counterfactual is
executed in the environment (its simulator answers it). Then either the current policy plays
the episode on against the simulator (roles.forward.backend: policy, as HOPE does), or a forward
model writes the rest of the game, both sides (HR): an LLM on a backend, or (backend: learned)
the forward stage's fine-tuned models, the hard model writing a `hard_share` of the
continuations, chosen by a seeded hash of the relabel. Every new trajectory names its parent,
the turn it branched at and the relabel it came from.

A continuation the forward model did not complete is dropped, never silently: dropped.parquet
holds one row per such relabel with its status (unfinished: the environment's parser says the
dialogue stops before it ends, as HR discards them; invalid: unparseable after the role's
attempts; failed: no answer) and reason, so relabels = regenerations + dropped.

The forward model knows the hidden state (it answers for the simulator), but the agent's lines
it writes must not use it: the environment's parser refuses such a continuation (in
TwentyQuestions, a guess of the secret before the answers justify it) and it is sampled again.
"""
from __future__ import annotations

import json
import time
from collections import Counter
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


def share_hash(seed: int, what: str, key: str) -> float:
    """A number in [0, 1) from (seed, what, key): the same on every run and every machine."""
    return derive_seed(seed, what, key) / 0x80000000


def uses_hard_model(seed: int, relabel_id: str, hard_share: float) -> bool:
    """Whether the hard forward model writes this relabel's continuation: a seeded hash below
    hard_share, so the share is reached over many relabels and a relabel's choice never changes."""
    return share_hash(seed, "forward-hard", relabel_id) < hard_share


def forward_models(params: Params, episodes: list[Episode]) -> dict[str, list[Episode]]:
    """Which forward model writes each episode's continuation: "model", or "hard_model" for the
    relabels whose seeded hash falls under roles.forward.hard_share (backend learned)."""
    role = params.roles.forward
    out: dict[str, list[Episode]] = {"model": [], "hard_model": []}
    for ep in episodes:
        hard = role.backend == "learned" and uses_hard_model(role.seed, ep.relabel_id, role.hard_share)
        out["hard_model" if hard else "model"].append(ep)
    return out


def forward_llm(params: Params, episodes: list[Episode], env: Environment) -> tuple[list[Episode], list[dict], dict]:
    """HR's forward model: an LLM (or the forward stage's learned models) writes the rest of each
    spliced game, both sides. Returns the completed episodes, a dropped row for every game it
    did not complete (with its status and reason), and the accounting."""
    role = params.roles.forward
    todo = [ep for ep in episodes if not ep.done]
    dropped, calls, outcomes_all = [], {}, []
    for name, every in forward_models(params, episodes).items():
        group = [ep for ep in every if not ep.done]
        if not every and name == "hard_model":
            continue  # the main model is accounted for even with nothing to write (its cache shows)
        path = getattr(role, name)
        served = role.model_copy(update={"backend": "hf"}) if role.backend == "learned" else role
        gen = make_generator(served, params.cache.path, model=path)
        for ep in every:  # one that ended at the branch too: the model that would have gone on
            ep.policy_id = f"forward:{gen.model_id}"
        requests = [env.forward_request(ep.game) for ep in group]
        seeds = [derive_seed(role.seed, "forward", ep.relabel_id) for ep in group]
        # Every game may have ended at its branch: the model's accounting (its cache) still shows.
        if group:
            print(f"regenerate: the forward {name if role.backend == 'learned' else 'model'} ({path}) writes {len(group)} continuations", flush=True)
        outcomes = call_requests(gen, requests, seeds, role) if group else []
        outcomes_all += outcomes
        calls[name] = account(outcomes, gen)
        for ep, o in zip(group, outcomes):
            if o.status != "ok":
                dropped.append({
                    "relabel_id": ep.relabel_id, "parent_id": ep.parent_id, "task_id": ep.task.id, "branch_turn": ep.branch_turn,
                    "forward_model": name if role.backend == "learned" else str(path), "status": o.status, "reason": o.reason or "", "text": o.text,
                })
                continue
            for text, answer in o.value:
                ep.apply(text, answer)
    done = [ep for ep in episodes if ep.done]
    stats = {**account(outcomes_all), **({"models": calls} if role.backend == "learned" else calls.get("model", {}))}
    metrics = {
        "forward_calls": stats,
        "dropped": dict(sorted(Counter(d["status"] for d in dropped).items())),
        "forward_failures": [{k: d[k] for k in ("relabel_id", "status", "reason")} for d in dropped],
    }
    if role.backend == "learned":
        hard = len(forward_models(params, todo)["hard_model"])  # of the continuations asked for
        metrics["hard_share"] = {"wanted": role.hard_share, "reached": round(hard / len(todo), 4) if todo else None}
    return done, dropped, metrics


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
    dropped: list[dict] = []
    if params.roles.forward.backend == "policy":
        # HOPE: the current policy plays on against the simulator.
        generator = policy_generator(params, model_dir, g.batch_size)
        for ep in episodes:
            ep.policy_id = generator.model_id  # the continuation's policy (the prefix is the parent's)
        play(episodes, LMAgent(generator, SamplingParams(**g.sampling.model_dump())), derive_seed(params.seed, "regenerate"), "regenerate", simulator)
        extra.update(generation_stats(generator))
    else:
        episodes, dropped, extra = forward_llm(params, episodes, env)
    rows = sorted((e.to_row() for e in episodes), key=lambda r: r["trajectory_id"])
    write_table(to_table(rows, "trajectories"), out_dir / "trajectories.parquet", "trajectories")
    write_table(to_table(sorted(dropped, key=lambda d: d["relabel_id"]), "dropped"), out_dir / "dropped.parquet", "dropped")
    used_parents = [parents[r["trajectory_id"]] for r in relabel_rows]
    metrics = {
        "inputs": inputs.write(out_dir),
        "relabels": len(relabel_rows),
        "regenerations": len(rows),
        "dropped_rows": len(dropped),  # relabels = regenerations + dropped_rows
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
