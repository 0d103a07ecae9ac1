"""StepDPO (Chen et al. 2024, "ACT"; a baseline of Refit/Swift): DPO at every step of the dialogue,
the action whose trajectory scored higher over the one whose trajectory scored lower.

    loss = - log sigmoid( beta * [ (log pi(a+|s_t) - log ref(a+|s_t)) - (log pi(a-|s_t) - log ref(a-|s_t)) ] )

s_t is a logged trajectory's prefix before its step t (the system prompt, the teacher's turns and
the answerer's earlier ones); a+ and a- are two actions at s_t, the one whose whole trajectory the
judge scored higher chosen. Where the pairs come from (`step_dpo.pairs_from`):

- branches (the paper's: "generate a new trajectory in each step of the original trajectories, and
  then determine winning and losing actions in that step based on the corresponding trajectory
  reward"): from every step t of every logged trajectory (or `sites` of them drawn by seed), the
  base policy (train.base_model: the policy that logged them) samples a new action at s_t and plays
  the dialogue to its end with the same scripted teacher (the environment's game restored at the
  prefix, as regenerate splices); the same judge (roles.labeler, label.label_trajectories) scores
  it. The pair is the logged action against the branch's, by their trajectories' rewards. One
  branch per site: the paper gives no number (gap 8), and one is its "a new trajectory".
- logs (the cheaper variant, no rollout and no judge call): a question's logged trajectories that
  share the prefix s_t and differ at step t, the best of them (star_gate.ranked) against the worst.
  With m = 3 every question gives at most one pair at t = 0, where all runs share the question; later
  steps pair only runs that wrote identical earlier turns.

Either way a tie (equal rewards) gives no pair, nor do two identical action texts (zero gradient);
both are counted. The branches run inside the train stage rather than a stage of their own: they
are this one method's data, drawn from the model train starts from, and DVC has no conditional
stage, so a branch stage would roll branches out in every run, those with no StepDPO arm too (the
default run among them); a run without a step_dpo method rolls none out. A killed run rolls them out
again, its policy's and judge's LLM calls served from the response cache. The loss and masks are
the shared DPO's (dpo.fit: online_dpo's loss, the action-only mask, the frozen base as reference).
"""
from __future__ import annotations

import hashlib
import json

import polars as pl

from models.base import SamplingParams
from storage.schema import from_table
from tasks.rollout import LMAgent, action_starts, derive_seed, episode_from_prefix, play, turn_start
from tasks.train import dpo
from tasks.train.star_gate import ranked


def _pair(prompt: list[dict], hi: dict, lo: dict, step: int, counts: dict) -> dict | None:
    """hi's action at `step` over lo's (each {trajectory_id, reward, messages}) at `prompt`; None
    for a tie or identical texts, counted."""
    chosen, rejected = (t["messages"][turn_start(t["messages"], step)] for t in (hi, lo))
    if hi["reward"] == lo["reward"]:
        counts["tied"] += 1
    elif chosen["content"] == rejected["content"]:
        counts["same_text"] += 1
    else:
        return {"chosen_id": hi["trajectory_id"], "rejected_id": lo["trajectory_id"], "step": step,
                "prompt": prompt, "chosen": chosen, "rejected": rejected}
    return None


def logged_pairs(table: pl.DataFrame) -> tuple[list[dict], dict]:
    """The logs-only pairs: at each step t, the trajectories of a question sharing the prefix before
    t, the best against the worst (module docstring)."""
    out, counts = [], {"sites": 0, "pairs": 0, "tied": 0, "same_text": 0}
    groups: dict[tuple, list[dict]] = {}
    for r in from_table(ranked(table).select("split", "task_id", "trajectory_id", "reward", "messages")):
        groups.setdefault((r["split"], r["task_id"]), []).append(r)
    for key in sorted(groups):
        steps = max(len(action_starts(t["messages"])) for t in groups[key])
        for step in range(steps):
            shared: dict[str, list[dict]] = {}  # best first within each, as the group is
            for t in groups[key]:
                if step < len(action_starts(t["messages"])):
                    prefix = t["messages"][: turn_start(t["messages"], step)]
                    shared.setdefault(json.dumps(prefix, sort_keys=True), []).append(t)
            for same in shared.values():
                if len(same) > 1:
                    counts["sites"] += 1
                    pair = _pair(same[0]["messages"][: turn_start(same[0]["messages"], step)], same[0], same[-1], step, counts)
                    out += [pair] if pair else []
    counts["pairs"] = len(out)
    return out, counts


def branch_pairs(parents: list[dict], branches: list[dict]) -> tuple[list[dict], dict]:
    """The branch pairs: each branch's action at its branch turn against its parent's there, by
    their trajectories' rewards. parents and branches: {trajectory_id, reward, messages}, a branch
    also its parent_id and branch_turn; a branch without a reward (the judge failed) or whose
    parent has none gives no pair, and is counted."""
    by_id = {p["trajectory_id"]: p for p in parents}
    out, counts = [], {"branches": len(branches), "pairs": 0, "tied": 0, "same_text": 0, "unjudged": 0, "parent_not_trained_on": 0}
    for b in branches:
        parent = by_id.get(b["parent_id"])
        if parent is None:  # a method whose rows leave the parent out (limit, data): not its step
            counts["parent_not_trained_on"] += 1
        elif b["reward"] is None or parent["reward"] is None:
            counts["unjudged"] += 1
        else:
            hi, lo = (parent, b) if parent["reward"] > b["reward"] else (b, parent)
            pair = _pair(parent["messages"][: turn_start(parent["messages"], b["branch_turn"])], hi, lo, b["branch_turn"], counts)
            out += [pair] if pair else []
    counts["pairs"] = len(out)
    return out, counts


def sites(parents: list[dict], n: int | None, seed: int) -> list[tuple[dict, int]]:
    """Every (trajectory, step) of `parents`, or `n` drawn by seed, in the parents' order. A site's
    draw depends on its own key alone, so a larger n keeps a smaller one's sites."""
    every = [(p, t) for p in parents for t in range(p["num_turns"])]
    if n is None or n >= len(every):
        return every
    keep = sorted(range(len(every)), key=lambda i: derive_seed(seed, "step-dpo-site", every[i][0]["trajectory_id"], every[i][1]))[:n]
    return [every[i] for i in sorted(keep)]


def roll_branches(params, model_dir, parents: list[dict], cfg) -> tuple[list[dict], dict]:
    """One branch per site of the logged `parents` (collect's rows, each with its labelled
    `reward`): the policy at model_dir plays on from the site's prefix against the environment's
    teacher, and roles.labeler judges it. Returns the branches ({trajectory_id, parent_id,
    branch_turn, reward, messages}) and the rollout's counts."""
    from tasks.label import label_trajectories
    from tasks.roles import generation_stats, policy_generator
    from tasks.simulator import make_simulator

    env, s = params.env.environment(), cfg.step_dpo
    episodes = []
    for parent, t in sites(parents, s.sites, params.seed):
        ep = episode_from_prefix(env, parent, t, derive_seed(params.seed, "step-dpo", parent["trajectory_id"], t))
        # a regeneration's lineage; its relabel_id names the branch (the policy's own resample, not a proposer's)
        ep.source, ep.parent_id, ep.branch_turn = "regeneration", parent["trajectory_id"], t
        ep.relabel_id = hashlib.sha256(f"step-dpo:{parent['trajectory_id']}:{t}".encode()).hexdigest()[:16]
        episodes.append(ep)
    generator = policy_generator(params, model_dir, s.batch_size)
    sampling = s.sampling or params.collect.sampling
    play(episodes, LMAgent(generator, SamplingParams(**sampling.model_dump())), derive_seed(params.seed, "step-dpo"), "step_dpo branches",
         make_simulator(params))
    rows = [ep.to_row() for ep in episodes]
    labels, calls, _, _ = label_trajectories(params, env, rows)
    branches = [{**{k: r[k] for k in ("trajectory_id", "parent_id", "branch_turn", "messages")}, "reward": reward if status == "ok" else None}
                for r, (reward, status, _, _) in zip(rows, labels, strict=True)]
    stats = {"branch_success_rate": round(sum(r["success"] for r in rows) / len(rows), 4) if rows else None, **generation_stats(generator)}
    return branches, {**stats, **({"judge_calls": calls} if calls else {})}


def train(model, tokenizer, table, cfg, seed: int, branches: list[dict] | None = None) -> dict:
    """table: the training rows (the logged trajectories and their labelled rewards); branches:
    roll_branches' (run_train rolls them out once for every step_dpo method with pairs_from:
    branches), None for pairs_from: logs."""
    if cfg.step_dpo.pairs_from == "logs":
        rows, counts = logged_pairs(table)
    else:
        parents = from_table(table.select("trajectory_id", "reward", "messages"))
        rows, counts = branch_pairs(parents, branches)
    return {**dpo.fit(model, tokenizer, rows, cfg, seed), "pairs_from": cfg.step_dpo.pairs_from, **counts}
