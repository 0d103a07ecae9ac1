"""label (reward labeling): one reward per original and regenerated trajectory.

The environment's logged return and the labelled reward are separate columns, so an LLM labeler
(a later role backend) can be compared with the ground truth wherever one exists. A trajectory
that cannot be labelled keeps a null reward with status "failed" and the reason.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from envs.twenty_questions.kb import load_kb
from envs.twenty_questions.labeler import label_trajectory
from storage.parquet import read_table, write_table
from storage.schema import to_table
from tasks.params import Params
from tasks.roles import require_oracle


def run_label(params: Params, trajectory_files: list[Path], out_dir: Path) -> dict:
    """Labels every row of every trajectories table given; writes labels.parquet and metrics.json."""
    require_oracle(params, "labeler")
    t0 = time.time()
    kb = load_kb()
    rows, statuses, mismatches, successes = [], Counter(), 0, Counter()
    for path in trajectory_files:
        for t in read_table(path, "trajectories").to_pylist():
            label = label_trajectory(kb, t["task_id"], [turn["action"] for turn in t["turns"]], params.env.max_turns)
            status = "ok" if label.reward is not None else "failed"
            reason = label.reason
            if status == "ok" and t["return"] is not None and t["return"] != label.reward:
                mismatches += 1
                reason += f" (the logged return was {t['return']:g})"
            statuses[status] += 1
            successes[t["source"]] += bool(label.success)
            rows.append(
                {
                    "trajectory_id": t["trajectory_id"],
                    "task_id": t["task_id"],
                    "source": t["source"],
                    "env_reward": t["return"],
                    "env_success": t["success"],
                    "reward": label.reward,
                    "labeler": params.roles.labeler.backend,
                    "status": status,
                    "reason": reason,
                }
            )
    ids = Counter(r["trajectory_id"] for r in rows)
    dup = next((i for i, c in ids.items() if c > 1), None)
    if dup:
        raise ValueError(f"trajectory {dup} appears in more than one input table; labels are keyed by trajectory_id")
    rows.sort(key=lambda r: r["trajectory_id"])
    write_table(to_table(rows, "labels"), out_dir / "labels.parquet", "labels")
    by_source = Counter(r["source"] for r in rows)
    ok = [r for r in rows if r["status"] == "ok"]
    metrics = {
        "labels": len(rows),
        "by_source": dict(sorted(by_source.items())),
        "status": dict(sorted(statuses.items())),
        "logged_return_mismatches": mismatches,
        "mean_reward": {s: _mean([r["reward"] for r in ok if r["source"] == s]) for s in sorted(by_source)},
        "success_rate": {s: round(successes[s] / by_source[s], 4) for s in sorted(by_source)},
        "seconds": round(time.time() - t0, 1),
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None
