"""How many CPU threads torch may use in a process, and how its threads wait.

`runtime.threads` (default: the cores this process may use, its CPU affinity capped by a cgroup
CPU quota) is applied in every stage process, and split among the processes a stage starts to
work side by side (torchrun ranks, Dask workers), so their threads together never pass the cores.

`runtime.omp_wait_policy` is why 2 threads ran 26x slower than 1 on a busy 2-core machine.
torch's CPU kernels run on GNU OpenMP, which splits each op among its threads and joins them at a
barrier; by default a thread that reaches the barrier first spins there. A small model makes
thousands of such joins per token. When other work shares the cores, the peer that still has to
finish its half is often not running, and the spinning thread holds the very core it waits for
until the scheduler takes it away: every join costs a time slice. Passive waiting (the thread
sleeps at once) gives the core back. libgomp reads the policy when torch loads, so it is set as an
environment variable before torch is imported (`apply_from_file`) and inherited by every child.
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

# Variables that size a thread pool in torch (OpenMP, MKL) and in the libraries beside it.
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def available_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (v2 cpu.max
    or v1 cfs_quota_us), as a container sets it. torch's own default counts the host's cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_quota(cgroup)
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def cgroup_quota(cgroup: Path) -> float | None:
    """CPUs' worth of time the cgroup mounted at `cgroup` allows, or None when unlimited."""
    try:
        limit, period = (cgroup / "cpu.max").read_text().split()[:2]  # v2: "max 100000" or "150000 100000"
        return None if limit == "max" else int(limit) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())  # v1: -1 when unlimited
        period = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def threads_for(threads: int | None, workers: int = 1) -> int:
    """Threads for each of `workers` processes sharing this machine's budget (at least one)."""
    return max(1, (threads or available_cores()) // max(1, workers))


def thread_env(threads: int, wait_policy: str) -> dict[str, str]:
    """The environment variables that give a process `threads` threads waiting by `wait_policy`."""
    return {**{var: str(threads) for var in _THREAD_VARS}, "OMP_WAIT_POLICY": wait_policy.upper()}


def apply(runtime, workers: int = 1) -> int:
    """Apply `runtime` (tasks.params.RuntimeParams) here: the environment for children, and torch's
    thread count if torch is loaded. Returns the threads each worker gets."""
    n = threads_for(runtime.threads, workers)
    os.environ.update(thread_env(n, runtime.omp_wait_policy))  # for torch if not yet loaded, and for children
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(n)
    return n


def apply_from_file(path: str | Path = "params.yaml") -> None:
    """At a process's start, before torch loads (the wait policy only counts then): apply the
    runtime section of `path` if it validates. A bad params.yaml is left for the command to report."""
    from tasks.params import ParamsError, load_params

    try:
        apply(load_params(path).runtime)
    except ParamsError:
        pass
