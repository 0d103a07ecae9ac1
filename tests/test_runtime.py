"""runtime.threads and the OpenMP wait policy: the cores a process may use, and every process
that does torch work getting its share of them."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tasks.params import RuntimeParams
from tasks.runtime import available_cores, cgroup_quota, threads_for
from tests.conftest import ROOT, tiny_params


@pytest.mark.parametrize(
    "files, quota",
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 0.5),
        ({}, None),
    ],
)
def test_cgroup_quota_v1_and_v2(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_quota(tmp_path) == quota


def test_a_quota_caps_the_cores_and_rounds_up(tmp_path):
    cores = available_cores(tmp_path)  # no quota files: the affinity alone
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert available_cores(tmp_path) == 1  # half a CPU still runs one thread
    (tmp_path / "cpu.max").write_text(f"{cores * 100000 + 1} 100000\n")
    assert available_cores(tmp_path) == cores  # a quota above the affinity does not add cores


def test_workers_split_the_threads_never_below_one():
    assert threads_for(4, 2) == 2
    assert threads_for(2, 3) == 1
    assert threads_for(None, 1) == available_cores()


def _threads_in_a_new_process(params_file, *prefix: str) -> tuple[int, str]:
    code = (
        "from tasks.runtime import apply_from_file; apply_from_file(%r)\n"
        "import os, torch; print(torch.get_num_threads(), os.environ['OMP_WAIT_POLICY'])" % str(params_file)
    )
    out = subprocess.run([*prefix, sys.executable, "-c", code], cwd=ROOT, text=True, capture_output=True, check=True).stdout.split()
    return int(out[0]), out[1]


def test_a_process_started_from_params_gets_its_threads_and_wait_policy(tmp_path):
    raw = tiny_params({"runtime": {"threads": 1, "omp_wait_policy": "active"}})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    assert _threads_in_a_new_process(tmp_path / "params.yaml") == (1, "ACTIVE")
    raw["runtime"] = RuntimeParams().model_dump()  # the default: every core this process may use
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    assert _threads_in_a_new_process(tmp_path / "params.yaml") == (available_cores(), "PASSIVE")


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_the_default_follows_the_cpu_affinity(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params()))
    assert _threads_in_a_new_process(tmp_path / "params.yaml", "taskset", "-c", "0") == (1, "PASSIVE")
