"""bench/noop_rerun.py at its small size: it runs, and what it prints holds together."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.system


def test_noop_rerun_bench_small():
    out = subprocess.run(
        [sys.executable, "bench/noop_rerun.py", "--small", "--repeats", "1"],
        cwd=ROOT, text=True, capture_output=True, timeout=1200,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {m[1].strip(): float(m[2]) for m in re.finditer(r"^(full run|no-op rerun \(median of 1\)|standardize param changed)\s+(\d+\.\d+)", out.stdout, re.MULTILINE)}
    assert len(rows) == 3, out.stdout
    assert 0 < rows["no-op rerun (median of 1)"] < rows["full run"] / 5
    assert re.search(r"^full run / no-op rerun: \d+x$", out.stdout, re.MULTILINE)
    saved = json.loads((ROOT / "bench/out/noop_rerun.json").read_text())
    assert saved["stages_full"][0] == "bootstrap" and saved["stages_full"][-1] == "evaluate"
    assert saved["stages_one_param"][0] == "standardize"  # nothing upstream of the changed param reran
