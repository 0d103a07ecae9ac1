"""evaluate: roll every policy out on held-out tasks; success, return and turns with standard errors.

Each policy plays the same episodes (same tasks, same per-episode seeds), episodes_per_task
times per task (HOPE: 3 on val and test), so the policies are compared on paired episodes.
Standard errors are over episodes. A row's policy_id is "<policy>:<model id>". Each policy in
best_of_n.policies is also played best-of-n (HOPE 2.7): n actions sampled per turn, the critic's
best one played ("<policy>+best_of_<n>"), and with each of best_of_n.critics
("<policy>+best_of_<n>[<critic>]").
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from models.base import SamplingParams
from storage.parquet import write_table
from storage.schema import to_table
from tasks.params import Params
from tasks.roles import generation_stats, policy_generator
from tasks.simulator import check_simulator, make_simulator, simulator_stats
from tasks.rollout import BestOfNAgent, Episode, LMAgent, derive_seed, new_episode, play
from tasks.train import critic


def mean_se(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return mean, 0.0
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return mean, math.sqrt(var / n)


def summary(episodes: list[Episode]) -> dict:
    out: dict = {"episodes": len(episodes)}
    for key, se_key, values in (
        ("success_rate", "success_se", [float(e.game.success) for e in episodes]),
        ("mean_return", "return_se", [sum(t["reward"] for t in e.turns) for e in episodes]),
        ("mean_turns", "turns_se", [float(len(e.turns)) for e in episodes]),
    ):
        mean, se = mean_se(values)
        out[key], out[se_key] = round(mean, 4), round(se, 4)
    return out


def policies(params: Params, train_dir: Path) -> dict[str, Path]:
    """The base policy, every trained method in params order, and HOPE's actor."""
    return {
        "bootstrap": Path(params.train.base_model),
        **{m: train_dir / "models" / m for m in params.train.methods},
        **({"actor": Path(params.evaluate.actor)} if params.evaluate.actor else {}),
        **{name: Path(path) for name, path in params.evaluate.extra.items()},
    }


def run_evaluate(params: Params, train_dir: Path, out_dir: Path) -> dict:
    """Writes out_dir/metrics.json, out_dir/episodes.parquet and out_dir/plots/success_<split>.json."""
    if params.roles.policy.backend == "openai":
        raise ValueError("evaluate plays the trained checkpoints in data/train/models, which an openai endpoint does not serve: "
                         "set roles.policy.backend to hf or vllm for evaluate")
    t0 = time.time()
    e, env = params.evaluate, params.env.environment()
    results, rows = {}, []
    simulator = make_simulator(params)
    models = policies(params, train_dir)
    sampling = SamplingParams(**e.sampling.model_dump())
    bon = e.best_of_n
    plays = [(name, model_dir, lambda gen: LMAgent(gen, sampling)) for name, model_dir in models.items()]
    if bon.policies:
        best = SamplingParams(**bon.sampling.model_dump())
        for tag, path in {"": bon.critic, **{f"[{k}]": v for k, v in bon.critics.items()}}.items():
            score = critic.scorer(path)
            plays += [(f"{name}+best_of_{bon.n}{tag}", models[name], lambda gen, score=score: BestOfNAgent(gen, best, bon.n, score)) for name in bon.policies]
    for name, model_dir, agent in plays:
        episodes = [
            new_episode(env, task, derive_seed(params.seed, "evaluate", split, task.id, k))
            for split in e.splits
            for task in env.tasks(split)[: e.limit_tasks]
            for k in range(e.episodes_per_task)
        ]
        generator = policy_generator(params, model_dir, e.batch_size)
        play(episodes, agent(generator), derive_seed(params.seed, "evaluate"), f"evaluate {name}", simulator)
        for ep in episodes:
            # Named for the policy evaluated: two policies on the same weights (an actor left
            # untrained is its base) play the same games, and their rows must stay apart.
            ep.policy_id = f"{name}:{generator.model_id}"
        results[name] = {
            "policy_id": episodes[0].policy_id if episodes else generator.model_id,
            **{split: summary([ep for ep in episodes if ep.split == split]) for split in e.splits},
            "heldout": summary(episodes),
            **generation_stats(generator),
        }
        rows += [ep.to_row() for ep in episodes]
    rows.sort(key=lambda r: (r["policy_id"], r["split"], r["task_id"], r["seed"]))
    write_table(to_table(rows, "trajectories"), out_dir / "episodes.parquet", "trajectories")
    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    for split in [*e.splits, "heldout"]:
        points = [{"policy": name, "success_rate": r[split]["success_rate"], "success_se": r[split]["success_se"]} for name, r in results.items()]
        (out_dir / "plots" / f"success_{split}.json").write_text(json.dumps(points, indent=1) + "\n")
    metrics = {
        "splits": e.splits,
        "episodes_per_task": e.episodes_per_task,
        "sampling": e.sampling.model_dump(),
        "best_of_n": {**bon.model_dump(), "sampling": bon.sampling.model_dump()} if bon.policies else None,
        "policies": results,
        **simulator_stats(simulator),
        "seconds": round(time.time() - t0, 1),
    }
    # Policies stay in params order (bootstrap first), so the table reads as configured.
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    check_simulator("evaluate", simulator, metrics)
    return metrics
