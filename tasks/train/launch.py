"""The train stage on several ranks: one process per GPU (or per CPU share), under torchrun.

With train.nproc_per_node > 1, run_train calls `launch`, which starts this module as

    python -m torch.distributed.run --standalone --nproc_per_node N -m tasks.train.launch ...

and waits for it. Every rank runs run_train on the same table; the HF Trainer hands the model
to DeepSpeed (train.deepspeed: ZeRO-3 by default), which partitions parameters, gradients and
optimizer state across the ranks and gives each rank its share of every global batch; rank 0
alone writes models, loss curves and metrics. Without CUDA, DeepSpeed runs on its CPU
accelerator over gloo, which is how the tests run it.

Across nodes, start the module yourself on every node (docs/performance.md has the command):

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m tasks.train.launch --params params.yaml --training data/standardize/train.parquet --out data/train
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tasks import runtime
from tasks.params import Params, load_params


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def launch(
    params: Params, training: Path, out_dir: Path, checkpoint_dir: Path | None, nproc: int, stage: str = "train",
    inputs: dict[str, Path | list[Path]] | None = None,
) -> dict:
    """Runs the train stage (or the critic or actor stage, on the buffer's pairs table) on `nproc`
    local ranks under torchrun; returns rank 0's metrics. `inputs`: the stage's other tables, by
    option name (relabels, trajectories, summaries)."""
    with tempfile.TemporaryDirectory(prefix="retrosight-train-") as tmp:
        # The params as validated here (a test's or a flow's), not a file the ranks would read again.
        spec = Path(tmp) / "params.json"
        spec.write_text(params.model_dump_json())
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "tasks.train.launch", "--stage", stage, "--params", str(spec), "--training", str(training), "--out", str(out_dir),
        ]
        if checkpoint_dir is not None:
            cmd += ["--checkpoint-dir", str(checkpoint_dir)]
        for name, paths in (inputs or {}).items():
            cmd += [f"--{name}", *map(str, paths if isinstance(paths, list) else [paths])]
        # The ranks share this machine's threads: each gets its share, never the whole.
        env = {**os.environ, **runtime.thread_env(runtime.threads_for(params.runtime.threads, nproc), params.runtime.omp_wait_policy)}
        if not torch.cuda.is_available():
            env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator: gloo, no device
        print(f"{stage}: {nproc} ranks under torchrun", flush=True)
        done = subprocess.run(cmd, check=False, env=env)
    if done.returncode:
        raise RuntimeError(f"{stage}: the {nproc} ranks under torchrun failed (exit code {done.returncode}); each rank's error is printed above")
    return json.loads((Path(out_dir) / "metrics.json").read_text())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tasks.train.launch", description="One rank of the train, critic or actor stage (start it with torchrun).")
    ap.add_argument("--stage", choices=["train", "critic", "actor"], default="train")
    ap.add_argument("--params", required=True, help="params.yaml, or the params JSON a launching stage wrote")
    ap.add_argument("--training", required=True, type=Path, help="the training table (data/standardize/train.parquet; the critic: data/buffer/pairs.parquet)")
    ap.add_argument("--out", required=True, type=Path, help="the stage's output folder (data/train)")
    ap.add_argument("--checkpoint-dir", type=Path, default=None)
    ap.add_argument("--relabels", type=Path, default=None, help="train, for leap methods: data/relabel/relabels.parquet")
    ap.add_argument("--trajectories", type=Path, nargs="+", default=None,
                    help="train (leap): the trajectories relabelled (data/collect/trajectories.parquet); actor: collect's and regenerate's")
    ap.add_argument("--summaries", type=Path, default=None, help="actor: data/summarize/summaries.parquet")
    args = ap.parse_args(argv)
    if not torch.distributed.is_torchelastic_launched():
        ap.error("start this module with torchrun (or set train.nproc_per_node and run the train stage)")
    params = Params.model_validate_json(Path(args.params).read_text()) if args.params.endswith(".json") else load_params(args.params)
    # Started by hand across nodes, a rank has only its node's share of the cores.
    runtime.apply(params.runtime, workers=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    from tasks.train import run_train

    try:
        if args.stage == "critic":
            from tasks.critic import run_critic

            run_critic(params, args.training, args.out)
        elif args.stage == "actor":
            from tasks.actor import run_actor

            run_actor(params, args.training, args.trajectories, args.summaries, args.out)
        else:
            run_train(params, args.training, args.out, args.checkpoint_dir, args.relabels, (args.trajectories or [None])[0])
        # Tear the group down together: a rank that left while rank 0 was still saving was seen
        # to abort at exit ("terminate called without an active exception", rank 1, under load).
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
