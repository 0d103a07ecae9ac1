"""bench/data_scale.py at its CI size: it runs, prints its table with positive numbers, and our
stage's training table agrees with the pandas implementation's."""
from __future__ import annotations

import pytest

import json
import re
import subprocess
import sys
from pathlib import Path

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[1]


def test_data_scale_bench_small():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "data_scale.py"), "--small"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "standardize at scale: 20,000 trajectories" in out, out
    rows = {}
    for label in ("read inputs", "label join", "standardize (z, weights, sort)", "write train + export", "total", "total without row checks"):
        line = next((ln for ln in out.splitlines() if ln.startswith(label + " ")), None)  # "total " comes first
        assert line is not None, f"no {label!r} row in:\n{out}"
        rows[label] = line
    # ours seconds, ours peak MB, pandas seconds, pandas peak MB, pandas/ours ratio
    total = re.findall(r"[\d.]+", rows["total without row checks"])
    assert len(total) >= 5 and all(float(x) > 0 for x in total[:5]), rows["total without row checks"]
    assert re.search(r"\d+\.\dx$", rows["total"]), rows["total"]
    checks = next(ln for ln in out.splitlines() if "of which row checks" in ln)
    assert float(re.findall(r"[\d.]+", checks.split(")", 1)[1])[0]) > 0
    cpu = next((ln for ln in out.splitlines() if ln.startswith("CPU time, all processes")), None)
    assert cpu is not None and all(float(x) > 0 for x in re.findall(r"[\d.]+", cpu.split(")", 1)[1])[:3]), out
    assert "outputs agree with pandas: yes (" in out, out
    # The stage on the DVC-recorded inputs and on the same bytes from unrecorded paths (every row
    # hashed again) writes the same table; the hashed one spends longer in its row checks.
    assert "outputs agree with ours-hashed: yes (" in out, out
    record = json.loads((ROOT / "bench" / "out" / "data_scale.json").read_text())
    assert record["ours-hashed"]["rows_out"] == record["ours"]["rows_out"] and record["ours-hashed"]["quarantined"] == record["ours"]["quarantined"]
    record = json.loads((ROOT / "bench" / "out" / "data_scale.json").read_text())
    assert record["n"] == 20_000 and record["agree"]["pandas"]["agree"] is True
    assert record["ours"]["rows_out"] == record["pandas"]["rows_out"] > 0
    assert record["ours"]["rows_in"] == 20_000 and record["ours"]["peak_mb"]["total"] > 0 and record["ours"]["cpu_seconds"] > 0
