"""A rubric judge's reply read as scores: one `Criterion: n` line per criterion, 0 to 10.

Each environment names its own criteria (the last is Overall); the reading is shared."""
from __future__ import annotations

import re


class Rubric:
    def __init__(self, criteria: tuple[str, ...]):
        self.criteria = criteria
        names = "|".join(map(re.escape, criteria))
        # "Progress: 6", "**Progress**: 6", "Progress: **6**", "2. Progress: 6", "- Progress: [6]"
        # (a list item; the score in the brackets of Refit's format line); case-insensitive, one per line.
        self._line = re.compile(r"^\s*(?:\d+[.)]\s*|[-*]\s+)?\**\s*(%s)\s*\**\s*:\s*\**\s*\[?\s*(-?\d+(?:\.\d+)?)" % names, re.I | re.M)

    def parse(self, text: str) -> dict[str, float]:
        """Every criterion's score, Overall included. Overall is read, never recomputed: a judge's
        holistic score need not be the mean of the others. The first score of a label wins."""
        scores: dict[str, float] = {}
        for name, value in self._line.findall(text):
            scores.setdefault(next(c for c in self.criteria if c.lower() == name.lower()), float(value))
        missing = [c for c in self.criteria if c not in scores]
        if missing:
            raise ValueError(f"missing scores: {', '.join(missing)}")
        bad = {k: v for k, v in scores.items() if not 0 <= v <= 10}
        if bad:
            raise ValueError("scores outside 0..10: " + ", ".join(f"{k} {v:g}" for k, v in bad.items()))
        return scores
