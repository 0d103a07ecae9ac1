"""The stage server (flows/preload.py): `retrosight run` forks its stages from one process that
imported their modules once. A stage run through it writes what the stage run in its own process
writes, its status and output reach DVC as before, and no child outlives the run or the process
DVC started."""
import os
import subprocess
import sys
import time

import psutil
import pytest
import yaml

from conftest import BIN, copy_repo, project_env, run


def _set_preload(repo, on: bool) -> None:
    raw = yaml.safe_load((repo / "params.yaml").read_text())
    raw["runtime"]["preload"] = on
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


@pytest.mark.parametrize("preload", [True, False])
def test_a_stage_forked_from_the_server_writes_what_its_own_process_writes(finished_workspace, tmp_path, preload):
    repo = copy_repo(finished_workspace.repo, tmp_path)
    before = {p: p.read_bytes() for p in (repo / "data" / "label").glob("*.parquet")}
    assert before, "the finished workspace has no label tables"
    _set_preload(repo, preload)  # runtime: no stage depends on it
    out = run([str(BIN / "retrosight"), "run", "label", "--only", "--force"], repo)
    # the run's table of where the stage's seconds went, whole into a pipe
    assert "Seconds by stage" in out.stdout and "start-up" in out.stdout, out.stdout
    row = next(line for line in out.stdout.splitlines() if line.strip("│ ").startswith("label "))
    seconds = [float(x) for x in row.strip("│ ").split("│")[1:]]
    assert len(seconds) == 7 and seconds[0] >= seconds[1] > 0, row  # the whole stage, then its work
    assert {p: p.read_bytes() for p in (repo / "data" / "label").glob("*.parquet")} == before


def _server_children(server: psutil.Process) -> list[psutil.Process]:
    return [c for c in server.children() if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_no_stage_outlives_the_process_dvc_started_or_the_run(finished_workspace, tmp_path):
    repo = copy_repo(finished_workspace.repo, tmp_path)
    env = project_env(tmp_path)
    sock = tmp_path / "stages.sock"
    server = subprocess.Popen([sys.executable, "-m", "flows.preload", str(sock)], cwd=repo, env=env, stdin=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not sock.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert sock.exists(), "the server never bound its socket"
        stage_env = {**env, "RETROSIGHT_STAGE_SERVER": str(sock)}

        def start():
            return subprocess.Popen([str(BIN / "retrosight"), "stage", "evaluate"], cwd=repo, env=stage_env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def forked(relay: subprocess.Popen) -> psutil.Process:
            deadline = time.time() + 120
            while time.time() < deadline and relay.poll() is None:
                if children := _server_children(psutil.Process(server.pid)):
                    return children[0]
                time.sleep(0.05)
            raise AssertionError(f"the server forked no stage (relay exit {relay.poll()})")

        # The process DVC started is killed: the server kills the stage it was waiting for.
        relay = start()
        child = forked(relay)
        relay.kill()
        relay.wait()
        child.wait(timeout=30)
        # The run ends (the server's stdin closes) while a stage runs: the server kills it and ends.
        relay = start()
        child = forked(relay)
        server.stdin.close()
        server.wait(timeout=30)
        child.wait(timeout=30)
        assert relay.wait(timeout=30) != 0  # told that its stage did not finish
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_stage_runs_in_its_own_process_when_the_server_cannot_be_reached(finished_workspace, tmp_path):
    repo = copy_repo(finished_workspace.repo, tmp_path)
    out = run([str(BIN / "retrosight"), "stage", "label"], repo, env_extra={"RETROSIGHT_STAGE_SERVER": str(tmp_path / "none.sock")})
    assert out.returncode == 0 and os.path.exists(repo / "data" / "label" / "metrics.json")
