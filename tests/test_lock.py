"""Two pipeline runs in one workspace: the second refuses, or with --wait runs after the first."""
from __future__ import annotations

import json
import subprocess
import time

import pyarrow.parquet as pq
import pytest
import yaml

from conftest import BIN, project_env, run

pytestmark = pytest.mark.slow


def test_a_second_run_refuses_or_waits_and_nothing_is_corrupted(project):
    env = project_env(project.parent)
    first = subprocess.Popen([str(BIN / "retrosight"), "run"], cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    owner = project / ".retrosight" / "run.owner"
    deadline = time.time() + 120
    while not owner.exists():
        assert first.poll() is None and time.time() < deadline, first.stdout.read() if first.poll() is not None else "no owner file"
        time.sleep(0.2)
    assert f"pid {first.pid}: retrosight run" in owner.read_text()

    refused = run([str(BIN / "retrosight"), "run", "-S", "relabel.n=1"], project, check=False)
    assert refused.returncode != 0
    assert f"another pipeline run holds this workspace (pid {first.pid}: retrosight run" in refused.stdout, refused.stdout
    assert yaml.safe_load((project / "params.yaml").read_text())["relabel"]["n"] == 2  # its override never applied

    waiting = subprocess.Popen([str(BIN / "retrosight"), "run", "--wait"], cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out_first, _ = first.communicate(timeout=900)
    out_waiting, _ = waiting.communicate(timeout=300)
    assert first.returncode == 0, out_first[-3000:]
    assert waiting.returncode == 0, out_waiting[-3000:]
    assert "Waiting for the run that holds this workspace" in out_waiting
    assert "up to date" in out_waiting  # the first run finished everything; the second found nothing stale

    assert json.loads(run([str(BIN / "dvc"), "status", "--json"], project).stdout) == {}
    for table in project.glob("data/*/*.parquet"):
        pq.read_table(table)  # every table whole and readable
    assert not owner.exists()
