"""Standardization on hand-computed examples, std = 0 and m = 1 included."""
import math

import polars as pl
import pytest

from tasks.standardize import counts, standardize


def frame(groups: dict[str, list]) -> pl.DataFrame:
    rows = [{"env": "e", "task_id": t, "reward": r} for t, rs in groups.items() for r in rs]
    return pl.DataFrame(rows, schema={"env": pl.Utf8, "task_id": pl.Utf8, "reward": pl.Float64})


def z(df: pl.DataFrame, task: str) -> list:
    return df.filter(pl.col("task_id") == task)["standardized_reward"].to_list()


def test_per_context_uses_the_unbiased_std():
    # Rewards 1, 2, 3: mean 2, sample std sqrt(((1)^2 + 0 + 1^2) / 2) = 1 -> z = -1, 0, 1.
    # Rewards 0, 0, 3: mean 1, sample std sqrt((1 + 1 + 4) / 2) = sqrt(3).
    out = standardize(frame({"a": [1.0, 2.0, 3.0], "b": [0.0, 0.0, 3.0]}))
    assert z(out, "a") == pytest.approx([-1.0, 0.0, 1.0])
    s3 = math.sqrt(3)
    assert z(out, "b") == pytest.approx([-1 / s3, -1 / s3, 2 / s3])
    # With m = 3 every group's z sums to 0 and their squares to m - 1 = 2.
    assert sum(z(out, "b")) == pytest.approx(0.0)
    assert sum(v * v for v in z(out, "b")) == pytest.approx(2.0)


def test_tied_group_and_singleton_get_zero_weight_and_a_status():
    out = standardize(frame({"tied": [-20.0, -20.0, -20.0], "one": [-5.0], "ok": [-20.0, -8.0]}))
    assert z(out, "tied") == [0.0, 0.0, 0.0]
    assert z(out, "one") == [0.0]
    # Two rewards: mean -14, sample std sqrt(36 + 36) = 8.485 -> z = -/+ 1/sqrt(2).
    assert z(out, "ok") == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)])
    assert counts(out) == {"ok": 2, "singleton": 1, "tied": 3}


def test_missing_rewards_are_kept_and_left_out_of_the_statistics():
    out = standardize(frame({"a": [1.0, None, 3.0]}))
    assert z(out, "a")[1] is None
    assert z(out, "a")[0] == pytest.approx(-1 / math.sqrt(2))  # mean 2, std sqrt(2)
    assert out["group_size"].to_list() == [2, 2, 2]
    assert counts(out) == {"no_reward": 1, "ok": 2}
    assert out.height == 3  # nothing dropped


def test_global_and_min_max_modes():
    df = frame({"a": [0.0, 2.0], "b": [4.0]})
    g = standardize(df, mode="global")  # mean 2, sample std 2
    assert g["standardized_reward"].to_list() == pytest.approx([-1.0, 0.0, 1.0])
    mm = standardize(df, mode="min_max")
    assert mm["standardized_reward"].to_list() == pytest.approx([0.0, 0.5, 1.0])
    flat = standardize(frame({"a": [3.0, 3.0]}), mode="min_max")
    assert flat["standardized_reward"].to_list() == [0.0, 0.0]
    assert counts(flat) == {"tied": 2}


def test_clipping():
    out = standardize(frame({"a": [0.0, 0.0, 0.0, 0.0, 10.0]}), clip=1.0)
    values = z(out, "a")
    assert max(values) == 1.0 and min(values) == pytest.approx(-0.4472135955)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="no column 'score'"):
        standardize(frame({"a": [1.0]}), reward="score")
    with pytest.raises(ValueError, match="clip must be > 0"):
        standardize(frame({"a": [1.0]}), clip=0)
