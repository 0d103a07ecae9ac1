"""The GuessMyCity cities, their names and splits (HOPE's lists, `data/cities.json`).

A task is one real city. The source lists two cities twice under different names: Madras and
Chennai (both train) and Bengaluru (train) and Bangalore (val), each entry naming the other as an
alias. Played as given, val would hold a city that train already teaches, so entries that share a
name are merged into one city: it keeps the id of its first entry in the order train, val, test
(so a duplicate always lands in the split that teaches it, never in a held-out one), takes every
entry's names, and the other entries are dropped, from the candidate list too. The splits
therefore hold 119 / 29 / 30 cities for the source's 120 / 30 / 30 entries, and are disjoint as
cities, not only as strings.

A name that still belongs to two different cities identifies neither: it stays with the city
whose own name it is ("Santiago" is the Chilean city, not an alias of Santiago de Cuba) and is
dropped where it is only an alias of several ("Puerto" for Puerto Montt and Puerto La Cruz).
"""
from __future__ import annotations

import functools
import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

DATA_PATH = Path(__file__).parent / "data" / "cities.json"
SPLITS = ("train", "val", "test")
# The source's entry counts; the merge above takes one duplicate from train and one from val.
SOURCE_COUNTS = {"train": 120, "val": 30, "test": 30}
EXPECTED_COUNTS = {"train": 119, "val": 29, "test": 30}


@dataclass(frozen=True)
class City:
    id: str  # "City, Country" as the source's first variant: the task id and the candidate shown
    name: str
    aliases: tuple[str, ...]
    country: str
    continent: str
    split: str

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def normalize(text: str) -> str:
    """Lower case, accents and punctuation gone, hyphens as spaces, single spaces: "São Paulo",
    "sao paulo" and "Sao-Paulo!" read alike, so a guess need not match the source's spelling of
    diacritics."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    text = re.sub(r"[-‐–—_/]", " ", text)
    text = re.sub(r"[^\w\s,']", "", text)
    return " ".join(text.split())


class CityError(ValueError):
    """cities.json is not what the game expects; the message says what."""


class Cities:
    def __init__(self, cities: list[City]):
        self.cities = tuple(cities)
        self._by_id = {c.id: c for c in self.cities}
        self._by_name = {normalize(n): c for c in self.cities for n in c.names}

    def split(self, name: str) -> list[City]:
        if name not in SPLITS:
            raise KeyError(f"unknown split {name!r}; expected one of {list(SPLITS)}")
        return [c for c in self.cities if c.split == name]

    def get(self, city_id: str) -> City:
        try:
            return self._by_id[city_id]
        except KeyError:
            raise KeyError(f"unknown city {city_id!r}") from None

    def named(self, text: str) -> City | None:
        """The city `text` names exactly, after normalize(): one of its names, optionally followed
        by ", <its country>". A name merely containing another ("Portoviejo", "Porto") is a
        different name."""
        key = normalize(text)
        if (city := self._by_name.get(key)) is not None:
            return city
        name, _, country = key.rpartition(",")
        city = self._by_name.get(name.strip())
        return city if city is not None and normalize(city.country) == country.strip() else None


def _merge(entries: list[dict]) -> list[City]:
    """Merge entries sharing a name into one city (module docstring); keep the source's order."""
    rank = {s: i for i, s in enumerate(SPLITS)}
    groups: list[list[dict]] = []
    for e in entries:
        names = {normalize(n) for n in (e["city"], *e["aliases"])}
        hits = [g for g in groups if any(normalize(n) in names for x in g for n in (x["city"], *x["aliases"]) if x["country"] == e["country"])]
        for g in hits[1:]:
            hits[0].extend(g)
            groups.remove(g)
        (hits[0].append(e) if hits else groups.append([e]))
    cities = []
    for group in sorted(groups, key=lambda g: min(x["default_index"] for x in g)):
        keep = min(group, key=lambda x: (rank[x["split"]], x["default_index"]))
        seen, names = set(), []
        for n in [keep["city"], *keep["aliases"], *(n for x in group if x is not keep for n in (x["city"], *x["aliases"]))]:
            if normalize(n) not in seen:
                seen.add(normalize(n))
                names.append(n)
        cities.append(City(keep["id"], names[0], tuple(names[1:]), keep["country"], keep["continent"], keep["split"]))
    return cities


def _unambiguous(cities: list[City]) -> list[City]:
    """Drop aliases that name more than one city (module docstring)."""
    owners: dict[str, set[str]] = {}
    for c in cities:
        for n in c.names:
            owners.setdefault(normalize(n), set()).add(c.id)
    own = [normalize(c.name) for c in cities]
    if len(set(own)) != len(own):
        raise CityError(f"two cities share a name: {sorted(n for n in set(own) if own.count(n) > 1)}")
    out = []
    for c in cities:
        aliases = tuple(a for a in c.aliases if len(owners[normalize(a)]) == 1)
        out.append(City(c.id, c.name, aliases, c.country, c.continent, c.split))
    return out


@functools.cache
def load_cities(path: Path = DATA_PATH) -> Cities:
    if not path.is_file():
        raise CityError(f"GuessMyCity data not found at {path}")
    entries = json.loads(path.read_text(encoding="utf-8"))["cities"]
    counts = {s: sum(e["split"] == s for e in entries) for s in SPLITS}
    if counts != SOURCE_COUNTS:
        raise CityError(f"{path}: split sizes {counts}, expected the source's {SOURCE_COUNTS}")
    cities = Cities(_unambiguous(_merge(entries)))
    counts = {s: len(cities.split(s)) for s in SPLITS}
    if counts != EXPECTED_COUNTS:
        raise CityError(f"{path}: after merging duplicate cities the splits hold {counts}, expected {EXPECTED_COUNTS}")
    return cities
