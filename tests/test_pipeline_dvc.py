"""The whole DAG through `retrosight run` -> Prefect -> `dvc repro`, in a fresh repo, tiny preset;
while it runs, a second run in the workspace refuses and a third waits."""
import json
import subprocess
import time

import pyarrow.parquet as pq
import yaml

from conftest import BIN, project_env, run, tiny_params


STAGES = ["bootstrap", "collect", "summarize", "relabel", "regenerate", "label", "standardize", "train", "evaluate"]


def test_pipeline_runs_through_dvc_and_skips_when_up_to_date(project):
    # While it runs, it holds the workspace: a second run refuses, a third waits its turn.
    env = project_env(project.parent)
    first = subprocess.Popen([str(BIN / "retrosight"), "run"], cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    owner = project / ".retrosight" / "run.owner"
    deadline = time.time() + 120
    while not owner.exists():
        assert first.poll() is None and time.time() < deadline, "the first run never took the workspace lock"
        time.sleep(0.2)
    assert f"pid {first.pid}: retrosight run" in owner.read_text()
    refused = run([str(BIN / "retrosight"), "run", "-S", "relabel.n=1"], project, check=False)
    assert refused.returncode != 0
    assert f"another pipeline run holds this workspace (pid {first.pid}: retrosight run" in refused.stdout, refused.stdout
    assert yaml.safe_load((project / "params.yaml").read_text())["relabel"]["n"] == 2  # its override never applied
    waiting = subprocess.Popen([str(BIN / "retrosight"), "run", "--wait"], cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_out, _ = first.communicate(timeout=900)
    waiting_out, _ = waiting.communicate(timeout=300)
    assert first.returncode == 0, first_out[-4000:]
    assert waiting.returncode == 0 and "Waiting for the run that holds this workspace" in waiting_out, waiting_out[-3000:]
    assert "up to date" in waiting_out  # the first run finished everything; the second found nothing stale
    assert not owner.exists()
    for stage in STAGES:
        assert f"{stage}: ran" in first_out, first_out
    assert "Success rate on held-out tasks" in first_out and "refit_logged" in first_out

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
