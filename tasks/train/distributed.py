"""What every training stage shares to run on one process or on several ranks: the rank and world
size, the relaunch under torchrun, DeepSpeed's config path, and saving a model that ZeRO-3 may
have partitioned.

With a stage's nproc_per_node > 1, the stage calls `launch`, which starts

    python -m torch.distributed.run --standalone --nproc_per_node N -m tasks.train.launch ...

and waits for it. Every rank runs the stage on the same table; the HF Trainer hands the model
to DeepSpeed (ZeRO-3 by default), which partitions parameters, gradients and optimizer state
across the ranks and gives each rank its share of every global batch; rank 0 alone writes
models, loss curves and metrics. Without CUDA, DeepSpeed runs on its CPU accelerator over gloo,
which is how the tests run it. tasks/train/launch.py is the ranks' entry point; it finds the
stage by name, so this module, which the stages import, imports none of them.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tasks import runtime
from tasks.params import Params


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def launch(
    params: Params, training: Path, out_dir: Path, checkpoint_dir: Path | None, nproc: int, stage: str = "train",
    inputs: dict[str, Path | list[Path]] | None = None,
) -> dict:
    """Runs the train stage (or the critic or actor stage, on the buffer's pairs table, or the
    stepagent stage, on practice's) on `nproc` local ranks under torchrun; returns rank 0's metrics. `inputs`: the stage's other tables, by
    option name (relabels, trajectories, summaries)."""
    with tempfile.TemporaryDirectory(prefix="retrosight-train-") as tmp:
        # The params as validated here (a test's or a flow's), not a file the ranks would read again.
        spec = Path(tmp) / "params.json"
        spec.write_text(params.model_dump_json())
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            # each rank's stderr to the console and to a file, so a failure can name its cause
            "--log-dir", str(Path(tmp) / "logs"), "--tee", "2",
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
            raise RuntimeError(
                f"{stage}: the {nproc} ranks under torchrun failed (exit code {done.returncode}); each rank's error is printed above"
                + "".join(f"\n  rank {r}: {line}" for r, line in _rank_errors(Path(tmp) / "logs"))
            )
    return json.loads((Path(out_dir) / "metrics.json").read_text())


def _rank_errors(log_dir: Path) -> list[tuple[str, str]]:
    """Each rank's last stderr line that is no warning, from torchrun's logs (<log_dir>/<run>/
    attempt_<k>/<rank>/stderr.log): for a rank that raised, the exception its traceback ends in.
    The console has every rank's stderr too, interleaved; this keeps the cause in the error."""
    found = []
    for log in sorted(log_dir.glob("*/attempt_*/*/stderr.log")):
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        lines = [ln for ln in lines if "Warning" not in ln and not ln.startswith("return func(")]
        if lines:
            found.append((log.parent.name, lines[-1][:400]))
    return found


def from_rank0(obj):
    """Rank 0's `obj` on every rank (what rank 0 alone computed: a round's pairs, the reference's
    log-probabilities)."""
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def deepspeed_config(path: str | None) -> str | None:
    """A relative ZeRO config path is read from the working directory, else from this project's
    root, where params.yaml's default (tasks/train/deepspeed_zero3.json) lives."""
    if path is None or Path(path).is_absolute() or Path(path).exists():
        return path
    shipped = Path(__file__).resolve().parents[2] / path
    return str(shipped) if shipped.exists() else path


def _zero3_params(model) -> list:
    """The parameters DeepSpeed ZeRO-3 partitioned (each rank holds a slice of each)."""
    return [p for p in model.parameters() if hasattr(p, "ds_id")]


def partition(model) -> dict | None:
    """How many of the model's parameter elements each rank holds, gathered from every rank;
    None unless ZeRO-3 partitioned the model."""
    zero3 = _zero3_params(model)
    if not zero3 or not torch.distributed.is_initialized():
        return None
    whole = sum(p.numel() for p in model.parameters() if not hasattr(p, "ds_id"))
    per_rank: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(per_rank, sum(p.ds_tensor.numel() for p in zero3) + whole)
    return {"elements": sum(p.ds_numel for p in zero3) + whole, "held_by_rank": per_rank}


def save(model, tokenizer, folder: Path, main: bool = True) -> None:
    """Rank 0 (`main`) writes the whole model: ZeRO-3's slices are gathered first, on every rank
    (a collective, so every rank calls this)."""
    zero3 = _zero3_params(model)
    if zero3:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(zero3, modifier_rank=None)
    with gathered if zero3 else contextlib.nullcontext():
        if main:
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
