"""summarize: one short summary per trajectory (HOPE's pi_sum), the proposer's hindsight input.

The oracle summarizer sees the secret; LLM summarizers arrive with the LLM roles.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from envs.twenty_questions.kb import load_kb
from envs.twenty_questions.summarizer import VERSION, summarize_game
from storage.parquet import read_table, write_table
from storage.schema import to_table
from tasks.params import Params
from tasks.roles import require_oracle


def run_summarize(params: Params, trajectories: Path, out_dir: Path) -> dict:
    """Reads a trajectories table; writes out_dir/summaries.parquet and out_dir/metrics.json."""
    require_oracle(params, "summarizer")
    t0 = time.time()
    kb = load_kb()
    prompt_hash = hashlib.sha256(VERSION.encode()).hexdigest()[:12]
    rows = []
    for traj in read_table(trajectories, "trajectories").to_pylist():
        history = [(t["action"], t["observation"]) for t in traj["turns"]]
        rows.append(
            {
                "trajectory_id": traj["trajectory_id"],
                "task_id": traj["task_id"],
                "summary": summarize_game(kb, kb.get(traj["task_id"]), history, bool(traj["success"])),
                "role": "summarizer",
                "backend": params.roles.summarizer.backend,
                "prompt_hash": prompt_hash,
            }
        )
    rows.sort(key=lambda r: r["trajectory_id"])
    write_table(to_table(rows, "summaries"), out_dir / "summaries.parquet", "summaries")
    metrics = {"summaries": len(rows), "trajectories": len(rows), "seconds": round(time.time() - t0, 1)}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics
