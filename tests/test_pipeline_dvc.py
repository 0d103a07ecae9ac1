"""The whole DAG through `retrosight run` -> Prefect -> `dvc repro`, in a fresh repo, tiny preset."""
import json
import time

import pyarrow.parquet as pq
import yaml

from conftest import BIN, run, tiny_params


STAGES = ["bootstrap", "collect", "summarize", "relabel", "regenerate", "label", "standardize", "train", "evaluate"]


def test_pipeline_runs_through_dvc_and_skips_when_up_to_date(project):
    first = run([str(BIN / "retrosight"), "run"], project)
    for stage in STAGES:
        assert f"{stage}: ran" in first.stdout, first.stdout
    assert "Success rate on held-out tasks" in first.stdout and "refit_logged" in first.stdout

    model = project / "data/bootstrap/model"
    assert (model / "config.json").exists() and (model / "model.safetensors").exists()
    table = pq.read_table(project / "data/collect/trajectories.parquet")
    assert table.num_rows == 3 * 2 * 2  # 3 tasks x 2 splits x m=2
    assert set(table.column("split").to_pylist()) == {"train", "val"}
    metrics = json.loads((project / "data/bootstrap/metrics.json").read_text())
    assert {"expert", "noisy", "random", "mixture"} <= set(metrics["scripted"])
    assert set(metrics["model"]["success"]) == {"train"}

    status = run([str(BIN / "dvc"), "status", "--json"], project)
    assert json.loads(status.stdout) == {}
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    assert set(lock["stages"]) == set(STAGES)
    assert pq.read_table(project / "data/summarize/summaries.parquet").num_rows == table.num_rows
    relabels = pq.read_table(project / "data/relabel/relabels.parquet")
    regens = pq.read_table(project / "data/regenerate/trajectories.parquet")
    assert 0 < relabels.num_rows == regens.num_rows
    assert pq.read_table(project / "data/label/labels.parquet").num_rows == table.num_rows + regens.num_rows
    training = pq.read_table(project / "data/standardize/train.parquet")
    assert set(training.column("split").to_pylist()) == {"train"}
    assert training.num_rows == 3 * 2 + regens.num_rows  # train-split originals + regenerations
    evaluation = json.loads((project / "data/evaluate/metrics.json").read_text())
    assert list(evaluation["policies"]) == ["bootstrap", "refit_logged", "refit", "swift", "filtered_bc", "sft"]
    assert evaluation["policies"]["swift"]["heldout"]["episodes"] == 1 * 2 * 2  # 1 task x val/test x 2 episodes

    t0 = time.time()
    again = run([str(BIN / "retrosight"), "run"], project)
    assert "up to date" in again.stdout
    assert time.time() - t0 < 30

    # A relabel parameter changes: relabel and what depends on it rerun; nothing upstream does.
    before = (model / "model.safetensors").stat().st_mtime_ns
    (project / "params.yaml").write_text(yaml.safe_dump(tiny_params({"relabel": {"n": 1}}), sort_keys=False))
    third = run([str(BIN / "retrosight"), "run"], project)
    for stage in STAGES[:3]:
        assert f"{stage}: skipped" in third.stdout, third.stdout
    for stage in STAGES[3:]:
        assert f"{stage}: ran" in third.stdout, third.stdout
    assert (model / "model.safetensors").stat().st_mtime_ns == before

    # One stage by name, forced: that stage and what follows it, nothing upstream.
    fourth = run([str(BIN / "retrosight"), "run", "relabel", "--force"], project)
    for stage in STAGES[3:]:
        assert f"{stage}: ran" in fourth.stdout, fourth.stdout
    for stage in STAGES[:3]:
        assert f"{stage}:" not in fourth.stdout


def test_bad_params_stop_the_run_with_the_key_named(project):
    raw = tiny_params()
    raw["collect"]["temprature"] = 0.5
    (project / "params.yaml").write_text(yaml.safe_dump(raw))
    result = run([str(BIN / "retrosight"), "run"], project, check=False)
    assert result.returncode != 0
    assert "collect.temprature: unknown key" in result.stdout + result.stderr
