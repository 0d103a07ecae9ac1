"""Prefect flow for the collect stage (dvc.yaml: `retrosight stage collect`).

With collect.scale.runner: dask, each of the collect.scale.shards shards is a Prefect task
submitted through prefect-dask's DaskTaskRunner: to a LocalCluster of worker processes on this
machine, or to a running Dask scheduler (collect.scale.address) whose workers run in a checkout
of this project with the same relative paths (the policy model). Each worker opens cache.path
itself: relative, it is on the worker's own disk, as SQLite's locking needs (not a network
filesystem). tasks/collect.py merges the shards into the same table either way.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.common import DATA, publish
from tasks import runtime
from tasks.collect import ShardResult, collect_shard, run_collect
from tasks.params import Params, ScaleParams, load_params


# NO_CACHE: the response cache already memoizes every call; Prefect need not hash the params.
@task(name="collect-shard", cache_policy=NO_CACHE)
def collect_shard_task(params: Params, model_dir: str, index: int, shards: int, workers: int) -> ShardResult:
    # The workers on one machine share its cores: each takes its share of runtime.threads.
    runtime.apply(params.runtime, workers=workers)
    return collect_shard(params, model_dir, index, shards)


def dask_runner(scale: ScaleParams):
    from prefect_dask import DaskTaskRunner

    if scale.address:
        return DaskTaskRunner(address=scale.address)
    # Processes, one thread each: a shard's generator has a worker to itself, as it would on a node.
    workers = scale.workers or scale.shards
    return DaskTaskRunner(cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True, "dashboard_address": ":0"})


@flow(name="collect-shards")
def collect_on_dask(params: Params, model_dir: str, out_dir: Path) -> dict:
    """run_collect with its shards fanned out through this flow's task runner (set by
    run_collect_stage); the returned metrics also name the Dask worker that ran each shard."""
    workers: list[str] = []

    def fan_out(fn, calls: list[tuple]) -> list[ShardResult]:
        # A remote cluster runs one worker per node (docs/performance.md); a LocalCluster shares this machine.
        local = 1 if params.collect.scale.address else (params.collect.scale.workers or params.collect.scale.shards)
        futures = [collect_shard_task.submit(*args, local) for args in calls]
        results = [f.result() for f in futures]
        for i, f in enumerate(futures):
            held = f.wrapped_future.client.who_has(f.wrapped_future)
            workers.append(",".join(next(iter(held.values()), ())))
            print(f"collect: shard {i + 1}/{len(calls)} ran on the Dask worker at {workers[-1]}", flush=True)
        return results

    return {**run_collect(params, model_dir, out_dir, map_shards=fan_out), "shard_workers": workers}


def _api_for_workers():
    """Without PREFECT_API_URL, this process runs Prefect's ephemeral API server on loopback; the
    workers' task runs must report to it, not each start a server of their own (which timed out
    under load), so its address goes into the settings the task runner ships to them. A cluster on
    other machines needs a Prefect server they can reach: set PREFECT_API_URL."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        return contextlib.nullcontext()
    return temporary_settings({PREFECT_API_URL: str(get_client(sync_client=True).api_url)})


def run_collect_stage(params: Params, out_dir: Path) -> dict:
    """The stage as configured: in this process, or its shards on Dask."""
    model_dir = params.roles.policy.model
    if params.collect.scale.runner == "dask":
        with _api_for_workers():
            return collect_on_dask.with_options(task_runner=dask_runner(params.collect.scale))(params, model_dir, out_dir)
    return run_collect(params, model_dir=model_dir, out_dir=out_dir)


@flow(name="collect")
def collect_flow(params_path: str = "params.yaml") -> dict:
    params = load_params(params_path)
    metrics = run_collect_stage(params, DATA / "collect")
    publish("collect", metrics)
    return metrics
