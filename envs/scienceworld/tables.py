"""ScienceWorld's two committed tables, read without a JVM: each task type's variations per split
(data/variations.json, written by `python -m envs.scienceworld.variations`) and the gold paths of
the default task types (data/gold_paths.json, written by `python -m envs.scienceworld.gold`)."""
from __future__ import annotations

import functools
import json
from pathlib import Path

VARIATIONS = Path(__file__).parent / "data" / "variations.json"
SPLITS = {"train": "train", "val": "dev", "test": "test"}  # ours -> the simulator's
# The task types a tiny model can start on: the shortest gold paths (5 to 10 actions),
# observations under 180 words, and 62 to 150 train variations each (notes/scienceworld.md).
DEFAULT_TASK_TYPES = (
    "find-animal", "find-living-thing", "find-non-living-thing", "find-plant",
    "lifespan-longest-lived", "lifespan-longest-lived-then-shortest-lived", "lifespan-shortest-lived",
)


def runs(values: list[int]) -> list[list[int]]:
    """[start, stop) runs of sorted integers: [0..149] is [[0, 150]]."""
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][1] == v:
            out[-1][1] = v + 1
        else:
            out.append([v, v + 1])
    return out


def expand(r: list[list[int]]) -> list[int]:
    return [v for start, stop in r for v in range(start, stop)]


@functools.cache
def table() -> dict[str, dict[str, tuple[int, ...]]]:
    """{task type: {our split: variations}}, in the simulator's order of task types."""
    raw = json.loads(VARIATIONS.read_text())["task_types"]
    return {t: {ours: tuple(expand(splits[theirs])) for ours, theirs in SPLITS.items()} for t, splits in raw.items()}


def task_types() -> list[str]:
    return list(table())


GOLD = Path(__file__).parent / "data" / "gold_paths.json"


@functools.cache
def gold_table() -> dict:
    return json.loads(GOLD.read_text()) if GOLD.exists() else {"simplifications": None, "paths": {}}


def stored(task_type: str, variation: int, simplifications: str) -> list[str] | None:
    """The stored gold path, or None where the table has none (then the simulator generates it)."""
    t = gold_table()
    if t["simplifications"] != simplifications:
        return None
    path = t["paths"].get(f"{task_type}-{variation}")
    return list(path) if path is not None else None


