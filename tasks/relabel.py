"""relabel (hindsight relabeling): counterfactual actions at chosen turns of logged trajectories.

Two schemes, as the papers run them:
- hope: per task pick k trajectories; per trajectory t timesteps inside the relabel window of
  its T turns (the environment's, or relabel.window's [a*T, b*T)); per timestep n distinct
  counterfactuals proposed from (prefix, summary). Too early and the policy has not yet
  narrowed anything; too late and the proposer could just name the secret.
- hr: the controller names the top few turns to improve (hr_top) and one of them is chosen at
  random (HR App. B.1), or hr_suggestions distinct ones, each a regeneration of its own (HR's 5x
  aggregation needs several per dialogue).
A counterfactual equal to the original action (the environment's same_action) is dropped and
counted, and so is a site where the oracle proposer finds no action better than the player's
(`no_better_action`). An LLM proposer's or controller's output the environment refuses (in TwentyQuestions,
one that guesses the secret where the answers do not justify that guess) is sampled again, like
any output it cannot use: the action enters the trajectory as the player's move.
"""
from __future__ import annotations

import hashlib
import json
import random
import time
from collections import defaultdict
from pathlib import Path

from envs.base import Counterfactual, fraction_window
from storage.parquet import write_table
from storage.schema import from_table, to_table
from storage.validate import StageInputs
from tasks.params import Params
from tasks.roles import account, call_requests, check_failure_rate, make_generator
from tasks.rollout import derive_seed, turn_start


def run_relabel(params: Params, trajectories: Path, summaries: Path, out_dir: Path) -> dict:
    """Writes out_dir/relabels.parquet and out_dir/metrics.json."""
    t0 = time.time()
    r, env, role = params.relabel, params.env.environment(), params.roles.proposer
    llm = role.backend != "oracle"
    inputs = StageInputs()
    summary_of = {s["trajectory_id"]: s["summary"] for s in inputs.read(summaries, "summaries").to_pylist() if s["status"] == "ok"}
    trajs = [t for t in from_table(inputs.read(trajectories, "trajectories")) if t["split"] in r.splits]
    keys = ("trajectories_relabelled", "skipped_no_summary", "empty_window", "no_place_to_improve", "timesteps", "no_better_action", "proposed", "dropped_equal", "dropped_duplicate")
    counts = defaultdict(int, trajectories_in=len(trajs), **dict.fromkeys(keys, 0))
    by_task: dict[str, list[dict]] = defaultdict(list)
    for t in sorted(trajs, key=lambda t: t["trajectory_id"]):
        # The proposer works from (prefix, summary); a trajectory whose summary failed is
        # skipped and counted. The oracle reads the secret from the environment itself.
        if t["trajectory_id"] not in summary_of:
            counts["skipped_no_summary"] += 1
            continue
        by_task[t["task_id"]].append(t)

    role_name = "controller" if r.mode == "hr" else "proposer"
    version = f"{role.backend}:{env.prompt_hash(role_name)}" if llm else env.oracle_version(role_name)
    prompt_hash = hashlib.sha256(version.encode()).hexdigest()[:12]
    proposer_id = role.backend
    rows: list[dict] = []

    def emit(traj: dict, turn: int | None, rank: int, proposal: Counterfactual | None, status: str = "ok", reason: str | None = None) -> None:
        # turn is None for a dialogue whose controller named no usable place (HR, failed)
        original = traj["turns"][turn]["action"] if turn is not None else None
        if proposal is not None and env.same_action(original, proposal.action):
            counts["dropped_equal"] += 1
            return
        text = proposal.text if proposal else None
        key = json.dumps([traj["trajectory_id"], turn, text if proposal else f"{status}:{rank}", r.mode, version])
        rows.append(
            {
                "relabel_id": hashlib.sha256(key.encode()).hexdigest()[:16],
                "trajectory_id": traj["trajectory_id"],
                "task_id": traj["task_id"],
                "split": traj["split"],
                "mode": r.mode,
                "branch_turn": turn,
                "rank": rank,
                "original_text": traj["messages"][turn_start(traj["messages"], turn)]["content"] if turn is not None else None,
                "original_action": original,
                "counterfactual_text": text,
                "counterfactual_action": proposal.action if proposal else None,
                "player_reason": proposal.reason if proposal else None,
                "rationale": proposal.rationale if proposal else None,
                "status": status,
                "reason": reason,
                "proposer": proposer_id,
                "prompt_hash": prompt_hash,
            }
        )

    sites: list[tuple[dict, int]] = []  # hope: (trajectory, turn)
    dialogues: list[tuple[dict, random.Random]] = []  # hr with an LLM controller: (trajectory, its rng)
    for task_id, group in sorted(by_task.items()):
        rng = random.Random(derive_seed(params.seed, "relabel", r.mode, task_id))
        task = env.task(task_id)
        chosen = rng.sample(group, min(r.k, len(group))) if r.mode == "hope" else group
        for traj in chosen:
            counts["trajectories_relabelled"] += 1
            if r.mode == "hr" and llm:
                dialogues.append((traj, random.Random(rng.getrandbits(32))))
                continue
            if r.mode == "hr":
                places = env.critique(task, traj["turns"], r.hr_top)
                if not places:
                    counts["no_place_to_improve"] += 1
                    continue
                for rank, (turn, proposal) in enumerate(_suggestions(rng, places, r.hr_suggestions)):
                    counts["proposed"] += 1
                    emit(traj, turn, rank, proposal)
                continue
            turns = fraction_window(traj["num_turns"], *r.window) if r.window is not None else env.relabel_turns(traj["num_turns"])
            if not turns:
                counts["empty_window"] += 1
                continue
            for turn in sorted(rng.sample(turns, min(r.t, len(turns)))):
                counts["timesteps"] += 1
                sites.append((traj, turn))

    metrics: dict = {}
    if llm and r.mode == "hr":
        gen = make_generator(role, params.cache.path)
        proposer_id = f"{role.backend}:{gen.model_id}"
        requests = [env.controller_request(env.task(t["task_id"]), t["turns"], r.hr_top) for t, _ in dialogues]
        seeds = [derive_seed(role.seed, "controller", t["trajectory_id"]) for t, _ in dialogues]
        outcomes = call_requests(gen, requests, seeds, role)
        for (traj, rng), outcome in zip(dialogues, outcomes):
            if outcome.status != "ok":
                emit(traj, None, 0, None, outcome.status, outcome.reason)
                continue
            for rank, (turn, proposal) in enumerate(_suggestions(rng, outcome.value, r.hr_suggestions)):  # HR: a named place, at random
                counts["proposed"] += 1
                emit(traj, turn, rank, proposal)
        metrics["calls"] = account(outcomes, gen)
    elif not llm:
        for traj, turn in sites:
            proposals = env.propose(env.task(traj["task_id"]), traj["turns"][:turn], r.n, traj["turns"][turn]["action"])
            counts["proposed"] += len(proposals)
            counts["no_better_action"] += not proposals
            for rank, proposal in enumerate(proposals):
                emit(traj, turn, rank, proposal)
    else:
        gen = make_generator(role, params.cache.path)
        proposer_id = f"{role.backend}:{gen.model_id}"
        # each site's parser knows its task and prefix, to refuse what only hindsight could justify
        requests = [env.proposer_request(env.task(t["task_id"]), t["turns"][:turn], r.n, summary_of[t["trajectory_id"]]) for t, turn in sites]
        seeds = [derive_seed(role.seed, "relabel", t["trajectory_id"], turn) for t, turn in sites]
        outcomes = call_requests(gen, requests, seeds, role)
        for (traj, turn), outcome in zip(sites, outcomes):
            if outcome.status != "ok":
                emit(traj, turn, 0, None, outcome.status, outcome.reason)
                continue
            counts["proposed"] += len(outcome.value)
            seen: set[str] = set()
            for rank, p in enumerate(outcome.value):
                if p.action.lower() in seen:
                    counts["dropped_duplicate"] += 1  # the n proposals must be distinct
                    continue
                seen.add(p.action.lower())
                emit(traj, turn, rank, p)
        metrics["calls"] = account(outcomes, gen)

    rows.sort(key=lambda row: (row["trajectory_id"], row["branch_turn"] if row["branch_turn"] is not None else -1, row["rank"]))
    write_table(to_table(rows, "relabels"), out_dir / "relabels.parquet", "relabels")
    ok = sum(row["status"] == "ok" for row in rows)
    metrics = {"inputs": inputs.write(out_dir), "mode": r.mode, "relabels": ok, "not_proposed": len(rows) - ok, **dict(sorted(counts.items())), **metrics, "seconds": round(time.time() - t0, 1)}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    if "calls" in metrics:
        check_failure_rate("relabel", "proposer", role, metrics["calls"])
    return metrics



def _suggestions(rng: random.Random, places: list, n: int) -> list:
    """n distinct places of those the controller named, at random (fewer if it named fewer). One
    is drawn by choice, as HR's single suggestion always was, so its picks stay the same."""
    return [rng.choice(places)] if n == 1 else rng.sample(places, min(n, len(places)))
