"""One rank of a training stage under torchrun: the entry point `launch` (tasks/train/distributed.py)
starts on every rank when a stage's nproc_per_node > 1.

Across nodes, start the module yourself on every node (docs/performance.md has the command):

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m tasks.train.launch --params params.yaml --training data/standardize/train.parquet --out data/train

The stages import tasks/train/distributed.py, which starts this module by name; this module names
the stages by dotted path (STAGES) and imports only the one it runs, so no import goes back.
"""
from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path

import torch

from tasks import runtime
from tasks.params import Params, load_params

# stage: (its function as "module:name", its arguments after params from the parsed options)
STAGES = {
    "train": ("tasks.train:run_train", lambda a: (a.training, a.out, a.checkpoint_dir, a.relabels, (a.trajectories or [None])[0], a.expert)),
    "critic": ("tasks.critic:run_critic", lambda a: (a.training, a.out, a.checkpoint_dir)),
    "actor": ("tasks.actor:run_actor", lambda a: (a.training, a.trajectories, a.summaries, a.out)),
    "stepagent": ("tasks.stepagent:run_stepagent", lambda a: (a.training, a.out)),
}


def entry_point(stage: str):
    """The stage's run function, imported now (at run time, on the rank)."""
    module, name = STAGES[stage][0].split(":")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tasks.train.launch", description="One rank of the train, critic, actor or stepagent stage (start it with torchrun).")
    ap.add_argument("--stage", choices=sorted(STAGES), default="train")
    ap.add_argument("--params", required=True, help="params.yaml, or the params JSON a launching stage wrote")
    ap.add_argument("--training", required=True, type=Path, help="the training table (data/standardize/train.parquet; the critic: data/buffer/pairs.parquet; stepagent: data/practice/pairs.parquet)")
    ap.add_argument("--out", required=True, type=Path, help="the stage's output folder (data/train)")
    ap.add_argument("--checkpoint-dir", type=Path, default=None)
    ap.add_argument("--relabels", type=Path, default=None, help="train, for leap methods: data/relabel/relabels.parquet")
    ap.add_argument("--trajectories", type=Path, nargs="+", default=None,
                    help="train (leap, eto): collect's trajectories (data/collect/trajectories.parquet); actor: collect's and regenerate's")
    ap.add_argument("--expert", type=Path, default=None, help="train, for eto methods: data/expert/trajectories.parquet")
    ap.add_argument("--summaries", type=Path, default=None, help="actor: data/summarize/summaries.parquet")
    args = ap.parse_args(argv)
    if not torch.distributed.is_torchelastic_launched():
        ap.error("start this module with torchrun (or set train.nproc_per_node and run the train stage)")
    params = Params.model_validate_json(Path(args.params).read_text()) if args.params.endswith(".json") else load_params(args.params)
    # Started by hand across nodes, a rank has only its node's share of the cores.
    runtime.apply(params.runtime, workers=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    try:
        entry_point(args.stage)(params, *STAGES[args.stage][1](args))
        # Tear the group down together: a rank that left while rank 0 was still saving was seen
        # to abort at exit ("terminate called without an active exception", rank 1, under load).
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
