"""bench/critic_choice.py: a turn's figures and their summary on hand-made candidates, and the
bench end to end on two tiny games with an untrained critic."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import tiny_params

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import critic_choice  # noqa: E402


def test_a_turn_counts_the_critics_first_highest_choice_and_the_pairs_it_orders_as_worth_does():
    assert critic_choice.turn_figures([2, 2, 2], {"c": [0.1, 0.5, 0.2]}) is None  # nothing to choose
    t = critic_choice.turn_figures([0, 3, 1, 3], {"good": [0.1, 0.9, 0.5, 0.9], "bad": [0.8, 0.1, 0.3, 0.2]})
    assert t["random"] == pytest.approx(1.75) and t["best"] == 3 and t["worst"] == 0
    assert t["critics"]["good"]["choice"] == 3 and t["critics"]["bad"]["choice"] == 0
    # pairs differing in worth: (0,1) (0,2) (0,3) (1,2) (2,3); "good" ties on none of them and orders all five
    assert t["critics"]["good"]["ordered"] == [True] * 5
    assert t["critics"]["bad"]["ordered"] == [False, False, False, False, False]
    s = critic_choice.summary([t, critic_choice.turn_figures([1, 0], {"good": [0.4, 0.4], "bad": [0.1, 0.2]})])
    assert s["turns"] == 2 and s["random"] == pytest.approx((1.75 + 0.5) / 2)
    assert s["good"]["choice"] == pytest.approx(2.0)  # a tie goes to the first candidate (worth 1)
    assert s["good"]["gain_over_random"] == pytest.approx(((3 - 1.75) + (1 - 0.5)) / 2, abs=1e-4)
    assert s["good"]["pairs"] == 5 and s["good"]["concordance"] == 1.0  # the tied pair is left out
    assert s["bad"]["pairs"] == 6 and s["bad"]["concordance"] == 0.0


def test_the_bench_plays_two_games_and_writes_its_figures(tiny_model_dir, tmp_path):
    from tasks.train import critic

    model, tok = critic.load_critic(str(tiny_model_dir), base=True)
    model.save_pretrained(tmp_path / "critic")
    tok.save_pretrained(tmp_path / "critic")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params()))
    cmd = [sys.executable, str(ROOT / "bench/critic_choice.py"), "--params", str(tmp_path / "params.yaml"), "--policy", str(tiny_model_dir),
           "--critic", f"untrained={tmp_path / 'critic'}", "--n", "3", "--splits", "val", "--limit-tasks", "2", "--json", str(tmp_path / "out.json")]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert "2 games of val" in r.stdout and out["turns"] >= 0
    if out["turns"]:
        assert out["worst"] <= out["untrained"]["choice"] <= out["best"]
