"""The dealership's car database: HOPE's five APIs over one inventory, and how results are shown.

- `search_car_by_brand_type(car_brand, car_type)`, `search_car_by_brand(car_brand)`,
  `search_car_by_type(car_type)`, `search_car_that_have_features(features_list)` (cars that have
  every listed feature, and maybe more; case-insensitive) and `no_op()`.
- Arguments are normalised as agent_prm does: a brand capitalised ("mercedes-benz" ->
  "Mercedes-benz", "BMW" -> "Bmw"), a type lower case except "SUV". A brand or type the
  database does not know finds nothing.
- Results are numbered lines with the car's brand, type, features, list price and the prices at
  2, 5, 8 and 10 % off. An empty result says so and forbids making a car up. A search that finds
  `cap` cars or more (the paper's 8) is "too broad": its cars are grouped by brand and type and at
  most max(1, cap // groups) random cars per group are shown, as agent_prm's max-car-8 runs do;
  where that would still show more than `cap` (a type search: 10 brands), `cap` random groups
  keep one car each, so the paper's "at most 8" holds. `cap=None` shows everything.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from .data import Car, Catalog, Inventory, all_cars

API_NAMES = ("search_car_by_brand_type", "search_car_by_brand", "search_car_by_type", "search_car_that_have_features", "no_op")
DISCOUNTS = (2, 5, 8, 10)  # percent; 10 is the most a seller may give
NOTHING_FOUND = "No cars found. YOU MUST NOT MAKE UP A CAR THAT IS NOT IN THE DATABASE."


def normalise_brand(text: str) -> str:
    return text.strip().lower().capitalize()


def normalise_type(text: str) -> str:
    t = " ".join(text.strip().lower().split())
    return "SUV" if t == "suv" else t


@dataclass(frozen=True)
class ApiCall:
    """One API call, arguments normalised; the ones its function does not take are empty."""

    name: str
    brand: str = ""
    type: str = ""
    features: tuple[str, ...] = ()

    @classmethod
    def make(cls, name: str, brand: str = "", car_type: str = "", features: tuple[str, ...] | list[str] = ()) -> ApiCall:
        """The call as the database runs it: an unknown name is a no_op, and only the function's
        own arguments are kept (search_car_by_brand ignores a type it was also given)."""
        if name not in API_NAMES or name == "no_op":
            return cls("no_op")
        return cls(
            name,
            normalise_brand(brand) if "brand" in name else "",
            normalise_type(car_type) if name in ("search_car_by_brand_type", "search_car_by_type") else "",
            tuple(" ".join(f.split()) for f in features) if name == "search_car_that_have_features" else (),
        )

    def arguments(self) -> dict[str, object]:
        """The function's JSON arguments, named as in the paper (car_brand, car_type, features_list)."""
        return {
            "search_car_by_brand_type": {"car_brand": self.brand, "car_type": self.type},
            "search_car_by_brand": {"car_brand": self.brand},
            "search_car_by_type": {"car_type": self.type},
            "search_car_that_have_features": {"features_list": list(self.features)},
            "no_op": {},
        }[self.name]

    def __str__(self) -> str:
        args = ", ".join(f"{k}={json.dumps(v)}" for k, v in self.arguments().items())
        return f"{self.name}({args})"


def search(call: ApiCall, inventory: Inventory) -> list[Car]:
    """The cars the call finds, in the inventory's order (brand, then type, then stock order)."""
    cars = all_cars(inventory)
    if call.name == "search_car_by_brand_type":
        return [c for c in cars if c.brand == call.brand and c.type == call.type]
    if call.name == "search_car_by_brand":
        return [c for c in cars if c.brand == call.brand]
    if call.name == "search_car_by_type":
        return [c for c in cars if c.type == call.type]
    if call.name == "search_car_that_have_features":
        wanted = {f.lower() for f in call.features}
        return [c for c in cars if wanted and wanted <= {f.lower() for f in c.features}] if call.features else []
    return []


def discounted(msrp: int, percent: int) -> int:
    """The price at `percent` off, rounded down as agent_prm shows it (integer arithmetic, so 10 %
    off is never a dollar under the 10 % limit through float rounding)."""
    return msrp * (100 - percent) // 100


def shown(cars: list[Car], cap: int | None, rng: random.Random) -> tuple[list[Car], bool]:
    """The cars a result displays and whether the search was too broad (module docstring)."""
    if cap is None or len(cars) < cap:
        return cars, False
    groups: dict[tuple[str, str], list[Car]] = {}
    for car in cars:
        groups.setdefault((car.brand, car.type), []).append(car)
    keys = list(groups)
    if len(keys) > cap:
        keep = set(rng.sample(keys, cap))
        keys = [k for k in keys if k in keep]
    per_group = max(1, cap // len(keys))
    out = []
    for k in keys:
        group = list(groups[k])
        rng.shuffle(group)
        out += group[:per_group]
    return out, True


def car_line(i: int, car: Car) -> str:
    prices = ", ".join(f"{p}% off=${discounted(car.msrp, p)}" for p in DISCOUNTS)
    return f"{i}. brand={car.brand}, type={car.type}, features={json.dumps(list(car.features))}, msrp=${car.msrp}, {prices}"


def display(cars: list[Car], too_broad: bool) -> str:
    if not cars:
        return NOTHING_FOUND
    head = [f"Your search may be too broad: only {len(cars)} of the cars found are shown."] if too_broad else []
    return "\n".join(head + [car_line(i + 1, c) for i, c in enumerate(cars)])


def tool_schemas(catalog: Catalog) -> list[dict]:
    """The APIs as JSON-schema tools, the form chat templates and TRL take (`tools=`)."""
    brand = {"type": "string", "enum": list(catalog.brands), "description": "a car brand"}
    car_type = {"type": "string", "enum": list(catalog.types), "description": "a car type"}
    features = {"type": "array", "items": {"type": "string", "enum": list(catalog.features)}, "description": "features every car found must have"}

    def tool(name: str, description: str, props: dict) -> dict:
        params = {"type": "object", "properties": props, "required": list(props)}
        return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}

    return [
        tool("search_car_by_brand_type", "Find the cars of one brand and type.", {"car_brand": brand, "car_type": car_type}),
        tool("search_car_by_brand", "Find the cars of one brand.", {"car_brand": brand}),
        tool("search_car_by_type", "Find the cars of one type.", {"car_type": car_type}),
        tool("search_car_that_have_features", "Find the cars that have all these features (and maybe more).", {"features_list": features}),
        tool("no_op", "Search nothing: keep the cars of the last search that found any.", {}),
    ]
