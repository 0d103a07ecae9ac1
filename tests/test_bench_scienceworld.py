"""bench/scienceworld_sim.py at its CI size: it runs on the real simulator, prints its rows and
ratios with positive numbers, plays every episode to score 100, writes the same figures to its
JSON, and leaves no JVM running."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
ROWS = ("package step (ScienceWorldEnv.step)", "pool, 1 simulator", "pool, 2 simulators at once")


def test_scienceworld_bench_small(tmp_path):
    out_json = tmp_path / "scienceworld_sim.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "scienceworld_sim.py"), "--small", "--out", str(out_json)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    data = json.loads(out_json.read_text())
    assert data["episodes"] == 4 and data["all_succeeded"] is True and "every episode reached score 100: True" in out
    for name, row in zip(ROWS, data["rows"], strict=True):
        m = re.search(rf"^{re.escape(name)}" + rf"\s+{NUMBER}" * 7 + r"\s*$", out, re.MULTILINE)
        assert m, f"no row {name!r} in:\n{out}"
        jvms, episodes, steps, seconds, rate, ratio, ms = (float(x) for x in m.groups())
        assert (jvms, episodes) == (2 if "2 simulators" in name else 1, 4) and steps == row["steps"] > 0
        assert seconds == pytest.approx(row["seconds"], abs=0.006) and rate == pytest.approx(row["steps_per_s"], abs=0.06) and ms > 0
        assert ratio == pytest.approx(row["steps_per_s"] / data["rows"][1]["steps_per_s"], abs=0.006)
    assert data["rows"][0]["steps"] == data["rows"][1]["steps"] == data["rows"][2]["steps"]  # the same gold paths in every row
    two = re.search(rf"^pool 2 at once / pool 1 \(steps/s\): {NUMBER}$", out, re.MULTILINE)
    assert two and float(two.group(1)) == pytest.approx(data["two_over_one"], abs=0.006)
    [split] = data["split"]
    assert split["steps"] == data["rows"][1]["steps"] and 0 < split["sim_share"] <= 1
    assert re.search(rf"^scripted expert\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}$", out, re.MULTILINE), out
    assert "JVMs left running: 0" in out
