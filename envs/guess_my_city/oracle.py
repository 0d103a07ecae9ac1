"""The knowledge-base simulator: it answers open questions about the secret city from facts, and
"unknown" to any question outside its topics, where an LLM simulator would make something up.

Facts: continent and country come from cities.json; language, currency, time zone, hemisphere and
subregion are tabulated per country (data/countries.yaml, with per-city overrides); region in the
country, water, size, status, climate, landmark and food per city (data/facts.yaml). As in HOPE's
simulator prompt, no answer names the city or its country, and a request for either is refused.

Scripted players and the oracle roles reason over the same facts: one question per topic
(QUESTIONS, general to specific) and a short label per answer ("coastal", "speaks Spanish"),
the words a player's reason and the fact sheets use.
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


@dataclass(frozen=True)
class Question:
    topic: str
    level: int  # 0 where in the world, 1 what the country is like, 2 the city itself, 3 its one-off details
    text: str  # as a scripted player asks it (topic(text) == topic)
    about: str  # in a scripted player's reason: "Ask about the climate."


# General to specific, as a person narrowing down a place asks. The details (a landmark, a food)
# come last although each names one city: an answer a player can only use by having memorised
# that city's trivia, where a real simulator would often be vaguer than this knowledge base.
QUESTIONS = (
    Question("continent", 0, "What part of the world is it in?", "part of the world"),
    Question("hemisphere", 0, "Which hemisphere is it in?", "hemisphere"),
    Question("language", 1, "What language do people speak there?", "language"),
    Question("currency", 1, "What currency do people use?", "currency"),
    Question("time_zone", 1, "What time zone is it in?", "time zone"),
    Question("water", 2, "Does it lie on the sea, a river or a lake?", "water"),
    Question("size", 2, "How many people live there?", "size"),
    Question("status", 2, "Is it a national or regional capital?", "capital status"),
    Question("region", 2, "Where in the country is it?", "region"),
    Question("climate", 2, "What is the climate like?", "climate"),
    Question("landmark", 3, "What is it known for?", "landmark"),
    Question("food", 3, "What food is it known for?", "food"),
)


class Oracle:
    def __init__(self, cities: Cities, facts: dict[str, Facts]):
        missing = [c.id for c in cities.cities if c.id not in facts]
        if missing:
            raise ValueError(f"no facts for {missing}")
        self.cities, self.facts = cities, facts
        topics = [t for t, _ in TOPICS if t != "name"]
        self._said = {c.id: {t: render(t, facts[c.id]) for t in topics} for c in cities.cities}
        # Every answer the oracle gives, by topic, with its short label: an answer it never gives
        # (an LLM simulator's) tells a scripted player nothing.
        self.labels = {(t, said): label(t, facts[c.id]) for c in cities.cities for t, said in self._said[c.id].items()}

    def answer(self, city: City, question: str) -> str:
        t = topic(question)
        if t is None:
            return UNKNOWN
        if t == "name":
            return REFUSAL
        return self.says(city, t)

    def answers(self, city: City) -> dict[str, str]:
        """Every topic's answer for `city` (the name topic aside): what the oracle can tell."""
        return dict(self._said[city.id])

    def says(self, city: City, t: str) -> str:
        """The oracle's answer about `city` on topic `t` (not the name topic)."""
        return self._said[city.id][t]


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


SIZE_LABELS = {1: "under 300k people", 2: "300k-1M people", 3: "1-3M people", 4: "3-10M people", 5: "over 10M people"}
WATER_LABELS = {"coast": "coastal", "river": "on a river", "lake": "on a lake", "inland": "inland"}
STATUS_LABELS = {"capital": "national capital", "regional": "regional capital", "none": "not a capital"}


def label(t: str, f: Facts) -> str:
    """The short label of the answer on topic `t`: the words a reason lists ("in East Asia,
    speaks Korean, coastal") and a fact sheet states. A function of what the answer says."""
    return {
        "language": f"speaks {f.language}",
        "currency": f"pays in {f.currency}",
        "time_zone": f.time_zone,
        "hemisphere": f"{f.hemisphere} hemisphere" if f.hemisphere in ("northern", "southern") else "on the equator",
        "continent": f"in {f.subregion}",
        "food": f"serves {f.food}",
        "landmark": f"known for {f.landmark}",
        "climate": f"{f.climate} climate",
        "water": WATER_LABELS[f.water],
        "size": SIZE_LABELS[f.size],
        "status": STATUS_LABELS[f.status],
        "region": f"{f.region} of the country" if f.region in COMPASS else f.region,
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
