"""Histograms for DVC plots: small JSON files of binned values, written by the stages.

A histogram is a list of rows {<field>: bin centre, "count": n, "share": n / total}, the format
`dvc plots` reads. Bins are `width` wide and centred on multiples of `width` (so integer returns
fall in the middle of unit bins, and an LLM labeler's float rewards land in the nearest one);
the range covers [lo, hi] when given, widened to take in every value, and the width grows when
there would be more than `max_bins` bins. Nulls, NaN and infinities are left out (the stages count
them in their metrics). The same values always give the same rows, in ascending bin order.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np


def _finite(values: Iterable[float | None] | np.ndarray) -> np.ndarray:
    if not isinstance(values, np.ndarray):  # a list may hold None: a float array of it cannot
        values = np.array([float(v) for v in values if v is not None], dtype=np.float64)
    values = values.astype(np.float64, copy=False)
    return values[np.isfinite(values)]


def histogram(
    values: Iterable[float | None] | np.ndarray,
    field: str,
    width: float,
    lo: float | None = None,
    hi: float | None = None,
    max_bins: int = 60,
) -> list[dict]:
    """Rows {field: centre, "count", "share"} over every bin of the range, empty bins included;
    [] when there is neither a value nor a range. Shares are rounded to 6 places."""
    if width <= 0:
        raise ValueError(f"histogram: width must be > 0, got {width}")
    xs = _finite(values)
    ends = [v for v in (lo, hi) if v is not None] + ([float(xs.min()), float(xs.max())] if len(xs) else [])
    if not ends:
        return []
    low, high = min(ends), max(ends)
    while True:
        # Bin k covers [(k - 0.5) * width, (k + 0.5) * width); half-way values go up.
        k_lo, k_hi = _bin(low, width), _bin(high, width)
        if k_hi - k_lo + 1 <= max_bins:
            break
        width *= 2
    # _bin over the array at once (the same float operations, so the same bins as one by one)
    keys, found = np.unique(np.floor(xs / width + 0.5 + 1e-9).astype(np.int64), return_counts=True)
    counts = dict(zip(keys.tolist(), found.tolist()))
    n = len(xs)
    return [
        {field: _round(k * width), "count": counts.get(k, 0), "share": round(counts.get(k, 0) / n, 6) if n else 0.0}
        for k in range(k_lo, k_hi + 1)
    ]


def _bin(x: float, width: float) -> int:
    return math.floor(x / width + 0.5 + 1e-9)  # the epsilon keeps 0.3 / 0.1 = 2.9999... in bin 3


def _round(x: float) -> float:
    x = round(x, 6)
    return 0.0 if x == 0 else x  # never -0.0


def write_plot(rows: list[dict], path: Path) -> None:
    """One plot file, in the layout the evaluate stage's plots use (a JSON list, indent 1)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")
