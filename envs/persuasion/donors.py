"""Donor profiles (the tasks): HR's four personas, each donor with seeded traits.

HR simulates donors as one of four personalities (philanthropic, caring, unfriendly, skeptical)
and attributes its larger simulated gap to half of those users being hard to persuade. Here:
- val and test hold the four personas in equal numbers, so half their donors are unfriendly or
  skeptical (HR's evaluation mix);
- train leans receptive (35/35/15/15), as logged human dialogues do (HR: the user study had fewer
  skeptical users than the simulation), so hard donors are rare in the logged data, as HR found.

Every trait is drawn from a generator seeded by the donor's id, so the profiles are the same on
every machine and a new split size never changes an existing donor.
"""
from __future__ import annotations

import functools
import hashlib
import random
from dataclasses import dataclass

PERSONAS = ("philanthropic", "caring", "unfriendly", "skeptical")
SPLITS = ("train", "val", "test")
SIZES = {"train": 160, "val": 40, "test": 40}
MIX = {
    "train": {"philanthropic": 0.35, "caring": 0.35, "unfriendly": 0.15, "skeptical": 0.15},
    "val": dict.fromkeys(PERSONAS, 0.25),
    "test": dict.fromkeys(PERSONAS, 0.25),
}
CONCERNS = ("overhead", "scam", "impact")  # what a skeptical donor doubts; credibility or logic answers it

# Per persona: starting willingness (0..1), the most it would give ($), patience (turns before it
# tires of the talk), and how many refusals it takes before it leaves.
_W0 = {"philanthropic": (0.45, 0.65), "caring": (0.30, 0.45), "unfriendly": (0.00, 0.15), "skeptical": (0.10, 0.25)}
_CAP = {"philanthropic": (2.0,), "caring": (1.5, 2.0), "unfriendly": (1.0, 1.5), "skeptical": (1.0, 1.5, 2.0)}
_PATIENCE = {"philanthropic": (8, 10), "caring": (6, 9), "unfriendly": (3, 5), "skeptical": (5, 8)}
_REFUSALS = {"philanthropic": 3, "caring": 3, "unfriendly": 2, "skeptical": 3}


@dataclass(frozen=True)
class Donor:
    id: str  # the trajectory's task_id; says nothing of the persona
    split: str
    persona: str
    willingness: float  # where the donor starts, 0..1
    cap: float  # the most it would give, $ (the payment is $2)
    patience: int  # turns of talk before each further one tires it
    max_refusals: int  # refusals after which it leaves with no donation
    has_children: bool  # stories about children and family move it more
    knows_charity: bool  # it has heard of Save the Children
    concern: str | None  # a skeptical donor's doubt (CONCERNS); None for the others
    seed: int  # the donor's own randomness (its wording, the noise on each effect)

    @property
    def name(self) -> str:
        return self.id


def _rng(*parts: object) -> random.Random:
    return random.Random(int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "big"))


def _personas(split: str) -> list[str]:
    """The split's personas in a seeded order, in the split's mix (largest remainders)."""
    n, mix = SIZES[split], MIX[split]
    counts = {p: int(n * mix[p]) for p in PERSONAS}
    rest = sorted(PERSONAS, key=lambda p: -(n * mix[p] - counts[p]))
    for p in rest[: n - sum(counts.values())]:
        counts[p] += 1
    out = [p for p in PERSONAS for _ in range(counts[p])]
    _rng("order", split).shuffle(out)
    return out


def make_donor(split: str, index: int, persona: str) -> Donor:
    donor_id = f"donor-{split}-{index:03d}"
    r = _rng("donor", donor_id)
    return Donor(
        id=donor_id, split=split, persona=persona,
        willingness=round(r.uniform(*_W0[persona]), 3),
        cap=r.choice(_CAP[persona]),
        patience=r.randint(*_PATIENCE[persona]),
        max_refusals=_REFUSALS[persona],
        has_children=r.random() < 0.5,
        knows_charity=r.random() < 0.5,
        concern=r.choice(CONCERNS) if persona == "skeptical" else None,
        seed=r.getrandbits(32),
    )


@functools.cache
def load_donors() -> dict[str, Donor]:
    return {d.id: d for split in SPLITS for d in (make_donor(split, i, p) for i, p in enumerate(_personas(split)))}
