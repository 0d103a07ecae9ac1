"""Rollout throughput: collect against its backend's raw generation of the same prompts, and
against playing one episode at a time.

    python bench/rollouts.py [--tasks 20] [--m 3] [--sequential 12] [--repeats 2] [--threads N] [--small]

Rows, all on the same episodes (params.yaml's collect settings, the first --tasks train tasks,
--m trajectories each, collect's seeds):
- collect: `tasks.collect.run_collect` itself, its generator built as collect builds it
  (tasks.roles.policy_generator, response cache in a fresh temp dir so nothing is a hit),
  handed to it already loaded and wrapped to record every batch it sends.
- raw: a fresh generator of the same backend and settings, uncached, replaying exactly those
  batches (same prompts, composition, sampling, seeds) in order: no environment, parsing,
  cache or episode bookkeeping. The hf backend reuses the previous call's keys and values, and
  a replay in order reuses them exactly as collect did, so this row is the limit for collect.
- raw, no reuse: the same replay with hf's prefix reuse off (every prompt encoded in full).
- sequential: `play` on one episode at a time (the first --sequential episodes), same agent.

Generated tokens are counted the same way in every row: the policy tokenizer's count of each
reply text. Collect and raw run --repeats times, alternating, and keep their best wall and CPU
times; CPU time (this process's) is printed beside wall time because it moves far less with
the machine's load. Prints one table and the ratios; writes bench/out/rollouts.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.base import Completion, Generator, Message, SamplingParams
from tasks import collect as collect_module
from tasks.params import Params, load_params
from tasks.roles import make_generator, policy_generator
from tasks.rollout import LMAgent, derive_seed, new_episode, play
from tasks.simulator import make_simulator

GOAL = 0.8  # collect should reach this fraction of raw generation's tokens/s


class Recorder:
    """Passes every call through to `inner` and keeps what was sent and returned. The prompt
    lists are copied (shallowly: the rollout appends to them, it never edits a message)."""

    def __init__(self, inner: Generator):
        self.inner, self.backend, self.model_id = inner, inner.backend, inner.model_id
        self.calls: list[tuple[list[list[Message]], SamplingParams, list[int]]] = []
        self.outputs: list[list[Completion]] = []

    def generate(self, conversations: list[list[Message]], sampling: SamplingParams, seeds: list[int]) -> list[Completion]:
        self.calls.append(([list(c) for c in conversations], sampling, list(seeds)))
        out = self.inner.generate(conversations, sampling, seeds)
        self.outputs.append(out)
        return out

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # collect's metrics read the cache's and backend's stats


def bench_params(tasks: int, m: int, max_turns: int | None, cache_dir: Path, model: Path | None = None) -> Params:
    raw = load_params(ROOT / "params.yaml").model_dump()
    if max_turns:
        raw["env"]["max_turns"] = max_turns
    raw["collect"] |= {"splits": ["train"], "limit_tasks": tasks, "m": m}
    if "scale" in raw["collect"]:
        raw["collect"]["scale"] |= {"shards": 1, "runner": "local"}  # the unsharded run: one generator to record
    raw["cache"] = {"path": str(cache_dir / "responses.sqlite")}
    raw["roles"]["policy"]["model"] = str(model or ROOT / raw["roles"]["policy"]["model"])
    return Params.model_validate(raw)


def clock() -> tuple[float, float]:
    """(wall, CPU) seconds. CPU time is this process's: on a shared machine it moves far less
    with the load than wall time does, so it is the cross-check of a wall-time ratio."""
    return time.perf_counter(), time.process_time()


def since(t0: tuple[float, float]) -> tuple[float, float]:
    t1 = clock()
    return t1[0] - t0[0], t1[1] - t0[1]


def token_count(tokenizer, outputs: list[list[Completion]]) -> int:
    texts = [c.text for batch in outputs for c in batch]
    return sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else 0


def run_collect_recorded(params: Params, out_dir: Path) -> tuple[tuple[float, float], Recorder, dict]:
    """run_collect with its generator swapped for a recorded one, built by collect's own call
    (policy_generator) before the clock starts, so model loading is not timed."""
    model = Path(params.roles.policy.model)
    rec = Recorder(policy_generator(params, model, params.collect.batch_size))
    original = collect_module.policy_generator
    collect_module.policy_generator = lambda *a, **k: rec
    try:
        t0 = clock()
        metrics = collect_module.run_collect(params, model, out_dir)
        seconds = since(t0)
    finally:
        collect_module.policy_generator = original
    return seconds, rec, metrics


def replay(gen: Generator, calls) -> tuple[tuple[float, float], list[list[Completion]]]:
    t0 = clock()
    outputs = [gen.generate(convs, sampling, seeds) for convs, sampling, seeds in calls]
    return since(t0), outputs


def run_sequential(params: Params, episodes: int) -> tuple[tuple[float, float], Recorder, int]:
    """Collect's episodes (its seeds, tasks, order), the first `episodes` of them, played one at
    a time with collect's agent on an uncached generator."""
    c, env = params.collect, params.env.environment()
    rec = Recorder(make_generator(params.roles.policy, None, params.roles.policy.model, c.batch_size))
    agent = LMAgent(rec, SamplingParams(**c.sampling.model_dump()))
    eps = [
        new_episode(env, task, derive_seed(params.seed, "collect", split, task.id, k))
        for split in c.splits
        for task in env.tasks(split)[: c.limit_tasks]
        for k in range(c.m)
    ][:episodes]
    simulator = make_simulator(params)
    t0 = clock()
    for e in eps:
        play([e], agent, derive_seed(params.seed, "collect"), "sequential", simulator)
    return since(t0), rec, len(eps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=20, help="first N train tasks (collect.limit_tasks; 110 is the full collect)")
    ap.add_argument("--m", type=int, default=None, help="trajectories per task (default: params.yaml's collect.m)")
    ap.add_argument("--sequential", type=int, default=12, help="episodes played one at a time (0: skip the row)")
    ap.add_argument("--no-reuse-row", dest="no_reuse", action=argparse.BooleanOptionalAction, default=True, help="also replay with hf's prefix reuse off")
    ap.add_argument("--repeats", type=int, default=2, help="collect and raw runs, alternating; each row keeps its best")
    ap.add_argument("--max-turns", type=int, default=None, help="shorter games (default: params.yaml's env.max_turns)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    ap.add_argument("--small", action="store_true", help="CI size: 2 tasks x 2, 5 turns, 4 games one at a time")
    ap.add_argument("--model", type=Path, default=None, help="the policy (default: params.yaml's, the bootstrap model)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/out/rollouts.json")
    args = ap.parse_args()
    if args.small:
        args.tasks, args.m, args.max_turns, args.sequential = 2, 2, 5, 4
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="rollouts-bench-"))
    params = bench_params(args.tasks, args.m or load_params(ROOT / "params.yaml").collect.m, args.max_turns, work / "cache0", args.model)
    role = params.roles.policy

    # collect and raw alternate, each on a fresh generator (and collect on a fresh cache), and
    # each row keeps its best: on this shared machine one run's wall time was seen to vary by 40%
    # between repeats while its CPU time stayed within 1%.
    collect_times, raw_times, outputs = [], [], []
    for r in range(args.repeats):
        run_params = params.model_copy(update={"cache": params.cache.model_copy(update={"path": str(work / f"cache{r}" / "responses.sqlite")})})
        t, run_rec, metrics = run_collect_recorded(run_params, work / f"collect{r}")
        cache = run_rec.inner.cache_stats
        assert cache["hits"] == 0 and cache["misses"] > 0, cache  # a fresh cache: every request generated
        if r == 0:
            rec = run_rec  # the batches every replay sends
        collect_times.append(t)
        outputs.append(run_rec.outputs)
        t, raw_out = replay(make_generator(role, None, role.model, params.collect.batch_size), rec.calls)
        raw_times.append(t)
        outputs.append(raw_out)
    same = all(o == rec.outputs for o in outputs)
    tokenizer = rec.inner.tokenizer
    episodes, requests, tokens = metrics["trajectories"], sum(len(c[0]) for c in rec.calls), token_count(tokenizer, rec.outputs)
    best = lambda times: (min(w for w, _ in times), min(c for _, c in times))
    rows = [("raw (replayed batches)", best(raw_times), episodes, tokens)]
    if args.no_reuse and role.backend == "hf":
        from models.hf import HFGenerator

        plain = HFGenerator(role.model, batch_size=params.collect.batch_size, dtype=role.dtype, reuse_prefix=False)
        t_plain, plain_out = replay(plain, rec.calls)
        rows.append(("raw, no prefix reuse", t_plain, episodes, token_count(tokenizer, plain_out)))
    rows.append(("collect (run_collect)", best(collect_times), episodes, tokens))
    if args.sequential:
        t_seq, seq_rec, n_seq = run_sequential(params, args.sequential)
        rows.append(("sequential (1 at a time)", t_seq, n_seq, token_count(tokenizer, seq_rec.outputs)))

    rate = {name: tok / wall for name, (wall, _), _, tok in rows}
    cpu_rate = {name: tok / cpu for name, (_, cpu), _, tok in rows}
    collect_vs_raw = rate["collect (run_collect)"] / rate["raw (replayed batches)"]
    collect_vs_raw_cpu = cpu_rate["collect (run_collect)"] / cpu_rate["raw (replayed batches)"]
    print(f"\n{episodes} episodes ({args.tasks} tasks x {params.collect.m}, up to {params.env.environment().max_turns} turns), {requests} requests in {len(rec.calls)} steps, "
          f"policy {rec.model_id} on {role.backend} ({role.dtype}), max_new_tokens {params.collect.sampling.max_new_tokens}, "
          f"{torch.get_num_threads()} threads; collect and raw: best of {args.repeats}")
    print(f"{'row':<26}{'episodes':>9}{'seconds':>10}{'CPU s':>9}{'gen tokens':>12}{'tokens/s':>10}{'episodes/s':>12}{'tokens/CPU s':>14}")
    for name, (wall, cpu), n, tok in rows:
        print(f"{name:<26}{n:>9}{wall:>10.2f}{cpu:>9.2f}{tok:>12}{tok / wall:>10.1f}{n / wall:>12.3f}{tok / cpu:>14.1f}")
    print(f"collect / raw (tokens/s): {collect_vs_raw:.3f} (goal >= {GOAL}: {'met' if collect_vs_raw >= GOAL else 'NOT met'})")
    print(f"collect / raw (tokens per CPU second): {collect_vs_raw_cpu:.3f}")
    if "raw, no prefix reuse" in rate:
        print(f"collect / raw without prefix reuse (tokens/s): {rate['collect (run_collect)'] / rate['raw, no prefix reuse']:.3f}")
    if "sequential (1 at a time)" in rate:
        print(f"collect / sequential (tokens/s): {rate['collect (run_collect)'] / rate['sequential (1 at a time)']:.2f}")
    print(f"collect seconds per repeat: {' '.join(f'{w:.2f}' for w, _ in collect_times)}; raw: {' '.join(f'{w:.2f}' for w, _ in raw_times)}")
    print(f"every collect and raw run gave the same texts: {same}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join(["python", "bench/rollouts.py", *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads()},
        "episodes": episodes, "tasks": args.tasks, "m": params.collect.m, "max_turns": params.env.environment().max_turns, "requests": requests, "steps": len(rec.calls),
        "policy_id": rec.model_id, "backend": role.backend, "dtype": role.dtype,
        "sampling": params.collect.sampling.model_dump(), "batch_size": params.collect.batch_size,
        "rows": [{"row": name, "episodes": n, "seconds": round(wall, 3), "cpu_seconds": round(cpu, 3), "generated_tokens": tok,
                  "tokens_per_s": round(tok / wall, 2), "episodes_per_s": round(n / wall, 4), "tokens_per_cpu_s": round(tok / cpu, 2)}
                 for name, (wall, cpu), n, tok in rows],
        "repeats": args.repeats, "collect_seconds": [[round(w, 3), round(c, 3)] for w, c in collect_times],
        "raw_seconds": [[round(w, 3), round(c, 3)] for w, c in raw_times],
        "collect_over_raw": round(collect_vs_raw, 4), "collect_over_raw_cpu": round(collect_vs_raw_cpu, 4), "goal": GOAL, "texts_identical": same,
    }, indent=2) + "\n")  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
