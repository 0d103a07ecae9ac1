"""tasks.plots.histogram on hand-counted values, from a list and from an array alike."""
import numpy as np
import pytest

from tasks.plots import histogram


@pytest.mark.parametrize("as_array", [False, True])
def test_histogram_bins_counts_and_leaves_out_what_is_not_a_number(as_array):
    values = [0.3, 0.25, 0.0, None, float("nan"), float("inf"), -0.05, 1.0]
    if as_array:
        values = np.array([np.nan if v is None else v for v in values])
    rows = histogram(values, "w", 0.1, 0.0, 1.0)
    assert [r["w"] for r in rows] == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    counts = {r["w"]: r["count"] for r in rows if r["count"]}
    # 0.3 / 0.1 is 2.9999...: bin 3; 0.25 half-way: up, to 0.3; -0.05 half-way: up, to 0.0
    assert counts == {0.0: 2, 0.3: 2, 1.0: 1}
    assert sum(r["share"] for r in rows) == pytest.approx(1.0) and rows[3]["share"] == 0.4


def test_histogram_widens_its_bins_past_max_bins_and_is_empty_without_values_or_range():
    rows = histogram(np.arange(0.0, 100.0), "x", 1.0, max_bins=60)
    assert len(rows) <= 60 and rows[1]["x"] - rows[0]["x"] == 2.0 and sum(r["count"] for r in rows) == 100
    assert histogram([], "x", 1.0) == [] and histogram(np.array([np.nan]), "x", 1.0) == []
    assert [r["count"] for r in histogram([], "x", 0.5, -0.5, 0.5)] == [0, 0, 0]
    with pytest.raises(ValueError, match="width must be > 0"):
        histogram([1.0], "x", 0.0)
