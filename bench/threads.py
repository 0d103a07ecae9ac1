"""torch threads on a shared machine: collect's rollouts at runtime's default against 1 thread
and against the oversubscribed case, side by side.

    python bench/threads.py [--tasks 10] [--m 2] [--loads 0 1] [--small] [--model DIR]

Every row plays the same episodes (collect's seeds, the first --tasks train tasks, --m each),
cut into collect's two shards, each row in fresh processes so the OpenMP settings of its
environment are the ones torch loads with:
- default: runtime's default, every core this process may use, passive wait;
- 1 thread;
- torch's stock: every core, libgomp's own wait (spin, then sleep): the pipeline before
  runtime.threads;
- two processes at once, one shard each, at torch's stock: every process takes every core, as
  two Dask workers or two training ranks did before runtime split the threads;
- two processes at once with runtime's split: each gets its share of the cores.
One-process rows play both shards one after the other. Each row runs under each --loads level:
that many busy loops share the machine (0: only this bench). Prints one table with the ratios
to the 1-thread row and to the default; writes bench/out/threads.json. Every row must write the
same trajectories as the 1-thread row, or the bench says which differ.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.runtime import available_cores, thread_env  # noqa: E402 (no torch: children load it)

SHARDS = 2


def child(args: argparse.Namespace) -> None:
    """One process of a row: play the given shards, print wall and CPU seconds and a digest."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from rollouts import bench_params

    from tasks import collect as collect_module
    from tasks.roles import policy_generator

    with tempfile.TemporaryDirectory(prefix="retrosight-threads-") as tmp:
        params = bench_params(args.tasks, args.m, args.max_turns, Path(tmp), args.model)
        params = params.model_copy(update={"collect": params.collect.model_copy(update={"batch_size": args.batch_size})})
        model = Path(params.roles.policy.model)
        # Built (weights loaded) before the clock starts, then handed to collect's own shard code.
        generator = policy_generator(params, model, args.batch_size)
        collect_module.policy_generator = lambda *a, **k: generator
        t0, c0 = time.perf_counter(), time.process_time()
        played = {i: collect_module.collect_shard(params, model, i, SHARDS).episodes for i in args.shard}
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    digests = {
        str(i): hashlib.sha256("\n".join(json.dumps(e.to_row()["messages"], sort_keys=True) for e in eps).encode()).hexdigest()[:16]
        for i, eps in played.items()
    }
    print(json.dumps({
        "wall": wall, "cpu": cpu, "episodes": sum(map(len, played.values())), "torch_threads": torch.get_num_threads(), "digests": digests,
    }))


def run_row(args: argparse.Namespace, processes: list[tuple[list[int], dict[str, str]]]) -> dict:
    """Start every process of a row at once; the row's time is its slowest process's rollouts
    (interpreter start and model loading are left out)."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_WAIT_POLICY")}
    base["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # keep the children's model loading quiet
    cmd = [sys.executable, __file__, "--child", "--tasks", str(args.tasks), "--m", str(args.m), "--batch-size", str(args.batch_size)]
    cmd += ["--model", str(args.model)] if args.model else []
    cmd += ["--max-turns", str(args.max_turns)] if args.max_turns else []
    procs = [
        subprocess.Popen([*cmd, "--shard", *map(str, shards)], env={**base, **env}, stdout=subprocess.PIPE, text=True)
        for shards, env in processes
    ]
    outs = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"a row's process failed (exit {p.returncode})")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return {
        "wall": max(o["wall"] for o in outs), "cpu": sum(o["cpu"] for o in outs), "episodes": sum(o["episodes"] for o in outs),
        "torch_threads": [o["torch_threads"] for o in outs], "digests": {k: v for o in outs for k, v in o["digests"].items()},
    }


def busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=10, help="first N train tasks")
    ap.add_argument("--m", type=int, default=2, help="episodes per task")
    ap.add_argument("--max-turns", type=int, default=None, help="env.max_turns (default params.yaml's)")
    ap.add_argument("--batch-size", type=int, default=512, help="collect.batch_size")
    ap.add_argument("--loads", type=int, nargs="+", default=[0, 1], help="busy loops beside each row: one column group per value")
    ap.add_argument("--model", type=Path, default=None, help="the policy (default params.yaml's, data/bootstrap/model)")
    ap.add_argument("--small", action="store_true", help="3 tasks, 1 episode each, 6 turns, no extra load: the test suite's size")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "threads.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shard", type=int, nargs="+", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.small:
        args.tasks, args.m, args.max_turns, args.loads = 3, 1, 6, [0]
    if args.child:
        return child(args)

    cores = available_cores()
    half = max(1, cores // 2)
    rows = [
        (f"default: {cores} threads (the cores this process may use), passive wait", [([0, 1], thread_env(cores, "passive"))]),
        ("1 thread", [([0, 1], thread_env(1, "passive"))]),
        (f"torch's stock: {cores} threads, libgomp's own wait", [([0, 1], {"OMP_NUM_THREADS": str(cores)})]),
        (f"oversubscribed: 2 processes x {cores} threads, libgomp's own wait", [([0], {"OMP_NUM_THREADS": str(cores)}), ([1], {"OMP_NUM_THREADS": str(cores)})]),
        (f"2 processes x {half} thread(s) (runtime's split), passive wait", [([0], thread_env(half, "passive")), ([1], thread_env(half, "passive"))]),
    ]
    results: dict[int, list[dict]] = {}
    for load in args.loads:
        loops = busy_loops(load)
        try:
            results[load] = []
            for name, processes in rows:
                r = run_row(args, processes)
                r["loadavg"] = os.getloadavg()[0]
                results[load].append(r)
                print(f"load {load}: {name}: {r['wall']:.2f} s (load average {r['loadavg']:.1f})", file=sys.stderr, flush=True)
        finally:
            for p in loops:
                p.kill()
                p.wait()

    reference = results[args.loads[0]][1]["digests"]
    print(f"\nCollect's rollouts, {results[args.loads[0]][0]['episodes']} episodes ({args.tasks} tasks x {args.m}) in 2 shards, "
          f"model {args.model or 'data/bootstrap/model'}, {cores} cores available; seconds of wall time (x: against 1 thread)")
    head = "| row | " + " | ".join(f"{n} busy loop{'s' * (n != 1)}: s | x 1 thread" for n in args.loads) + " |"
    print(head)
    print("|---|" + "---|---|" * len(args.loads))
    for i, (name, _) in enumerate(rows):
        cells = []
        for load in args.loads:
            r, one = results[load][i], results[load][1]
            cells += [f"{r['wall']:.2f}", f"{r['wall'] / one['wall']:.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("load average at the end of each group: " + ", ".join(f"{n} loops {results[n][-1]['loadavg']:.1f}" for n in args.loads))
    differ = [f"{name} (load {n})" for n in args.loads for (name, _), r in zip(rows, results[n]) if r["digests"] != reference]
    print("every row wrote the same trajectories as 1 thread" if not differ else "rows whose trajectories differ from 1 thread's: " + "; ".join(differ))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "rows": [name for name, _ in rows], "results": {str(k): v for k, v in results.items()}, "cores": cores,
        "episodes": results[args.loads[0]][0]["episodes"], "same_trajectories": not differ,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
    }, indent=2) + "\n")


if __name__ == "__main__":
    main()
