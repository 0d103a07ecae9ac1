"""evaluate: roll every policy out on held-out tasks; success, return and turns with standard errors.

Each policy plays the same episodes (same tasks, same per-episode seeds), episodes_per_task
times per task (HOPE: 3 on val and test), so the policies are compared on paired episodes.
Standard errors are over episodes. A row's policy_id is "<policy>:<model id>". The policies: the
base, each trained method, HOPE's actor (evaluate.actor) and StepAgent's (evaluate.stepagent), each
played in a worker process of its own where there are cores for it (play_policy). Each policy in
best_of_n.policies is also played best-of-n (HOPE 2.7): n actions sampled per turn, the critic's
best one played ("<policy>+best_of_<n>"), and with each of best_of_n.critics
("<policy>+best_of_<n>[<critic>]").

With a checkpoint directory, a killed run resumes: each policy's finished play is kept there
under a key of all it depends on (the params but runtime and cache, the weights played), so
a rerun plays only the policies not yet played, and never reuses a stale play. The directory is
removed once the stage has succeeded.
"""
from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import pickle
import shutil
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from models.base import SamplingParams
from models.cache import ResponseCache
from models.hf import model_fingerprint
from storage.parquet import write_table
from storage.schema import to_table
from tasks import runtime
from tasks.params import Params
from tasks.roles import Outcome, check_failure_rate, generation_stats, policy_generator
from tasks.simulator import make_simulator, merged_simulator_stats
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
    """The base policy, every trained method in params order, HOPE's actor and StepAgent's policy."""
    return {
        "bootstrap": Path(params.train.base_model),
        **{m: train_dir / "models" / m for m in params.train.methods},
        **({"actor": Path(params.evaluate.actor)} if params.evaluate.actor else {}),
        **({"stepagent": Path(params.evaluate.stepagent)} if params.evaluate.stepagent else {}),
        **{name: Path(path) for name, path in params.evaluate.extra.items()},
    }


@dataclass(frozen=True)
class Play:
    """One policy's play, picklable for a worker process: its name, weights, and best-of-N's critic
    (None: the policy samples its action)."""

    name: str
    model_dir: Path
    critic: str | None = None


@dataclass
class Played:
    """What one play hands back: its episodes, its table row, and its simulator's calls."""

    episodes: list[Episode]
    result: dict
    simulator_outcomes: list[Outcome] | None
    simulator_generation: dict


def play_policy(params: Params, p: Play, threads: int | None = None) -> Played:
    """Plays every evaluation episode with one policy: a generator, and a simulator, of its own,
    so that the plays are alike in this process or in a worker (`threads`: torch's there)."""
    if threads is not None:
        runtime.apply(params.runtime.model_copy(update={"threads": threads}))
    e, env = params.evaluate, params.env.environment()
    episodes = [
        new_episode(env, task, derive_seed(params.seed, "evaluate", split, task.id, k))
        for split in e.splits
        for task in env.tasks(split)[: e.limit_tasks]
        for k in range(e.episodes_per_task)
    ]
    generator = policy_generator(params, p.model_dir, e.batch_size)
    if p.critic is None:
        agent = LMAgent(generator, SamplingParams(**e.sampling.model_dump()))
    else:
        agent = BestOfNAgent(generator, SamplingParams(**e.best_of_n.sampling.model_dump()), e.best_of_n.n, critic.scorer(p.critic))
    simulator = make_simulator(params)
    play(episodes, agent, derive_seed(params.seed, "evaluate"), f"evaluate {p.name}", simulator)
    for ep in episodes:
        # Named for the policy evaluated: two policies on the same weights (an actor left
        # untrained is its base) play the same games, and their rows must stay apart.
        ep.policy_id = f"{p.name}:{generator.model_id}"
    result = {
        "policy_id": episodes[0].policy_id if episodes else generator.model_id,
        **{split: summary([ep for ep in episodes if ep.split == split]) for split in e.splits},
        "heldout": summary(episodes),
        **generation_stats(generator),
    }
    return Played(episodes, result, None if simulator is None else simulator.outcomes,
                  {} if simulator is None else generation_stats(simulator.gen))


def workers_for(params: Params, plays: int) -> int:
    """Processes to play the policies in: runtime.processes, or one per core when the policy runs
    on the hf backend (a small model decoding a few games is latency-bound, so two processes of
    one thread play two policies in about the time two threads play one)."""
    n = params.runtime.processes
    if n is None:
        n = runtime.available_cores() if params.roles.policy.backend == "hf" else 1
    return max(1, min(n, plays, params.runtime.threads or n))


def _play_key(params: Params, p: Play) -> str:
    """What a play's episodes depend on: every param but runtime and cache (how this machine runs
    and where answers are kept, not what it plays), the play, and its policy's and critic's weights."""
    weights = [model_fingerprint(p.model_dir), model_fingerprint(p.critic) if p.critic else None]
    config = [params.model_dump(mode="json", exclude={"runtime", "cache"}), p.name, str(p.model_dir), p.critic, weights]
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def run_evaluate(params: Params, train_dir: Path, out_dir: Path, checkpoint_dir: Path | None = None) -> dict:
    """Writes out_dir/metrics.json, out_dir/episodes.parquet and out_dir/plots/success_<split>.json.
    With checkpoint_dir, resumes a killed run (see the module's docstring)."""
    if params.roles.policy.backend == "openai":
        raise ValueError("evaluate plays the trained checkpoints in data/train/models, which an openai endpoint does not serve: "
                         "set roles.policy.backend to hf or vllm for evaluate")
    t0 = time.time()
    e, bon = params.evaluate, params.evaluate.best_of_n
    models = policies(params, train_dir)
    plays = [Play(name, model_dir) for name, model_dir in models.items()]
    if bon.policies:
        for tag, path in {"": bon.critic, **{f"[{k}]": v for k, v in bon.critics.items()}}.items():
            plays += [Play(f"{name}+best_of_{bon.n}{tag}", models[name], path) for name in bon.policies]
    keys = [_play_key(params, p) for p in plays]
    played: list[Played | None] = [None] * len(plays)
    if checkpoint_dir is not None:
        for i, (p, key) in enumerate(zip(plays, keys)):
            if (saved := checkpoint_dir / f"{key}.pkl").exists():
                played[i] = pickle.loads(saved.read_bytes())
                print(f"evaluate {p.name}: played before the run was interrupted; its episodes are reused", flush=True)

    def keep(i: int, result: Played) -> None:
        played[i] = result
        if checkpoint_dir is not None:  # written whole, then renamed: a kill leaves no half file
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
            tmp = checkpoint_dir / f"{keys[i]}.tmp"
            tmp.write_bytes(pickle.dumps(result))
            tmp.rename(checkpoint_dir / f"{keys[i]}.pkl")

    todo = [i for i, r in enumerate(played) if r is None]
    workers = workers_for(params, len(todo))
    if workers == 1:
        for i in todo:
            keep(i, play_policy(params, plays[i]))
    elif todo:
        if params.cache.path:
            ResponseCache(params.cache.path)  # created (schema, WAL mode) once, before the workers open it together
        threads = runtime.threads_for(params.runtime.threads, workers)
        print(f"evaluate: {len(todo)} policies in {workers} processes of {threads} thread(s)", flush=True)
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            running = {pool.submit(play_policy, params, plays[i], threads): i for i in todo}
            for done in as_completed(running):
                keep(running[done], done.result())
    results = {p.name: r.result for p, r in zip(plays, played, strict=True)}
    rows = [ep.to_row() for r in played for ep in r.episodes]
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
        **merged_simulator_stats(played),
        "seconds": round(time.time() - t0, 1),
    }
    # Policies stay in params order (bootstrap first), so the table reads as configured.
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    if "simulator_calls" in metrics:
        check_failure_rate("evaluate", "simulator", params.roles.simulator, metrics["simulator_calls"])
    if checkpoint_dir is not None:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
    return metrics
