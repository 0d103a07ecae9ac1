"""bootstrap and collect through `retrosight run` -> Prefect -> `dvc repro`, in a fresh repo."""
import json
import time

import pyarrow.parquet as pq
import yaml

from conftest import BIN, run, tiny_params


def test_pipeline_runs_through_dvc_and_skips_when_up_to_date(project):
    first = run([str(BIN / "retrosight"), "run"], project)
    for stage in ("bootstrap", "collect", "summarize"):
        assert f"{stage}: ran" in first.stdout, first.stdout

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
    assert set(lock["stages"]) == {"bootstrap", "collect", "summarize"}
    assert pq.read_table(project / "data/summarize/summaries.parquet").num_rows == table.num_rows

    t0 = time.time()
    again = run([str(BIN / "retrosight"), "run"], project)
    assert "up to date" in again.stdout
    assert time.time() - t0 < 30

    # A collect parameter changes: collect reruns, bootstrap is not recomputed.
    before = (model / "model.safetensors").stat().st_mtime_ns
    (project / "params.yaml").write_text(yaml.safe_dump(tiny_params({"collect": {"m": 3}}), sort_keys=False))
    third = run([str(BIN / "retrosight"), "run"], project)
    assert "bootstrap: skipped" in third.stdout and "collect: ran" in third.stdout, third.stdout
    assert (model / "model.safetensors").stat().st_mtime_ns == before
    assert pq.read_table(project / "data/collect/trajectories.parquet").num_rows == 3 * 2 * 3

    # One stage by name, forced: that stage (and what follows it) only.
    fourth = run([str(BIN / "retrosight"), "run", "collect", "--force"], project)
    assert "collect: ran" in fourth.stdout and "summarize: ran" in fourth.stdout
    assert "bootstrap:" not in fourth.stdout


def test_bad_params_stop_the_run_with_the_key_named(project):
    raw = tiny_params()
    raw["collect"]["temprature"] = 0.5
    (project / "params.yaml").write_text(yaml.safe_dump(raw))
    result = run([str(BIN / "retrosight"), "run"], project, check=False)
    assert result.returncode != 0
    assert "collect.temprature: unknown key" in result.stdout + result.stderr
