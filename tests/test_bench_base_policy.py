"""bench/base_policy.py: where a base policy's held-out games go wrong, against the expert's path."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import TINY

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import base_policy  # noqa: E402

from envs.twenty_questions.env import TwentyQuestions  # noqa: E402
from envs.twenty_questions.kb import load_kb  # noqa: E402
from tasks.rollout import ScriptedAgent, new_episode, play  # noqa: E402


def _played(policy: str, names: list[str]) -> list:
    env, kb = TwentyQuestions(TwentyQuestions.Options()), load_kb()
    scripted = env.policies({"p_random": 0.5, "p_repeat": 0.0, "p_early_guess": 0.0})[policy]
    episodes = [new_episode(env, kb.get(n), i) for i, n in enumerate(names)]
    return play(episodes, ScriptedAgent(lambda rng: scripted), 0)


def test_the_expert_follows_its_own_path_and_names_the_secret():
    kb = load_kb()
    names = [e.name for e in kb.split("val")[:3] + kb.split("test")[:2]]
    counts = base_policy.followed_the_expert(_played("expert", names))
    assert counts == {("val", "named a val object"): 3, ("test", "named a test object"): 2}


def test_a_policy_off_the_expert_path_is_counted_so():
    kb = load_kb()
    counts = base_policy.followed_the_expert(_played("random", [kb.split("val")[0].name]))
    assert counts == {("val", "off the tree"): 1}


@pytest.mark.system
def test_the_command_trains_plays_and_reports(tmp_path):
    sets = [f"{k}={json.dumps(v)}" for k, v in {
        "env.max_turns": TINY["env"]["max_turns"], "bootstrap.limit_tasks": 2, "bootstrap.demos_per_task": 1,
        "bootstrap.model": TINY["bootstrap"]["model"], "bootstrap.tokenizer.vocab_size": 600, "bootstrap.train.epochs": 1,
        "bootstrap.eval_sampling.max_new_tokens": 48, "runtime.threads": 1}.items()]
    cmd = [sys.executable, "bench/base_policy.py", "--out", str(tmp_path)] + [a for s in sets for a in ("--set", s)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "base_policy.json").read_text())
    assert set(result["success"]) == {"greedy", "T=1.0", "T=0.7"} and set(result["success"]["greedy"]) == {"train", "val", "test"}
    assert sum(result["held_out_greedy"].values()) == 4  # 2 val + 2 test games, each counted once
    assert "held-out games played greedy, against the expert's path" in out.stdout
    named = result["named_after_the_expert"]  # naming alone: every game the expert ends on one object, counted once
    assert set(named) == {"train", "val", "test"} and all(sum(c.values()) <= 2 for c in named.values())
    assert "naming alone, after the expert's game" in out.stdout
    assert yaml.safe_load((tmp_path / "model" / "config.json").read_text())["hidden_size"] == 64
