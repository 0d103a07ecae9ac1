"""HOPE's replay buffer (tasks/buffer.py): targets on a hand-made buffer, the balance, alpha, and
the stage end to end on checked input."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from storage.parquet import write_table
from tasks.buffer import balance_note, build_pairs, returns_to_go, run_buffer, select
from tasks.params import Params
from conftest import tiny_params

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("data_scale", ROOT / "bench" / "data_scale.py")
data_scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(data_scale)


def chat(actions: list[str]) -> list[dict]:
    messages = [{"role": "system", "content": "play"}, {"role": "user", "content": "Turn 1."}]
    for i, a in enumerate(actions):
        messages += [{"role": "assistant", "content": a}, {"role": "user", "content": f"Answer {i}."}]
    return messages


def traj(tid: str, actions: list[str], rewards: list[float], success: bool, source: str = "policy") -> dict:
    return {
        "trajectory_id": tid, "messages": chat(actions), "success": success, "source": source,
        "turns": [{"turn": i, "reason": "", "action": a, "observation": "", "reward": r} for i, (a, r) in enumerate(zip(actions, rewards))],
    }


# A logged win in 3 turns, and a regeneration that shares its first action and state, then
# branches at turn 1 and loses.
LOGGED = traj("A", ["a0", "a1", "a2"], [-1.0, -1.0, 0.0], True)
REGEN = traj("B", ["a0", "b1", "b2"], [-1.0, -1.0, -1.0], False, source="regeneration")


def test_returns_to_go_discount():
    assert returns_to_go([-1.0, -1.0, 0.0], 0.5) == [-1.5, -1.0, 0.0]


def test_a_shared_prefix_pair_averages_both_trajectories():
    rows = {(r["turn"], r["action"]["content"]): r for r in build_pairs([REGEN, LOGGED], 0.5, "outcome", (-3.0, 0.0))}
    assert len(rows) == 5  # a0 shared; a1, a2 logged; b1, b2 hindsight
    shared = rows[0, "a0"]
    assert shared["count"] == 2 and sorted(shared["trajectory_ids"]) == ["A", "B"]
    assert shared["source"] == "on-policy"  # the policy took it
    # Eq. 3: mean of -1.5 (A) and -1 - 0.5 - 0.25 = -1.75 (B)
    assert shared["target_raw"] == pytest.approx(-1.625)
    # outcome: A 0.5 * (1 + 0.5^2), B 0.5 * (1 - 0.5^2)
    assert shared["target"] == pytest.approx((0.625 + 0.375) / 2)
    assert rows[1, "b1"]["source"] == "hindsight" and rows[1, "b1"]["count"] == 1
    assert rows[1, "b1"]["target"] == pytest.approx(0.5 * (1 - 0.5))
    assert rows[2, "a2"]["target"] == pytest.approx(1.0) and rows[2, "a2"]["target_raw"] == 0.0
    # the state is the chat before the action
    assert [m["content"] for m in rows[1, "b1"]["prompt"]] == ["play", "Turn 1.", "a0", "Answer 0."]


def test_return_range_maps_eq3_from_the_reward_range():
    rows = {(r["turn"], r["action"]["content"]): r for r in build_pairs([REGEN, LOGGED], 0.5, "return_range", (-3.0, 0.0))}
    assert rows[0, "a0"]["target"] == pytest.approx((-1.625 + 3) / 3)
    with pytest.raises(ValueError, match="outside the environment's reward range"):
        build_pairs([REGEN], 1.0, "return_range", (-2.0, 0.0))


def test_a_turn_without_reward_is_an_error_naming_the_trajectory():
    bad = traj("C", ["a0"], [-1.0], False)
    bad["turns"][0]["reward"] = None
    with pytest.raises(ValueError, match="trajectory C: a turn without a reward"):
        build_pairs([bad], 0.9, "outcome", (-1.0, 0.0))


def rows_of(spec: dict[tuple[str, str], int]) -> list[dict]:
    """spec: (low|high, on-policy|hindsight) -> how many pairs."""
    out = []
    for (half, source), n in spec.items():
        out += [{"key": f"{half}{source}{i}", "target": 0.2 if half == "low" else 0.8, "source": source, "selected": False} for i in range(n)]
    return out


def chosen(rows):
    picked = [r for r in rows if r["selected"]]
    return {(h, s): sum((r["target"] < 0.5) == (h == "low") and r["source"] == s for r in picked) for h in ("low", "high") for s in ("on-policy", "hindsight")}


def test_balance_takes_on_policy_lows_first_and_alpha_of_the_highs_from_hindsight():
    rows = rows_of({("low", "on-policy"): 3, ("low", "hindsight"): 10, ("high", "on-policy"): 10, ("high", "hindsight"): 10})
    counts = select(rows, 10, 0.5, 0.4, seed=0)
    assert chosen(rows) == {("low", "on-policy"): 3, ("low", "hindsight"): 2, ("high", "on-policy"): 3, ("high", "hindsight"): 2}
    assert counts["selected"] == {"low": 5, "high": 5, "high_hindsight": 2} and not counts["cut_to_keep_share"]
    assert balance_note(counts, len(rows), 0.5) is None


def test_a_short_half_cuts_the_other_and_a_short_source_is_filled():
    rows = rows_of({("low", "on-policy"): 2, ("high", "on-policy"): 1, ("high", "hindsight"): 30})
    counts = select(rows, 20, 0.5, 0.4, seed=0)
    # 2 lows exist, so 2 highs: alpha would take 1 from hindsight, and on-policy has the other 1
    assert chosen(rows) == {("low", "on-policy"): 2, ("low", "hindsight"): 0, ("high", "on-policy"): 1, ("high", "hindsight"): 1}
    assert counts["cut_to_keep_share"]
    # the stage prints why so few were kept (persuasion's quick look: 4 of 145)
    assert balance_note(counts, len(rows), 0.5) == "4 of 33 pairs selected: the low half (target < 0.5) has 2, so the other half was cut to keep low_share = 0.5"
    rows = rows_of({("low", "on-policy"): 10, ("high", "on-policy"): 1, ("high", "hindsight"): 10})
    select(rows, 10, 0.5, 0.4, seed=0)
    assert chosen(rows)[("high", "hindsight")] == 4  # on-policy had one of its three: hindsight fills


def test_with_one_half_empty_the_pairs_are_drawn_unbalanced_and_it_is_said():
    rows = rows_of({("low", "on-policy"): 30, ("low", "hindsight"): 5})
    counts = select(rows, 20, 0.5, 0.4, seed=0)
    assert sum(r["selected"] for r in rows) == 20 and counts["unbalanced"] == "no pair in the high half"
    assert balance_note(counts, len(rows), 0.5) == "20 of 35 pairs selected without balance: no pair in the high half"


def test_selection_is_seeded():
    a, b = rows_of({("low", "on-policy"): 50, ("high", "on-policy"): 50}), rows_of({("low", "on-policy"): 50, ("high", "on-policy"): 50})
    select(a, 20, 0.5, None, seed=3)
    select(b, 20, 0.5, None, seed=3)
    assert [r["selected"] for r in a] == [r["selected"] for r in b] and sum(r["selected"] for r in a) == 20


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[Path]:
    d = tmp_path_factory.mktemp("buffer")
    table = data_scale._chunk(np.random.default_rng(3), 0, 120, 6)
    rows = table.to_pylist()
    rows[7]["messages"][-1]["content"] += " (edited)"  # its ID no longer matches: quarantined
    logged = [r for r in rows if r["source"] == "policy"]
    regen = [r for r in rows if r["source"] != "policy"]
    paths = [d / "collect.parquet", d / "regenerate.parquet"]
    write_table(pa.Table.from_pylist(logged, schema=table.schema), paths[0], "trajectories")
    write_table(pa.Table.from_pylist(regen, schema=table.schema), paths[1], "trajectories")
    return paths


def params(**buffer) -> Params:
    raw = tiny_params()
    raw.setdefault("buffer", {}).update(buffer)
    return Params.model_validate(raw)


def test_the_stage_writes_the_pairs_deterministically_and_quarantines_bad_rows(inputs, tmp_path):
    m = run_buffer(params(size=200), inputs, tmp_path / "a")
    run_buffer(params(size=200), inputs, tmp_path / "b")
    assert (tmp_path / "a/pairs.parquet").read_bytes() == (tmp_path / "b/pairs.parquet").read_bytes()
    assert sum(c["quarantined"] for c in m["inputs"].values()) == 1
    df = pl.read_parquet(tmp_path / "a/pairs.parquet")
    assert df["key"].n_unique() == df.height == m["pairs"]
    assert df["target"].is_between(0, 1).all()
    picked = df.filter("selected")
    assert picked.height == m["selection"]["selected"]["low"] + m["selection"]["selected"]["high"] <= 200
    assert (picked["target"] < 0.5).sum() == (picked["target"] >= 0.5).sum()
    train = {r["trajectory_id"] for p in inputs for r in pl.read_parquet(p).filter(pl.col("split") == "train").iter_rows(named=True)}
    behind = set(df["trajectory_ids"].explode())
    assert behind <= train and len(behind) == len(train) - 1  # buffer.splits: train; one quarantined


def test_alpha_zero_builds_the_buffer_from_logged_trajectories_alone(inputs, tmp_path):
    m = run_buffer(params(alpha=0.0), inputs, tmp_path)
    assert m["trajectories"]["hindsight"] == 0 and m["pairs_by_source"]["hindsight"] == 0
