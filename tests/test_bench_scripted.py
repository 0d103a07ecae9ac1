"""bench/scripted_policies.py prints each scripted policy's play, measured against the oracle."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_scripted_policies_table_reads_the_expert_above_random():
    out = subprocess.run([sys.executable, "bench/scripted_policies.py", "--env", "twenty_questions", "--episodes", "1", "--splits", "val"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    rows = {line.split()[1]: line.split() for line in out.splitlines() if line.startswith("val ")}
    assert set(rows) == {"expert", "noisy", "random"}
    assert rows["expert"][2] == "28" and float(rows["expert"][6]) == 1.0  # the expert wins every val game
    assert float(rows["expert"][3]) > float(rows["random"][3])
