"""The knowledge-base simulator: it answers open questions about the secret city from facts, and
"unknown" to any question outside its topics, where an LLM simulator would make something up.

Facts: continent and country come from cities.json; language, currency, time zone, hemisphere and
subregion are tabulated per country (data/countries.yaml, with per-city overrides); region in the
country, water, size, status, climate, landmark and food per city (data/facts.yaml). As in HOPE's
simulator prompt, no answer names the city or its country, and a request for either is refused.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from .cities import Cities, City, normalize

DATA = Path(__file__).parent / "data"
UNKNOWN = "unknown"
REFUSAL = "I can't tell you the name of the city or of its country; ask about something else."
COMPASS = {"north", "south", "east", "west", "centre", "north-east", "north-west", "south-east", "south-west",
           "centre-west", "centre-east", "north-centre", "far north", "far east", "far west"}
SIZES = {1: "a smaller city of under 300,000 people", 2: "a mid-sized city of 300,000 to 1 million people",
         3: "a large city of 1 to 3 million people", 4: "a very large city of 3 to 10 million people",
         5: "a megacity of over 10 million people"}
WATER = {"coast": "It lies on the sea coast.", "river": "It lies inland, on a major river.",
         "lake": "It lies on the shore of a large lake.", "inland": "It lies inland, away from the sea and any large lake."}
STATUS = {"capital": "It is the national capital.", "regional": "It is not the national capital, but it is the capital of its province or region.",
          "none": "It is neither the national capital nor a regional capital."}


@dataclass(frozen=True)
class Facts:
    continent: str
    subregion: str
    hemisphere: str
    language: str
    currency: str
    time_zone: str
    region: str
    water: str
    size: int
    status: str
    climate: str
    landmark: str
    food: str


# (topic, pattern over normalize()d text); the first match answers, so the more specific come first.
TOPICS = [
    ("name", r"\b(name|called|which city|what city|which country|what country|spell)\b"),
    ("language", r"\b(language|languages|speak|spoken|dialect)\b"),
    ("currency", r"\b(currency|money|pay|cash)\b"),
    ("time_zone", r"\b(time zone|timezone|utc|gmt|what time)\b"),
    ("hemisphere", r"\b(hemisphere|equator)\b"),
    ("continent", r"\b(continent|part of the world|region of the world|where in the world)\b"),
    ("food", r"\b(food|dish|dishes|eat|eats|cuisine|drink|speciality|specialty)\b"),
    ("landmark", r"\b(landmark|landmarks|monument|famous|known for|sight|sights|tourist|tourists|attraction|attractions|visit)\b"),
    ("climate", r"\b(climate|weather|temperature|rain|hot|cold|season|seasons|warm)\b"),
    ("water", r"\b(coast|coastal|sea|ocean|beach|river|lake|water|port)\b"),
    ("size", r"\b(population|big|size|large|small|people live|inhabitants|populous)\b"),
    ("status", r"\b(capital)\b"),
    ("region", r"\b(where in the country|part of the country|region|located|location)\b"),
]
_TOPICS = [(name, re.compile(p)) for name, p in TOPICS]


def topic(question: str) -> str | None:
    q = normalize(question)
    return next((name for name, p in _TOPICS if p.search(q)), None)


class Oracle:
    def __init__(self, cities: Cities, facts: dict[str, Facts]):
        missing = [c.id for c in cities.cities if c.id not in facts]
        if missing:
            raise ValueError(f"no facts for {missing}")
        self.cities, self.facts = cities, facts

    def answer(self, city: City, question: str) -> str:
        t = topic(question)
        if t is None:
            return UNKNOWN
        if t == "name":
            return REFUSAL
        return render(t, self.facts[city.id])

    def answers(self, city: City) -> dict[str, str]:
        """Every topic's answer for `city` (the name topic aside): what the oracle can tell."""
        return {t: render(t, self.facts[city.id]) for t, _ in TOPICS if t != "name"}


def render(t: str, f: Facts) -> str:
    region = f"the {f.region} of the country" if f.region in COMPASS else f.region
    return {
        "language": f"People there mainly speak {f.language}.",
        "currency": f"People pay with {f.currency}.",
        "time_zone": f"Its time zone is {f.time_zone}.",
        "hemisphere": f"It is in the {f.hemisphere} hemisphere." if f.hemisphere in ("northern", "southern") else f"It lies {f.hemisphere}.",
        "continent": f"It is in {f.continent}, in {f.subregion}.",
        "food": f"A local speciality is {f.food}.",
        "landmark": f"It is known for {f.landmark}.",
        "climate": f"Its climate is {f.climate}.",
        "water": WATER[f.water],
        "size": f"It is {SIZES[f.size]}.",
        "status": STATUS[f.status],
        "region": f"It lies in {region}.",
    }[t]


@functools.cache
def load_oracle(cities: Cities) -> Oracle:
    countries = yaml.safe_load((DATA / "countries.yaml").read_text(encoding="utf-8"))
    data = yaml.safe_load((DATA / "facts.yaml").read_text(encoding="utf-8"))
    facts = {}
    for city_id, row in data["cities"].items():
        city = cities.get(city_id)  # KeyError names a city facts.yaml has but the list lacks
        region, water, size, status, climate, landmark, food = row
        if water not in WATER or size not in SIZES or status not in STATUS:
            raise ValueError(f"facts.yaml: {city_id}: bad water/size/status {water!r}/{size!r}/{status!r}")
        country = {**countries[city.country], **data["overrides"].get(city_id, {})}
        facts[city_id] = Facts(city.continent, country["subregion"], country["hemisphere"], country["language"], country["currency"],
                               country["time_zone"], region, water, size, status, climate, landmark, food)
    return Oracle(cities, facts)
