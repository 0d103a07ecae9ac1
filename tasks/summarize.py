"""summarize: one short summary per trajectory (HOPE's pi_sum), the proposer's hindsight input.

The oracle summarizer writes it from the environment's hidden state; an LLM summarizer is shown
the game and the hidden state by the environment's summary prompt. A summary the LLM could not
give keeps its row with a null summary, the status and the reason; relabel skips it.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from storage.parquet import write_table
from storage.schema import from_table, to_table
from storage.validate import StageInputs
from tasks.params import Params
from tasks.roles import account, call_requests, check_failure_rate, make_generator
from tasks.rollout import derive_seed


def run_summarize(params: Params, trajectories: Path, out_dir: Path) -> dict:
    """Reads a trajectories table; writes out_dir/summaries.parquet and out_dir/metrics.json."""
    t0 = time.time()
    env, role = params.env.environment(), params.roles.summarizer
    inputs = StageInputs()
    trajs = from_table(inputs.read(trajectories, "trajectories"))
    metrics: dict = {}
    if role.backend == "oracle":
        version = env.oracle_version("summarizer")
        model, prompt_hash = version, hashlib.sha256(version.encode()).hexdigest()[:12]
        results = [(env.summarize(env.task(t["task_id"]), t["turns"], bool(t["success"])), "ok", None) for t in trajs]
    else:
        gen = make_generator(role, params.cache.path)
        model, prompt_hash = gen.model_id, env.prompt_hash("summarizer")
        requests = [env.summary_request(env.task(t["task_id"]), t["turns"], bool(t["success"])) for t in trajs]
        seeds = [derive_seed(role.seed, "summarize", t["trajectory_id"]) for t in trajs]
        outcomes = call_requests(gen, requests, seeds, role)
        results = [(o.value, o.status, o.reason) for o in outcomes]
        metrics["calls"] = account(outcomes, gen)
    rows = [
        {
            "trajectory_id": t["trajectory_id"],
            "task_id": t["task_id"],
            "summary": summary,
            "status": status,
            "reason": reason,
            "role": "summarizer",
            "backend": role.backend,
            "model": model,
            "prompt_hash": prompt_hash,
        }
        for t, (summary, status, reason) in zip(trajs, results)
    ]
    rows.sort(key=lambda r: r["trajectory_id"])
    write_table(to_table(rows, "summaries"), out_dir / "summaries.parquet", "summaries")
    ok = sum(r["status"] == "ok" for r in rows)
    metrics = {"inputs": inputs.write(out_dir), "trajectories": len(rows), "summaries": ok, "not_summarized": len(rows) - ok, **metrics, "seconds": round(time.time() - t0, 1)}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    if "calls" in metrics:
        check_failure_rate("summarize", "summarizer", role, metrics["calls"])
    return metrics
