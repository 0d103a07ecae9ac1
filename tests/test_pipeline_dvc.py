"""The whole DAG through `retrosight run` -> Prefect -> `dvc repro`, in a fresh repo, tiny preset
(the shared finished workspace: conftest.py runs it once per tree); a copy of it reruns nothing,
a run killed mid-stage resumes to the same outputs an uninterrupted run writes, and while a run
works, a second run in the workspace refuses and a third waits."""
import json
import os
import signal
import subprocess
import time

import pyarrow.parquet as pq
import pytest
import yaml

from conftest import BIN, copy_repo, project_env, run, tiny_params

pytestmark = pytest.mark.system


def _wait_until_gone(group: int, timeout: float = 60) -> None:
    """Until no process of the killed group is left. SIGKILL is sent at once, but a killed
    process stays in the process table until it is reaped (the orphaned `dvc repro` by init),
    and until then DVC's lock sees its PID alive and refuses the rerun as busy."""
    deadline = time.time() + timeout
    while True:
        left = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.getpgid(int(pid)) == group:
                    left.append(pid)
            except OSError:  # gone meanwhile
                pass
        if not left:
            return
        assert time.time() < deadline, f"processes {left} of the killed run are still there after {timeout} s"
        time.sleep(0.1)


STAGES = ["bootstrap", "collect", "forward", "summarize", "relabel", "regenerate", "proposer", "label", "standardize", "buffer", "critic", "actor", "train", "evaluate"]
STEPAGENT = ["expert", "practice", "stepagent", "stepagent_select"]  # beside the hindsight chain: a relabel change reruns none of them


def test_pipeline_runs_through_dvc_and_skips_when_up_to_date(finished_workspace, tmp_path, faults):
    # The full run from nothing is the one that made the shared workspace (once per tree, in
    # conftest.py): every stage ran, and the run ended with the evaluation's results.
    first_out = finished_workspace.output
    for stage in STAGES + STEPAGENT:
        assert f"{stage}: ran" in first_out, first_out
    assert "Success rate on held-out tasks" in first_out and "refit_logged" in first_out
    project = copy_repo(finished_workspace.repo, tmp_path)
    env = project_env(project.parent)

    model = project / "data/bootstrap/model"
    assert (model / "config.json").exists() and (model / "model.safetensors").exists()
    table = pq.read_table(project / "data/collect/trajectories.parquet")
    assert table.num_rows == 3 * 2 * 2  # 3 tasks x 2 splits x m=2
    assert set(table.column("split").to_pylist()) == {"train", "val"}
    metrics = json.loads((project / "data/bootstrap/metrics.json").read_text())
    assert {"expert", "noisy", "random", "mixture"} <= set(metrics["scripted"])
    assert set(metrics["model"]["success"]) == {"train"}

    status = run([str(BIN / "dvc"), "status", "--json"], project)  # the copy is whole: DVC finds nothing stale
    assert json.loads(status.stdout) == {}
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    assert set(lock["stages"]) == set(STAGES + STEPAGENT)
    # The default regenerate (roles.forward.backend: policy) serves no forward model: none is trained.
    assert json.loads((project / "data/forward/metrics.json").read_text())["trained"] is False
    assert [f.name for f in (project / "data/forward/models").iterdir()] == ["NOT_TRAINED.txt"]
    assert pq.read_table(project / "data/summarize/summaries.parquet").num_rows == table.num_rows
    relabels = pq.read_table(project / "data/relabel/relabels.parquet")
    regens = pq.read_table(project / "data/regenerate/trajectories.parquet")
    assert 0 < relabels.num_rows == regens.num_rows
    assert pq.read_table(project / "data/label/labels.parquet").num_rows == table.num_rows + regens.num_rows
    training = pq.read_table(project / "data/standardize/train.parquet")
    assert set(training.column("split").to_pylist()) == {"train"}
    assert training.num_rows == 3 * 2 + regens.num_rows  # train-split originals + regenerations
    pairs = pq.read_table(project / "data/buffer/pairs.parquet")
    behind = {i for ids in pairs.column("trajectory_ids").to_pylist() for i in ids}
    train = {r["trajectory_id"] for t in (table, regens) for r in t.to_pylist() if r["split"] == "train"}
    assert behind == train and True in pairs.column("selected").to_pylist()
    judged = json.loads((project / "data/critic/metrics.json").read_text())
    assert judged["pairs_selected"] == pairs.column("selected").to_pylist().count(True)
    assert (project / "data/critic/model/config.json").exists()
    evaluation = json.loads((project / "data/evaluate/metrics.json").read_text())
    assert list(evaluation["policies"]) == ["bootstrap", "refit_logged", "refit", "swift", "filtered_bc", "sft", "actor", "stepagent", "bootstrap+best_of_4"]
    practice = json.loads((project / "data/practice/metrics.json").read_text())
    assert practice["samples"] == pq.read_table(project / "data/practice/pairs.parquet").num_rows == 8 * 2  # 8 prefixes x k = 2
    stepagent = json.loads((project / "data/stepagent/metrics.json").read_text())
    assert stepagent["rows"] == practice["samples"] and stepagent["equal_dropped"] == practice["equal"] and stepagent["reference_practised"]
    actor = json.loads((project / "data/actor/metrics.json").read_text())
    assert actor["states"] > 0 and (project / "data/actor/preferences.parquet").exists()
    assert json.loads((project / "data/proposer/metrics.json").read_text())["counterfactuals"] == relabels.num_rows
    assert evaluation["policies"]["bootstrap+best_of_4"]["policy_id"].startswith("bootstrap+best_of_4:model@")  # "<policy>:<model id>"
    assert evaluation["policies"]["swift"]["heldout"]["episodes"] == 1 * 2 * 2  # 1 task x val/test x 2 episodes

    t0 = time.time()
    again = run([str(BIN / "retrosight"), "run"], project)
    assert "up to date" in again.stdout
    assert time.time() - t0 < 30

    # A relabel parameter changes: relabel and what depends on it rerun; nothing upstream does.
    # The run is killed (SIGKILL to its whole process tree: CLI, Prefect, DVC, the stage) while
    # regenerate works, and run again.
    before = (model / "model.safetensors").stat().st_mtime_ns
    (project / "params.yaml").write_text(yaml.safe_dump(tiny_params({"relabel": {"n": 1}}), sort_keys=False))
    regenerated = project / "data/regenerate/trajectories.parquet"
    killed = subprocess.Popen([str(BIN / "retrosight"), "run"], cwd=project, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while regenerated.exists() or not (project / "data/relabel/relabels.parquet").exists():  # DVC removes a stage's outputs as it starts it
        assert killed.poll() is None and time.time() < deadline, "the run ended before regenerate started"
        time.sleep(0.1)
    # Soon after: forked from the stage server, the tiny regenerate can end within 2 s, and a kill
    # then may land while DVC rewrites dvc.lock (which the next run restores: test_lock_restore.py).
    time.sleep(0.5)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    _wait_until_gone(killed.pid)
    for f in (project / "data").rglob("*.parquet"):
        pq.read_metadata(f)  # whatever a reader can see is a whole file
    third = run([str(BIN / "retrosight"), "run"], project)
    faults(sigkills=1, runs_resumed=1)
    for stage in STAGES[:5] + STEPAGENT:  # relabel finished before the kill: DVC recorded it, so it is not redone
        assert f"{stage}: skipped" in third.stdout, third.stdout
    for stage in STAGES[5:]:
        assert f"{stage}: ran" in third.stdout, third.stdout
    assert (model / "model.safetensors").stat().st_mtime_ns == before
    assert json.loads(run([str(BIN / "dvc"), "status", "--json"], project).stdout) == {}
    assert not list((project / "data").rglob("*.tmp"))

    # One stage by name, forced: that stage and what follows it, nothing upstream. Uninterrupted,
    # it writes exactly what the killed-and-resumed run wrote. While it runs, it holds the
    # workspace: a second run refuses, a third waits its turn.
    resumed = outputs(project)
    fourth = subprocess.Popen([str(BIN / "retrosight"), "run", "relabel", "--force"], cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    owner = project / ".retrosight" / "run.owner"
    deadline = time.time() + 120
    while not owner.exists():
        assert fourth.poll() is None and time.time() < deadline, "the forced run never took the workspace lock"
        time.sleep(0.2)
    assert f"pid {fourth.pid}: retrosight run relabel --force" in owner.read_text()
    refused = run([str(BIN / "retrosight"), "run", "-S", "relabel.n=2"], project, check=False)
    assert refused.returncode != 0
    assert f"another pipeline run holds this workspace (pid {fourth.pid}: retrosight run" in refused.stdout, refused.stdout
    assert yaml.safe_load((project / "params.yaml").read_text())["relabel"]["n"] == 1  # its override never applied
    waiting = subprocess.Popen([str(BIN / "retrosight"), "run", "--wait"], cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    fourth_out, _ = fourth.communicate(timeout=900)
    waiting_out, _ = waiting.communicate(timeout=300)
    assert fourth.returncode == 0, fourth_out[-4000:]
    assert waiting.returncode == 0 and "Waiting for the run that holds this workspace" in waiting_out, waiting_out[-3000:]
    assert "up to date" in waiting_out  # the forced run finished everything; the waiting one found nothing stale
    assert not owner.exists()
    for stage in STAGES[4:]:
        assert f"{stage}: ran" in fourth_out, fourth_out
    for stage in STAGES[:4]:
        assert f"{stage}:" not in fourth_out
    assert outputs(project) == resumed


def outputs(project) -> dict[str, str]:
    """Every output's hash in dvc.lock, but the metrics (which hold timings and cache counts)."""
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    return {o["path"]: o["md5"] for stage in lock["stages"].values() for o in stage.get("outs", []) if not o["path"].endswith("metrics.json")}


def test_bad_params_stop_the_run_with_the_key_named(project):
    raw = tiny_params()
    raw["collect"]["temprature"] = 0.5
    (project / "params.yaml").write_text(yaml.safe_dump(raw))
    result = run([str(BIN / "retrosight"), "run"], project, check=False)
    assert result.returncode != 0
    assert "collect.temprature: unknown key" in result.stdout + result.stderr


def test_a_dvc_failure_is_one_error_line_with_dvc_s_reason(project):
    # A kill in the middle of DVC's own lock write leaves the file cut short: the run stops with
    # DVC's words instead of a traceback around a bare exit status.
    (project / ".dvc" / "tmp").mkdir(parents=True, exist_ok=True)
    (project / ".dvc" / "tmp" / "rwlock").write_text('{"write": {')
    result = run([str(BIN / "retrosight"), "run"], project, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "error: dvc status --json failed (exit 1)" in result.stdout and "rwlock" in result.stdout, result.stdout
    assert "Traceback" not in result.stdout + result.stderr
