"""bench/threads.py at its CI size: every row runs with the threads it names, prints its seconds
and its ratio to the 1-thread row, and writes the same trajectories as the others."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.runtime import available_cores

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[1]


def test_threads_bench_small(tmp_path, tiny_model_dir):
    out_json = tmp_path / "threads.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "threads.py"), "--small", "--model", str(tiny_model_dir), "--out", str(out_json)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out, cores = proc.stdout, available_cores()
    data = json.loads(out_json.read_text())
    runs = data["results"]["0"]
    assert len(data["rows"]) == len(runs) == 5 and data["episodes"] == 3 and data["cores"] == cores
    # Each row's processes ran torch with the threads the row names: runtime's default takes every
    # core, the split gives each of two processes half (never below one).
    assert [r["torch_threads"] for r in runs] == [[cores], [1], [cores], [cores, cores], [max(1, cores // 2)] * 2]
    for name, r in zip(data["rows"], runs):
        m = re.search(rf"^\| {re.escape(name)} \| ([0-9.]+) \| ([0-9.]+) \|$", out, re.MULTILINE)
        assert m, f"no row {name!r} in:\n{out}"
        assert float(m.group(1)) == pytest.approx(r["wall"], abs=0.006) and r["wall"] > 0
        assert float(m.group(2)) == pytest.approx(r["wall"] / runs[1]["wall"], abs=0.006)
        assert set(r["digests"]) == {"0", "1"}  # both shards played, in one process or two
    assert data["same_trajectories"] is True and "every row wrote the same trajectories as 1 thread" in out
