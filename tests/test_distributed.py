"""Beyond one process: the train stage on 2 DeepSpeed ZeRO-3 ranks under torchrun (CPU, gloo),
and collect's shards as Prefect tasks on a 2-worker Dask LocalCluster."""
from __future__ import annotations

import json
import math
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import CONV, ROOT, SHORT, project_env, stop_process, tiny_params
from test_actor import chain  # noqa: F401  (a fixture: scripted games, their summaries and buffer, a critic)

from storage.parquet import write_table
from tasks.params import Params

pytestmark = pytest.mark.system



def _train_params(model: Path, nproc: int, batch_size: int) -> Params:
    raw = tiny_params({"train": {"base_model": str(model), "nproc_per_node": nproc, "batch_size": batch_size, "epochs": 3,
                                 "learning_rate": 3.0e-3, "deepspeed": str(ROOT / "tasks/train/deepspeed_zero3.json"),
                                 # float32 on both sides: on a CPU with bfloat16 (AMX) "auto" turns on
                                 # DeepSpeed's bf16 on the ranks and autocast in the single process,
                                 # two roundings that differ by ~1e-4 after a step.
                                 "bf16": False}})
    raw["train"]["methods"] = {"sft": {"algorithm": "sft"}, "refit": {"algorithm": "refit"}}  # the plain loss and a weighted one
    return Params.model_validate(raw)


@pytest.fixture(scope="module")
def training_table(tmp_path_factory) -> Path:
    def row(i: int) -> dict:
        return {
            "trajectory_id": f"t{i}", "task_id": "Dog", "split": "train", "source": "policy", "parent_id": None, "relabel_id": None,
            "messages": [CONV, SHORT][i % 2], "reward": -1.0 - i, "standardized_reward": 1.0 - i / 8, "weight": 1.0 - i / 32,
            "group_size": 3, "group_mean": -7.0, "group_std": 5.0, "standardize_status": "ok",
        }

    path = tmp_path_factory.mktemp("table") / "train.parquet"
    write_table(pl.DataFrame([row(i) for i in range(16)]).to_arrow(), path, "training")
    return path


def test_zero3_on_two_cpu_ranks_matches_one_process_on_the_same_global_batch(tiny_model_dir, training_table, tmp_path):
    from transformers import AutoModelForCausalLM

    from tasks.train import run_train

    # 2 ranks x 4 rows and 1 process x 8 rows: the same global batches (the length-grouped order
    # is drawn from the same seed, and each rank takes every other batch of 4 of it).
    two = run_train(_train_params(tiny_model_dir, 2, 4), training_table, tmp_path / "two")
    one = run_train(_train_params(tiny_model_dir, 1, 8), training_table, tmp_path / "one")
    assert two["world_size"] == 2 and "world_size" not in one
    for name in ("sft", "refit"):
        # Both ranks held a share of every partitioned parameter: about half of the elements each.
        part = two["methods"][name]["partition"]
        assert len(part["held_by_rank"]) == 2 and all(0.4 * part["elements"] < n < 0.6 * part["elements"] for n in part["held_by_rank"])
        curve2 = json.loads((tmp_path / f"two/loss/{name}.json").read_text())
        curve1 = json.loads((tmp_path / f"one/loss/{name}.json").read_text())
        assert [p["step"] for p in curve2] == [p["step"] for p in curve1] and len(curve2) == 6  # 16 rows / 8, 3 epochs
        assert all(math.isfinite(p["loss"]) for p in curve2) and curve2[-1]["loss"] < curve2[0]["loss"]
        # Same data, same updates; only the order of float32 sums differs (ranks reduce their
        # gradients, and pad their batches, apart). Seen: 1e-7 relative. A rank missing or
        # repeating its batch changes the loss from the second step on by far more than 1e-4.
        for a, b in zip(curve2, curve1):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        # The whole model was gathered from both ranks and saved; it loads and matches.
        model2 = AutoModelForCausalLM.from_pretrained(tmp_path / f"two/models/{name}")
        model1 = AutoModelForCausalLM.from_pretrained(tmp_path / f"one/models/{name}")
        w1 = dict(model1.named_parameters())
        for key, w in model2.named_parameters():
            assert w.shape == w1[key].shape and (w - w1[key]).abs().max().item() < 1e-4
    assert json.loads((tmp_path / "two/metrics.json").read_text())["world_size"] == 2  # rank 0 wrote it


@pytest.mark.parametrize("packed", [False, True])
def test_the_critic_on_two_cpu_ranks_matches_one_process(tiny_model_dir, tmp_path, packed):
    from test_critic import pairs_table

    from storage.schema import to_table
    from tasks.critic import run_critic
    from tasks.train.critic import load_critic

    write_table(to_table(pairs_table(35), "pairs"), tmp_path / "pairs.parquet", "pairs")  # 32 selected: whole global batches of 8

    def params(nproc: int, batch_size: int) -> Params:
        return Params.model_validate(tiny_params({"critic": {
            "base_model": str(tiny_model_dir), "nproc_per_node": nproc, "batch_size": batch_size, "epochs": 2, "heldout_share": 0.0,
            "deepspeed": str(ROOT / "tasks/train/deepspeed_zero3.json"), "bf16": False,  # float32 on both sides, as above
            "padding_free": packed,
        }}))

    two = run_critic(params(2, 4), tmp_path / "pairs.parquet", tmp_path / "two")
    one = run_critic(params(1, 8), tmp_path / "pairs.parquet", tmp_path / "one")
    assert two["world_size"] == 2 and "world_size" not in one
    assert all(0.4 * two["partition"]["elements"] < n < 0.6 * two["partition"]["elements"] for n in two["partition"]["held_by_rank"])
    curve2, curve1 = (json.loads((tmp_path / f"{d}/loss.json").read_text()) for d in ("two", "one"))
    assert [p["step"] for p in curve2] == [p["step"] for p in curve1] and len(curve2) == 8  # 32 pairs / 8, 2 epochs
    for a, b in zip(curve2, curve1):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    assert two["calibration"]["train"]["mae"] == pytest.approx(one["calibration"]["train"]["mae"], abs=1e-4)
    w1 = dict(load_critic(str(tmp_path / "one/model"))[0].named_parameters())
    for key, w in load_critic(str(tmp_path / "two/model"))[0].named_parameters():
        assert (w - w1[key]).abs().max().item() < 1e-4


def test_the_actor_on_two_cpu_ranks_matches_one_process(tiny_model_dir, chain, tmp_path):
    from test_actor import actor_params
    from transformers import AutoModelForCausalLM

    from tasks.actor import run_actor

    def params(nproc: int, batch_size: int) -> Params:
        # 16 states in 2 rounds: 8 pairs a round (if no state ties), each round's one global batch, seen
        # twice. One batch, because the length-grouped sampler groups by the per-rank batch size: with
        # more than one, 2 x 4 and 1 x 8 can cut the round's pairs into other global batches.
        return actor_params(chain, tiny_model_dir, prompts=16, rounds=2, epochs=2, nproc_per_node=nproc, batch_size=batch_size,
                            deepspeed=str(ROOT / "tasks/train/deepspeed_zero3.json"), bf16=False)  # float32 on both sides, as above

    args = (chain / "pairs.parquet", [chain / "collect.parquet", chain / "regenerate.parquet"], chain / "summaries.parquet")
    two = run_actor(params(2, 4), *args, tmp_path / "two")
    one = run_actor(params(1, 8), *args, tmp_path / "one")
    assert two["world_size"] == 2 and "world_size" not in one
    assert [r["pairs"] for r in one["rounds"]] == [8, 8] and two["pairs"] == 16
    assert all(0.4 * two["partition"]["elements"] < n < 0.6 * two["partition"]["elements"] for n in two["partition"]["held_by_rank"])
    # Rank 0 made the same pairs: the first round's from the base, the second's from the actor
    # after the first update, which the ranks made together.
    assert (tmp_path / "two/preferences.parquet").read_bytes() == (tmp_path / "one/preferences.parquet").read_bytes()
    curve2, curve1 = (json.loads((tmp_path / f"{d}/loss.json").read_text()) for d in ("two", "one"))
    assert [(p["round"], p["step"]) for p in curve2] == [(p["round"], p["step"]) for p in curve1] and len(curve2) == 4  # 2 epochs of one batch, 2 rounds
    for a, b in zip(curve2, curve1):
        # the loss, and the implicit-reward margin and accuracy over both ranks' pairs
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["margin"] == pytest.approx(b["margin"], abs=1e-5)
        assert a["accuracy"] == b["accuracy"]
    w1 = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "one/model").named_parameters())
    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    for key, w in AutoModelForCausalLM.from_pretrained(tmp_path / "two/model").named_parameters():
        assert (w - w1[key]).abs().max().item() < 1e-4
    assert any((w1[k] - base[k]).abs().max().item() > 1e-4 for k in base)  # the update moved the actor (4 Adam steps at lr 1e-4)


def _collect_params(model: Path, cache: Path, **scale) -> dict:
    raw = tiny_params({"roles": {"policy": {"model": str(model)}}, "collect": {"scale": scale}})
    raw["cache"]["path"] = str(cache)
    return raw


def test_collect_shards_on_a_dask_cluster_write_the_table_the_local_run_writes(tiny_model_dir, tmp_path):
    from tasks.collect import run_collect

    # The Prefect flow of the stage, in a process of its own (Prefect home and Dask cluster to itself).
    work = tmp_path / "dask"
    work.mkdir()
    shutil.copy(ROOT / "dvc.yaml", work / "dvc.yaml")  # the stage's artifact names its tables from it
    (work / "params.yaml").write_text(yaml.safe_dump(_collect_params(tiny_model_dir, tmp_path / "dask-cache.sqlite", shards=2, runner="dask")))
    (work / "run.py").write_text(
        "import json, sys\nfrom flows.collect import collect_flow\n"
        "if __name__ == '__main__':\n    print('METRICS ' + json.dumps(collect_flow('params.yaml')))\n"
    )
    # The CLI allows Prefect's ephemeral server as long to start (flows/cli.py): the machine may be busy.
    env = {**project_env(tmp_path), "PYTHONPATH": str(ROOT), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    with (work / "out.log").open("w") as out, (work / "err.log").open("w") as err:
        flow_run = subprocess.Popen([sys.executable, "run.py"], cwd=work, env=env, stdout=out, stderr=err)
        try:
            # Meanwhile, the same shards one after another in this process, with a cache of its own.
            local = Params.model_validate(_collect_params(tiny_model_dir, tmp_path / "local-cache.sqlite", shards=2))
            m = run_collect(local, tiny_model_dir, tmp_path / "local")
            one = run_collect(Params.model_validate(tiny_params({"roles": {"policy": {"model": str(tiny_model_dir)}}})), tiny_model_dir, tmp_path / "one")
            flow_run.wait(timeout=300)
        finally:
            stop_process(flow_run)
    stdout = (work / "out.log").read_text()
    assert flow_run.returncode == 0, stdout[-3000:] + (work / "err.log").read_text()[-3000:]
    dask = json.loads(next(line for line in stdout.splitlines() if line.startswith("METRICS "))[8:])
    assert dask["shards"] == 2 and len(dask["shard_workers"]) == 2
    assert len(set(dask["shard_workers"])) == 2  # two worker processes, one shard each

    # The same bytes, whichever ran the shards.
    table = (tmp_path / "local/trajectories.parquet").read_bytes()
    assert (work / "data/collect/trajectories.parquet").read_bytes() == table
    assert m["trajectories"] == dask["trajectories"] == 3 * 2 * 2 and m["cache"]["misses"] == dask["cache"]["misses"] > 0

    # Both workers wrote the one SQLite cache at once; every response they generated landed.
    with sqlite3.connect(tmp_path / "dask-cache.sqlite") as db:
        assert db.execute("SELECT count(*) FROM responses").fetchone()[0] == dask["cache"]["misses"]
    # Played again from that cache: nothing generated, the same table.
    again = run_collect(Params.model_validate(_collect_params(tiny_model_dir, tmp_path / "dask-cache.sqlite", shards=2)), tiny_model_dir, tmp_path / "again")
    assert again["cache"]["misses"] == 0 and (tmp_path / "again/trajectories.parquet").read_bytes() == table

    # One shard is the unsharded run: the same episodes (the rows may differ: batches differ).
    keys = ["split", "task_id", "seed"]
    assert pq.read_table(tmp_path / "one/trajectories.parquet").select(keys) == pq.read_table(tmp_path / "local/trajectories.parquet").select(keys)
    assert "shards" not in one


def test_scale_settings_are_checked(tmp_path):
    from tasks.params import ParamsError, load_params

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert raw["collect"]["scale"]["shards"] == 1 and raw["train"]["nproc_per_node"] == 1  # the default run: one process
    raw["collect"]["scale"] = {"shards": 2, "address": "tcp://127.0.0.1:8786"}  # an address without runner: dask
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ParamsError, match=r"collect\.scale: .*runner: dask only"):
        load_params(tmp_path / "params.yaml")


def test_evaluate_plays_its_policies_in_worker_processes_as_in_one(chain, tiny_model_dir, tmp_path):
    """runtime.processes: each policy (and its best-of-N) in a spawned worker of one thread, its
    own generator and LLM simulator, gives the table one process gives, simulator calls summed."""
    import torch

    from tasks.evaluate import run_evaluate, workers_for

    train = tmp_path / "train"
    for method in tiny_params()["train"]["methods"]:
        (train / "models").mkdir(parents=True, exist_ok=True)
        (train / "models" / method).symlink_to(tiny_model_dir)

    def params(processes: int | None, threads: int) -> Params:
        return Params.model_validate(tiny_params({
            "runtime": {"processes": processes, "threads": threads},
            "train": {"base_model": str(tiny_model_dir)},
            # A simulator the tiny model plays: its answers mostly fail to parse, and are counted.
            "roles": {"policy": {"model": str(tiny_model_dir)},
                      "simulator": {"backend": "hf", "model": str(tiny_model_dir), "max_failure_rate": 1.0}},
            "evaluate": {"actor": str(tiny_model_dir), "stepagent": None, "best_of_n": {"critic": str(chain / "critic"), "n": 2, "policies": ["bootstrap"]}},
        }))

    parallel = params(2, 2)
    assert workers_for(parallel, 4) == 2 and workers_for(params(None, 1), 4) == 1
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' one thread: sampled tokens may differ with the thread count
    try:
        one = run_evaluate(params(1, 1), train, tmp_path / "one")
    finally:
        torch.set_num_threads(before)
    two = run_evaluate(parallel, train, tmp_path / "two")

    assert list(two["policies"]) == list(one["policies"]) == ["bootstrap", *parallel.train.methods, "actor", "bootstrap+best_of_2"]
    assert untimed(two["policies"]) == untimed(one["policies"])  # success, returns, turns, cache and token counts
    assert (tmp_path / "two/episodes.parquet").read_bytes() == (tmp_path / "one/episodes.parquet").read_bytes()
    # The simulator's calls, summed over the workers. Policies on the same weights ask it the same
    # things: in one process the later ones find the answers cached, side by side fewer do.
    calls = ("requests", "ok", "invalid", "failed", "attempts", "failure_rate", "top_reasons")
    assert {k: two["simulator_calls"].get(k) for k in calls} == {k: one["simulator_calls"].get(k) for k in calls}
    assert one["simulator_calls"]["requests"] > 0
    looked_up = [m["simulator_calls"]["cache"]["hits"] + m["simulator_calls"]["cache"]["misses"] for m in (one, two)]
    assert looked_up[0] == looked_up[1] >= one["simulator_calls"]["requests"]


def untimed(d):
    return {k: untimed(v) for k, v in d.items() if not k.endswith("seconds")} if isinstance(d, dict) else d


@pytest.mark.system
def test_a_rank_that_fails_names_its_error_in_the_stages_error(tmp_path):
    """The ranks' stderr interleaves on the console; the stage's one error keeps each rank's cause."""
    from test_grpo import ranks_table, stage_params

    from tasks.train import distributed

    params = stage_params(tmp_path / "no-such-model", {"grpo": {"algorithm": "grpo"}}, nproc_per_node=2, batch_size=2)
    with pytest.raises(RuntimeError) as failed:
        distributed.launch(params, ranks_table(tmp_path / "train.parquet"), tmp_path / "out", None, 2)
    message = str(failed.value)
    assert message.startswith("train: the 2 ranks under torchrun failed (exit code 1)")
    for rank in (0, 1):
        assert f"\n  rank {rank}: OSError: " in message and "no-such-model" in message, message
