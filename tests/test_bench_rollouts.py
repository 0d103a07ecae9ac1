"""bench/rollouts.py and bench/backends.py at their CI size: they run, print their table and
ratios with positive numbers, and write the same figures to their JSON."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fault_double import write_logged_games

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"([0-9]+(?:\.[0-9]+)?)"


def _run(script: str, *args: str, timeout: int) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], check=False, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def _row(out: str, name: str, columns: int) -> list[float]:
    m = re.search(rf"^{re.escape(name)}" + rf"\s+{NUMBER}" * columns + r"\s*$", out, re.MULTILINE)
    assert m, f"no row {name!r} in:\n{out}"
    return [float(x) for x in m.groups()]


def _ratio(out: str, label: str) -> float:
    m = re.search(rf"^{re.escape(label)}: {NUMBER}", out, re.MULTILINE)
    assert m, f"no line {label!r} in:\n{out}"
    return float(m.group(1))


def test_rollouts_bench_small(tmp_path, tiny_model_dir):
    out_json = tmp_path / "rollouts.json"
    # One torch thread: the tiny batches gain nothing from two, and on a busy machine two threads
    # waiting on each other made this run minutes instead of seconds.
    out = _run("rollouts.py", "--small", "--threads", "1", "--model", str(tiny_model_dir), "--out", str(out_json), timeout=300)
    rows = {}
    for name in ("raw (replayed batches)", "raw, no prefix reuse", "collect (run_collect)", "sequential (1 at a time)"):
        episodes, seconds, cpu, tokens, tokens_per_s, episodes_per_s, tokens_per_cpu_s = rows[name] = _row(out, name, 7)
        assert episodes == 4 and min(seconds, cpu, tokens, tokens_per_s, episodes_per_s, tokens_per_cpu_s) > 0, (name, out)
        # seconds are printed to 0.01: a short row's tokens/s is as exact as that rounding allows
        assert tokens_per_s == pytest.approx(tokens / seconds, rel=0.01 + 0.006 / seconds, abs=0.1)
    # The replays send collect's own batches with its seeds: the same replies, token for token.
    assert rows["raw (replayed batches)"][3] == rows["collect (run_collect)"][3] == rows["raw, no prefix reuse"][3]
    assert "every collect and raw run gave the same texts: True" in out
    collect_vs_raw = _ratio(out, "collect / raw (tokens/s)")
    assert collect_vs_raw == pytest.approx(rows["collect (run_collect)"][4] / rows["raw (replayed batches)"][4], rel=0.01)
    assert _ratio(out, "collect / raw (tokens per CPU second)") > 0
    assert _ratio(out, "collect / sequential (tokens/s)") > 0 and _ratio(out, "collect / raw without prefix reuse (tokens/s)") > 0
    data = json.loads(out_json.read_text())
    assert data["episodes"] == 4 and data["texts_identical"] is True and len(data["rows"]) == 4
    assert data["collect_over_raw"] == pytest.approx(collect_vs_raw, abs=1e-3)


# vLLM's engine takes 30-60 s to start here
def test_backends_bench_small(tmp_path, tiny_model_dir):
    out_json = tmp_path / "backends.json"
    logged = write_logged_games(tmp_path / "trajectories.parquet", 2, 20)  # the prompts: 4 logged games
    assert min(r["num_turns"] for r in logged) >= 3  # so the 3 steps hold 12 requests
    out = _run("backends.py", "--small", "--threads", "1", "--model", str(tiny_model_dir), "--trajectories", str(tmp_path / "trajectories.parquet"),
               "--out", str(out_json), timeout=600)
    rows = {name: _row(out, name, 7) for name in ("hf", "vllm")}
    for name, (start, first, first_result, steady, tokens, tokens_per_s, failed) in rows.items():
        assert start > 0 and first > 0 and steady > 0 and tokens > 0 and tokens_per_s > 0, (name, out)
        assert first_result == pytest.approx(start + first, abs=0.02) and failed == 0
    ratio = _ratio(out, "vllm / hf steady-state tokens/s")
    assert ratio == pytest.approx(rows["vllm"][5] / rows["hf"][5], rel=0.01)
    assert _ratio(out, "vllm / hf time to first result") > 0
    data = json.loads(out_json.read_text())
    assert data["requests"] == 12 and data["steps"] == 3
    assert data["backends"]["hf"]["model_id"] == data["backends"]["vllm"]["model_id"]
    assert data["vllm_over_hf_steady_tokens_per_s"] == pytest.approx(ratio, abs=1e-3)
