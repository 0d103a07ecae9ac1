"""Versioned runs end to end: a real Prefect server and a scheduled deployment, runs kept as DVC
experiments and pushed, then `versions`, `inspect --rev`, `diff`, `lineage`, `run --only`."""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from conftest import BIN, ROOT, free_port, make_project, project_env, run, stop_process

pytestmark = pytest.mark.system


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"{url} did not answer in {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.fixture
def project(tmp_path):
    """One training method: these runs are about versions, and each method trains and plays again."""
    return make_project(tmp_path, methods={"refit": {"algorithm": "refit"}})


@pytest.fixture
def prefect_server(tmp_path):
    """`prefect server start` on loopback, with its own home and database."""
    port = free_port()
    env = project_env(tmp_path)
    env["PREFECT_HOME"] = str(tmp_path / "server-home")
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env["PREFECT_UI_ENABLED"] = "false"
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        _wait_http(f"http://127.0.0.1:{port}/api/health", proc, log, timeout=240)
        yield f"http://127.0.0.1:{port}/api"
    finally:
        stop_process(proc)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_scheduled_run_then_versions_inspect_diff_lineage(project, prefect_server, tmp_path):
    # The project's own DVC config: the default local remote every scheduled run pushes to.
    shutil.copy(ROOT / ".dvc" / "config", project / ".dvc" / "config")
    env = project_env(project.parent)
    env.update(PREFECT_API_URL=prefect_server, PREFECT_RUNNER_POLL_FREQUENCY="2")

    serve_log = tmp_path / "serve.log"
    with open(serve_log, "w") as out:
        serve = subprocess.Popen(
            [str(BIN / "retrosight"), "serve", "--cron", "0 3 * * *", "--name", "nightly"],
            cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        # A client of the test's server itself: get_client() would first start an ephemeral
        # server of its own in this process (PREFECT_API_URL is not set here), seconds of work
        # that can time out on a busy machine.
        from prefect.client.orchestration import SyncPrefectClient

        deadline = time.time() + 180
        deployment = None
        while deployment is None and time.time() < deadline:
            assert serve.poll() is None, serve_log.read_text()[-3000:]
            with SyncPrefectClient(prefect_server) as client:
                found = client.read_deployments()
            deployment = next((d for d in found if d.name == "nightly"), None)
            time.sleep(1)
        assert deployment is not None, serve_log.read_text()[-3000:]
        assert [s.schedule.cron for s in deployment.schedules] == ["0 3 * * *"]

        # Trigger one run now instead of waiting for 03:00, and watch it to the end.
        triggered = subprocess.run(
            [str(BIN / "prefect"), "deployment", "run", "retrosight-scheduled/nightly", "--watch", "--watch-timeout", "900"],
            cwd=project, env=env, text=True, capture_output=True, timeout=960,
        )
        assert triggered.returncode == 0, triggered.stdout[-3000:] + triggered.stderr[-3000:] + serve_log.read_text()[-5000:]
        assert "Completed" in triggered.stdout, triggered.stdout[-3000:]

        with SyncPrefectClient(prefect_server) as client:
            runs = client.read_flow_runs()
            artifacts = client.read_artifacts()
        scheduled = [r for r in runs if r.deployment_id == deployment.id]
        assert len(scheduled) == 1 and scheduled[0].state.is_completed()
        by_key = {a.key: a for a in artifacts if a.key}
        for stage in ("collect", "relabel", "label", "standardize"):
            body = by_key[f"retrosight-{stage}"].data
            assert "| out |" in body and "**time**" in body and "**failures**" in body, body
        assert "| reward |" in by_key["retrosight-label"].data
    finally:
        stop_process(serve)

    # The run is a DVC experiment named after the deployment, and its data is on the remote.
    names = run([str(BIN / "dvc"), "exp", "list", "--all-commits", "--name-only"], project).stdout.split()
    assert len(names) == 1 and names[0].startswith("nightly-"), names
    first = names[0]
    remote = project / ".dvc" / "storage"
    assert any(p.is_file() for p in remote.rglob("*")), "nothing pushed to the default remote"
    assert (project / "reports" / f"{first}.html").exists()
    relabels_first = pq.read_table(project / "data/relabel/relabels.parquet").num_rows

    # A second run with one param changed on the command line, recorded as an experiment.
    # (on a machine with no git identity: the experiment commit is signed by the pipeline)
    no_identity = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}
    second = run([str(BIN / "retrosight"), "run", "-S", "relabel.n=1", "--name", "fewer"], project, env_extra=no_identity)
    assert "relabel: ran" in second.stdout and "collect: skipped" in second.stdout, second.stdout
    assert "Saved as DVC experiment fewer" in second.stdout
    relabels_now = project / "data/relabel/relabels.parquet"
    assert pq.read_table(relabels_now).num_rows < relabels_first

    again = run([str(BIN / "retrosight"), "run", "-S", "relabel.n=2", "--name", "fewer"], project, check=False)
    assert again.returncode != 0 and "a version of that name exists" in again.stdout, again.stdout
    assert yaml.safe_load((project / "params.yaml").read_text())["relabel"]["n"] == 1  # left as it was

    versions = run([str(BIN / "retrosight"), "versions"], project, env_extra={"COLUMNS": "200"}).stdout
    assert first in versions and "fewer" in versions and "relabel.n: 2 -> 1" in versions, versions

    # The first run's relabel table, read from the DVC cache: the workspace is not touched.
    before = (_sha(relabels_now), run(["git", "rev-parse", "HEAD"], project).stdout)
    old = run([str(BIN / "retrosight"), "inspect", "relabels", "--rev", first, "--sql", "SELECT count(*) AS n FROM relabels"], project).stdout
    assert f"│ {relabels_first} " in old, old
    shown = run([str(BIN / "retrosight"), "inspect", "relabels", "--rev", first, "--limit", "1"], project).stdout
    assert f"relabel.relabels at {first}: {relabels_first} rows" in shown and "counterfactual_action" in shown, shown
    assert (_sha(relabels_now), run(["git", "rev-parse", "HEAD"], project).stdout) == before

    changed = run([str(BIN / "retrosight"), "diff", first, "fewer"], project, env_extra={"COLUMNS": "200"}).stdout
    assert "relabel.n" in changed and "relabel.relabels" in changed and "label.labels" in changed, changed
    lines = changed.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("relabel.relabels"))
    assert lines[at].split()[1:4] == ["a", str(relabels_first), "branch_turn"], changed
    assert lines[at + 1].split()[:3] == ["b", str(pq.read_table(relabels_now).num_rows), "branch_turn"], changed

    # Lineage of a regenerated trajectory, at the first run.
    regen = pq.read_table(project / "data/regenerate/trajectories.parquet").to_pylist()[0]
    tree = run([str(BIN / "retrosight"), "lineage", regen["trajectory_id"]], project, env_extra={"COLUMNS": "300"}).stdout
    for expected in (regen["parent_id"], regen["relabel_id"], "summary (oracle, ok)", "label: reward", "Refit weight", "regeneration"):
        assert expected in tree, (expected, tree)

    # --only: refused while an input is stale, and runs just that stage once it is not.
    run([str(BIN / "python"), "-c", "from dvc.utils.hydra import apply_overrides; apply_overrides('params.yaml', ['relabel.k=1'])"], project)
    refused = run([str(BIN / "retrosight"), "run", "label", "--only"], project, check=False)
    assert refused.returncode != 0 and "inputs are stale (relabel" in refused.stdout, refused.stdout
    run([str(BIN / "retrosight"), "run", "-S", "relabel.k=2"], project)
    only = run([str(BIN / "retrosight"), "run", "standardize", "--only", "--force"], project).stdout
    assert "standardize: ran" in only and "train:" not in only, only

    bad = run([str(BIN / "retrosight"), "inspect", "relabels", "--rev", "no-such-run"], project, check=False)
    assert bad.returncode != 0 and "unknown revision 'no-such-run'" in bad.stdout
