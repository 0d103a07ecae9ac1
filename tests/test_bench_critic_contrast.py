"""bench/critic_contrast.py: branch states and concordance on hand-made pairs, and the bench end to
end (critic, frozen-base probes, a fit on the branch states) on a tiny buffer."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import critic_contrast  # noqa: E402


def pair(state: str, action: str, target: float, source: str = "on-policy", selected: bool = False) -> dict:
    return {"prompt": [{"role": "user", "content": state}], "action": {"role": "assistant", "content": action},
            "target": target, "source": source, "selected": selected}


def test_branch_states_the_targets_preference_and_a_critics_concordance():
    rows = [
        pair("s1", "a", 0.2, selected=True), pair("s1", "b", 0.9, "hindsight"), pair("s1", "c", 0.5, "hindsight"),
        pair("s2", "a", 0.8), pair("s2", "b", 0.1, "hindsight"),  # the counterfactual lost here
        pair("s3", "a", 0.3), pair("s3", "b", 0.3, "hindsight"),  # equal targets: no pair counts
        pair("s4", "a", 0.1), pair("s4", "b", 0.7),  # two logged actions: not a branch state
    ]
    states = critic_contrast.by_state(rows)
    assert [len(s) for s in states] == [3, 2, 2, 2]
    assert [critic_contrast.is_branch(s) for s in states] == [True, True, True, False]
    score = {id(r): s for r, s in zip(rows, [0.1, 0.6, 0.6, 0.4, 0.9, 0.5, 0.5, 0.2, 0.3])}
    out = critic_contrast.branch_figures(states, {"c": score})
    assert out["branch_states"] == 3
    # trained on: s1 (a selected pair), counterfactual vs logged: (b, a) and (c, a), both preferred, both ordered
    assert out["trained on"] == {"states": 1, "pairs": 2, "target_prefers_counterfactual": 1.0, "c": 1.0}
    # not trained on: s2's one pair, the target prefers the logged action, the critic the other way; s3 ties on target
    assert out["not trained on"] == {"states": 2, "pairs": 1, "target_prefers_counterfactual": 0.0, "c": 0.0}
    # every pair of one state with different targets: s1's three (b, c tie in score: a half), s2's, s4's
    assert critic_contrast.concordance(states, score) == (round((1 + 1 + 0.5 + 0 + 1) / 5, 3), 5)


def test_the_bench_reads_a_critic_probes_and_fits(tiny_model_dir, tmp_path):
    from tasks.train import critic

    rows = []
    for i in range(10):  # ten branch states, the counterfactual better at every other one
        good = i % 2 == 0
        rows += [pair(f"Turn {i}: ask.", "Is it an animal?", 0.2 if good else 0.8, selected=i < 5),
                 pair(f"Turn {i}: ask.", "Is it a tool?", 0.8 if good else 0.2, "hindsight", selected=i < 5),
                 pair(f"Turn {i} then.", "Is it red?", 0.4)]
    pl.DataFrame(rows).write_parquet(tmp_path / "pairs.parquet")
    model, tok = critic.load_critic(str(tiny_model_dir), base=True)
    model.save_pretrained(tmp_path / "critic")
    tok.save_pretrained(tmp_path / "critic")
    cmd = [sys.executable, str(ROOT / "bench/critic_contrast.py"), "--buffer", str(tmp_path / "pairs.parquet"),
           "--critic", f"untrained={tmp_path / 'critic'}", "--base", str(tiny_model_dir), "--probe", "--fit-epochs", "1", "--pair-loss",
           "--json", str(tmp_path / "out.json")]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert "30 pairs at 20 states; 10 branch states" in r.stdout
    assert out["branch"]["trained on"]["target_prefers_counterfactual"] == pytest.approx(3 / 5)
    assert out["branch"]["not trained on"]["pairs"] == 5 and 0 <= out["branch"]["not trained on"]["untrained"] <= 1
    assert out["probe"]["states"] == 10 and out["probe"]["pairs"] == 10
    fit = out["fit"]
    assert (fit["train_states"], fit["held_out_states"], fit["pair_loss"]) == (8, 2, True) and [c["epoch"] for c in fit["curve"]] == [0, 1]
    assert fit["curve"][1]["train"][1] == 8 and fit["curve"][1]["held_out"][1] == 2

    bad = subprocess.run([*cmd[:4], "--critic", "nameonly"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--critic nameonly: expected NAME=PATH" in bad.stderr
