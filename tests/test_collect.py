"""collect: batched rollouts, m seeds per task, byte-identical reruns."""
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import tiny_params, twenty_questions
from envs.twenty_questions.kb import load_kb
from tasks.collect import run_collect
from tasks.params import Params
from tasks.rollout import LMAgent


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir


def test_two_runs_with_the_same_seed_write_identical_bytes(model_dir, tmp_path):
    params = Params.model_validate(tiny_params())
    m1 = run_collect(params, model_dir, tmp_path / "a")
    run_collect(params, model_dir, tmp_path / "b")
    a = (tmp_path / "a/trajectories.parquet").read_bytes()
    assert a == (tmp_path / "b/trajectories.parquet").read_bytes()
    assert m1["trajectories"] == 3 * 2 * 2

    other = Params.model_validate(tiny_params({"seed": 1}))
    run_collect(other, model_dir, tmp_path / "c")
    assert (tmp_path / "c/trajectories.parquet").read_bytes() != a


def test_rows_have_distinct_seeds_and_complete_episodes(model_dir, tmp_path):
    params = Params.model_validate(tiny_params())
    run_collect(params, model_dir, tmp_path)
    rows = pq.read_table(tmp_path / "trajectories.parquet").to_pylist()
    by_task: dict = {}
    for r in rows:
        by_task.setdefault((r["split"], r["task_id"]), []).append(r["seed"])
        assert r["source"] == "policy" and r["parent_id"] is None
        assert r["num_turns"] == len(r["turns"]) == sum(m["role"] == "assistant" for m in r["messages"])
        assert r["return"] == sum(t["reward"] for t in r["turns"])
        assert r["messages"][0]["role"] == "system"
        # An untrained policy never guesses right: it plays every turn.
        assert r["success"] or r["num_turns"] == params.env.max_turns
    assert all(len(set(seeds)) == 2 for seeds in by_task.values())
    assert len({r["trajectory_id"] for r in rows}) == len(rows)


def test_generation_is_batched_across_live_episodes(model_dir, monkeypatch):
    """One generate call per step carries every live episode."""
    from models.hf import HFGenerator
    from tasks.rollout import new_episode, play
    from models.base import SamplingParams

    gen = HFGenerator(model_dir, batch_size=64)
    sizes = []
    original = gen.generate

    def spy(convs, sampling, seed):
        sizes.append(len(convs))
        return original(convs, sampling, seed)

    monkeypatch.setattr(gen, "generate", spy)
    kb = load_kb()
    eps = [new_episode(twenty_questions(20), t, i) for i, t in enumerate(kb.split("train")[:5])]
    play(eps, LMAgent(gen, SamplingParams(max_new_tokens=8)), 0)
    assert sizes[0] == 5 and len(sizes) == max(len(e.turns) for e in eps)


def test_a_bound_on_games_at_once_admits_each_as_another_ends_and_plays_them_the_same(model_dir, monkeypatch):
    """Game.concurrency (a simulator holding so many worlds): no step carries more live games
    than the bound, the waiting ones start as others end, and each episode plays as unbounded."""
    from models.hf import HFGenerator
    from tasks.rollout import new_episode, play
    from models.base import SamplingParams

    gen = HFGenerator(model_dir, batch_size=64)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    tasks = load_kb().split("train")[:5]
    free = play([new_episode(twenty_questions(4), t, i) for i, t in enumerate(tasks)], LMAgent(gen, sampling), 0)
    sizes = []
    original = gen.generate
    monkeypatch.setattr(gen, "generate", lambda convs, s, seed: sizes.append(len(convs)) or original(convs, s, seed))
    bounded = [new_episode(twenty_questions(4), t, i) for i, t in enumerate(tasks)]
    for e in bounded:
        e.game.concurrency = 2
    play(bounded, LMAgent(gen, sampling), 0)
    assert max(sizes) == 2 and sum(sizes) == sum(len(e.turns) for e in bounded)
    assert [e.messages for e in bounded] == [e.messages for e in free]


def test_logging_temperatures_give_each_task_one_trajectory_at_each(model_dir, tmp_path):
    """Refit/Swift's logging: m = 3 per task, one at each temperature, named in the policy_id and
    reported side by side; m must be a multiple of the temperatures."""
    params = Params.model_validate(tiny_params({"collect": {"m": 3, "temperatures": [0.3, 0.7, 1.0]}}))
    metrics = run_collect(params, model_dir, tmp_path)
    rows = pq.read_table(tmp_path / "trajectories.parquet").to_pylist()
    by_task: dict = {}
    for r in rows:
        by_task.setdefault(r["task_id"], []).append(r["policy_id"].rsplit("@T=", 1)[1])
    assert by_task and all(sorted(ts) == ["0.3", "0.7", "1"] for ts in by_task.values())
    assert set(metrics["by_temperature"]) == {"0.3", "0.7", "1"}
    assert sum(s["episodes"] for s in metrics["by_temperature"].values()) == len(rows)
    with pytest.raises(ValueError, match=r"m \(2\) must be a multiple of the 3 temperatures"):
        Params.model_validate(tiny_params({"collect": {"m": 2, "temperatures": [0.3, 0.7, 1.0]}}))
