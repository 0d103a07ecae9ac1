"""The response cache on a rerun: an LLM stage run twice, the second time served from the cache.

    python bench/llm_cache.py [--trajectories data/collect/trajectories.parquet] [--limit 200]
                              [--role summarizer|labeler] [--set roles.summarizer.model=...]

Runs the stage with its role on an LLM backend (default: the bootstrap model on hf) into a fresh
cache, then again with the same cache, and prints both wall times, the second run's hit rate,
the backend calls each made, and the time the cache saved.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.hindsight_repro import override  # noqa: E402
from tasks.params import Params  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=Path, default=ROOT / "data/collect/trajectories.parquet")
    ap.add_argument("--limit", type=int, default=200, help="first N trajectories")
    ap.add_argument("--role", choices=["summarizer", "labeler"], default="summarizer")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a params override, key.path=value")
    args = ap.parse_args()

    from tasks.label import run_label
    from tasks.summarize import run_summarize

    work = Path(tempfile.mkdtemp(prefix="llm-cache-bench-"))
    trajs = work / "trajectories.parquet"
    pq.write_table(pq.read_table(args.trajectories).slice(0, args.limit), trajs)
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    override(raw, f"roles.{args.role}={{backend: hf, model: {ROOT / 'data/bootstrap/model'}, sampling: {{max_new_tokens: 48}}, max_failure_rate: 1.0}}")
    override(raw, f"cache.path={work / 'cache.sqlite'}")
    for s in args.sets:
        override(raw, s)
    params = Params.model_validate(raw)
    stage = (lambda out: run_summarize(params, trajs, out)) if args.role == "summarizer" else (lambda out: run_label(params, [trajs], out))

    runs = []
    for name in ("first", "rerun"):
        t0 = time.perf_counter()
        metrics = stage(work / name)
        runs.append((name, time.perf_counter() - t0, metrics["calls"]))
    (_, t_first, c_first), (_, t_again, c_again) = runs
    hits, misses = c_again["cache"]["hits"], c_again["cache"]["misses"]
    backend = getattr(params.roles, args.role).backend
    table = "summaries.parquet" if args.role == "summarizer" else "labels.parquet"
    same = pq.read_table(work / "first" / table).equals(pq.read_table(work / "rerun" / table))
    print(f"\n{args.role} on {backend}, {c_first['requests']} requests ({args.limit} trajectories)")
    print(f"{'run':<8}{'seconds':>10}{'backend calls':>16}{'cache hits':>12}")
    for name, t, c in runs:
        print(f"{name:<8}{t:>10.2f}{c['cache']['misses']:>16}{c['cache']['hits']:>12}")
    print(f"rerun hit rate {hits / max(1, hits + misses):.1%}; time saved {t_first - t_again:.2f} s "
          f"({t_first / max(t_again, 1e-9):.0f}x faster); outputs identical: {same}")

if __name__ == "__main__":
    main()
