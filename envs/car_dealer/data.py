"""The CarDealer data: catalogue, inventories, buyer types and buyer profiles (HOPE's, `data/`).

One task per buyer profile, id `{buyer_type}_{brand}_{car_type}_{budget}`. The splits are the
profiles' own: train 123 (buyer types 1-3 on 7 brands x {van, SUV, sedan}), val 36 (types 1-3 on
Kia, Mercedes-benz, Porsche x {truck, sports car}), test 35 (types 4-6 on those). agent_prm's
docstring says 126/36/36; equal budgets drawn twice for one buyer collapsed into one profile.

Inventories by buyer type, as agent_prm picks them: types 1 and 3 `car_inventory_dict_0` (train
features only, val games included), 4 and 6 `car_inventory_dict_1`. Types 2 and 5 get a dedicated
inventory per buyer brand and type, which the data do not carry (about 5,000 cars): it is generated
here by agent_prm's rule (`dedicated_inventory`), seeded by its key.

Every loader checks what it reads and raises DataError naming the file, the entry and the field.
"""
from __future__ import annotations

import functools
import hashlib
import json
import random
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data"
SPLITS = ("train", "val", "test")
EXPECTED_COUNTS = {"train": 123, "val": 36, "test": 35}
CARS_PER_GROUP = 4  # every brand/type of an inventory: a featureless base car first, then 3 more
PLANTED = {2: 1, 5: 2}  # buyer type -> how many of its features its dedicated inventory plants
INVENTORY_OF_TYPE = {1: "car_inventory_dict_0", 3: "car_inventory_dict_0", 4: "car_inventory_dict_1", 6: "car_inventory_dict_1"}


class DataError(ValueError):
    """A data file is not what the game expects; the message names the file, entry and field."""


@dataclass(frozen=True)
class Car:
    brand: str
    type: str
    features: tuple[str, ...]  # as stocked: order kept, duplicates too ("sunroof" twice happens)
    msrp: int

    @property
    def key(self) -> tuple[str, str, tuple[str, ...]]:
        """Identity as agent_prm compares cars: brand, type and sorted features (msrp follows)."""
        return self.brand, self.type, tuple(sorted(self.features))


@dataclass(frozen=True)
class Buyer:
    """A task: one buyer profile. `features` is the order the buyer names them in, shuffled once
    per buyer (seeded by its id; agent_prm shuffles them whenever it builds a game), so the stored
    order, planted features first, does not tell a seller which ones to search."""

    id: str
    split: str
    buyer_type: int
    brand: str
    type: str
    budget: int  # for type 6 the price a car must reach to count as expensive
    ideal_msrp: int  # the ideal car's price, which the no-sale penalty uses
    features: tuple[str, ...]
    planted: tuple[str, ...]  # types 2 and 5: the features only their dedicated inventory's planted cars carry


Inventory = dict[str, dict[str, list[Car]]]  # brand -> type -> cars


@dataclass(frozen=True)
class Catalog:
    brands: tuple[str, ...]
    types: tuple[str, ...]
    features: tuple[str, ...]  # distinct, in the catalogue's order
    pools: Mapping[str, list[str]]  # features_train, features_val_test as listed (sunroof is in both)
    base_msrp: Mapping[str, Mapping[str, int]]
    added_value: Mapping[str, int]
    splits: Mapping[str, Mapping[str, Any]]  # split -> buyer_types, brands, types, feature pool

    def msrp(self, brand: str, car_type: str, features: tuple[str, ...] | list[str]) -> int:
        """agent_prm's price rule: the brand/type's base price plus each feature's add-on."""
        return self.base_msrp[brand][car_type] + sum(self.added_value[f] for f in features)

    def feature_pool(self, split: str) -> list[str]:
        """The distinct features a split's cars are drawn from: train's alone, or every one."""
        train = list(dict.fromkeys(self.pools["features_train"]))
        return train if split == "train" else list(self.features)


def _read(name: str) -> dict:
    path = DATA / name
    if not path.is_file():
        raise DataError(f"CarDealer data not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None


def _need(obj: Mapping, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, Mapping) or key not in obj:
        raise DataError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise DataError(f"{where}.{key}: expected {getattr(kind, '__name__', kind)}, got {type(value).__name__} {value!r}")
    return value


@functools.cache
def load_catalog() -> Catalog:
    raw, f = _read("catalog.json"), "catalog.json"
    brands = tuple(_need(raw, "brands", list, f))
    types = tuple(_need(raw, "types", list, f))
    pools = {k: list(_need(raw, k, list, f)) for k in ("features_train", "features_val_test")}
    added = _need(raw, "feature_added_value", dict, f)
    base = _need(raw, "base_msrp_by_brand_and_type", dict, f)
    for b in brands:
        for t in types:
            if not isinstance(base.get(b, {}).get(t), int):
                raise DataError(f"{f}: base_msrp_by_brand_and_type has no price for {b} {t}")
    features = tuple(dict.fromkeys(pools["features_train"] + pools["features_val_test"]))
    for feat in features:
        if not isinstance(added.get(feat), int):
            raise DataError(f"{f}: feature_added_value has no price for {feat!r}")
    splits = _need(raw, "splits", dict, f)
    for s in SPLITS:
        entry = _need(splits, s, dict, f"{f}: splits")
        for key in ("buyer_types", "brands", "types"):
            _need(entry, key, list, f"{f}: splits.{s}")
        bad = [x for x in entry["brands"] if x not in brands] + [x for x in entry["types"] if x not in types]
        if bad:
            raise DataError(f"{f}: splits.{s} names unknown brands or types {bad}")
    return Catalog(brands, types, features, pools, base, added, splits)


@functools.cache
def load_inventories() -> dict[str, Inventory]:
    """The two shared inventories, each car's price checked against the catalogue's rule."""
    catalog, f = load_catalog(), "inventories.json"
    raw = _need(_read(f), "inventories", dict, f)
    out = {}
    for name in ("car_inventory_dict_0", "car_inventory_dict_1"):
        groups = _need(raw, name, dict, f"{f}: inventories")
        out[name] = _inventory(groups, catalog, f"{f}: {name}")
    return out


def _inventory(groups: Mapping, catalog: Catalog, where: str) -> Inventory:
    inv: Inventory = {}
    for brand, by_type in groups.items():
        if brand not in catalog.brands:
            raise DataError(f"{where}: unknown brand {brand!r}")
        for car_type, cars in by_type.items():
            at = f"{where}.{brand}.{car_type}"
            if car_type not in catalog.types:
                raise DataError(f"{where}.{brand}: unknown type {car_type!r}")
            if not isinstance(cars, list) or len(cars) < CARS_PER_GROUP:
                raise DataError(f"{at}: expected a list of at least {CARS_PER_GROUP} cars")
            parsed = []
            for i, car in enumerate(cars):
                feats = tuple(_need(car, "features", list, f"{at}[{i}]"))
                unknown = [x for x in feats if x not in catalog.added_value]
                if unknown:
                    raise DataError(f"{at}[{i}].features: unknown features {unknown}")
                msrp = _need(car, "msrp", int, f"{at}[{i}]")
                if msrp != catalog.msrp(brand, car_type, feats):
                    raise DataError(f"{at}[{i}].msrp: {msrp}, but base price plus features is {catalog.msrp(brand, car_type, feats)}")
                parsed.append(Car(brand, car_type, feats, msrp))
            if parsed[0].features:
                raise DataError(f"{at}[0]: the first car of a brand/type must be the featureless base car")
            inv.setdefault(brand, {})[car_type] = parsed
    return inv


@functools.cache
def load_buyers() -> tuple[Buyer, ...]:
    catalog, f = load_catalog(), "buyer_profiles.json"
    types = load_buyer_types()
    profiles = _need(_read(f), "profiles", list, f)
    buyers, seen = [], set()
    for i, p in enumerate(profiles):
        where = f"{f}: profiles[{i}]"
        game_id = _need(p, "game_id", str, where)
        where = f"{f}: profiles[{i}] ({game_id})"
        bt = _need(p, "buyer_type", int, where)
        split, brand, car_type = (_need(p, k, str, where) for k in ("split", "brand", "type"))
        budget, ideal = _need(p, "budget", int, where), _need(p, "ideal_msrp", int, where)
        feats = tuple(_need(p, "features", list, where))
        if bt not in types:
            raise DataError(f"{where}.buyer_type: {bt} is not one of {sorted(types)}")
        if split not in SPLITS or bt not in catalog.splits[split]["buyer_types"]:
            raise DataError(f"{where}.split: buyer type {bt} does not play in split {split!r}")
        if brand not in catalog.splits[split]["brands"] or car_type not in catalog.splits[split]["types"]:
            raise DataError(f"{where}: {brand} {car_type} is not one of split {split!r}'s brands and types")
        if game_id != f"{bt}_{brand}_{car_type}_{budget}":
            raise DataError(f"{where}.game_id: expected {bt}_{brand}_{car_type}_{budget}")
        if game_id in seen:
            raise DataError(f"{where}.game_id: duplicate")
        seen.add(game_id)
        unknown = [x for x in feats if x not in catalog.added_value]
        if unknown or not feats:
            raise DataError(f"{where}.features: {'unknown features ' + str(unknown) if unknown else 'empty'}")
        if budget <= 0 or ideal != catalog.msrp(brand, car_type, feats):
            raise DataError(f"{where}: budget {budget}, ideal_msrp {ideal} (base price plus features is {catalog.msrp(brand, car_type, feats)})")
        shown = list(feats)
        random.Random(_seed("features", game_id)).shuffle(shown)
        buyers.append(Buyer(game_id, split, bt, brand, car_type, budget, ideal, tuple(shown), feats[: PLANTED.get(bt, 0)]))
    counts = {s: sum(b.split == s for b in buyers) for s in SPLITS}
    if counts != EXPECTED_COUNTS:
        raise DataError(f"{f}: split sizes {counts}, expected {EXPECTED_COUNTS}")
    return tuple(buyers)


@functools.cache
def load_buyer_types() -> dict[int, dict]:
    """buyer_types.json by id: the rules' documentation, which buyer.py's rules are checked against."""
    f = "buyer_types.json"
    out = {}
    for i, t in enumerate(_need(_read(f), "types", list, f)):
        tid = _need(t, "id", int, f"{f}: types[{i}]")
        _need(t, "simulator_states", list, f"{f}: types[{i}]")
        out[tid] = t
    if sorted(out) != [1, 2, 3, 4, 5, 6]:
        raise DataError(f"{f}: buyer types {sorted(out)}, expected 1 to 6")
    return out


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "big")


def inventory_for(buyer: Buyer) -> Inventory:
    """The inventory the buyer's dealership searches (agent_prm's determine_car_inventory)."""
    if buyer.buyer_type in INVENTORY_OF_TYPE:
        return load_inventories()[INVENTORY_OF_TYPE[buyer.buyer_type]]
    return dedicated_inventory(buyer.buyer_type, buyer.brand, buyer.type)


@functools.cache
def dedicated_inventory(buyer_type: int, brand: str, car_type: str) -> Inventory:
    """A type-2 or type-5 buyer's own inventory, by agent_prm's generation rule: the split's
    brands x types (train: 7 x 3 with train features; val and test: 10 x 5 with every feature),
    each a base car and 3 cars of 1-4 features that none of the buyer's features are among; then
    the buyer's planted feature(s) (its first 1 or 2 stored features) go on 4-5 of those cars whose
    brand and type both differ from the buyer's, each with 0-2 extra features off the buyer's list.
    The buyers of that brand/type share one inventory, and agent_prm drew their budgets from
    [0.9 x cheapest planted car, median planted car]; a draw is kept once every budget lies there,
    so each buyer can be sold a planted car within the 10 % discount."""
    catalog = load_catalog()
    buyers = [b for b in load_buyers() if (b.buyer_type, b.brand, b.type) == (buyer_type, brand, car_type)]
    if buyer_type not in PLANTED or not buyers:
        raise KeyError(f"no type-{buyer_type} buyer wants a {brand} {car_type}")
    if len({b.planted for b in buyers}) != 1 or len({frozenset(b.features) for b in buyers}) != 1:
        raise DataError(f"buyer_profiles.json: the type-{buyer_type} {brand} {car_type} buyers do not share one feature list")
    split, planted, wanted = buyers[0].split, buyers[0].planted, set(buyers[0].features)
    brands, types = (catalog.splits["train"]["brands"], catalog.splits["train"]["types"]) if split == "train" else (catalog.brands, catalog.types)
    free = [f for f in catalog.feature_pool(split) if f not in wanted]
    rng = random.Random(_seed("inventory", buyer_type, brand, car_type))
    for _ in range(10_000):
        inv: Inventory = {
            b: {t: [Car(b, t, (), catalog.msrp(b, t, ()))] + [_car(catalog, b, t, rng.sample(free, rng.randint(1, 4))) for _ in range(CARS_PER_GROUP - 1)] for t in types}
            for b in brands
        }
        slots = [(b, t, i) for b in brands for t in types if b != brand and t != car_type for i in range(1, CARS_PER_GROUP)]
        prices = []
        for b, t, i in rng.sample(slots, rng.choice((4, 5))):
            inv[b][t][i] = _car(catalog, b, t, [*planted, *rng.sample(free, rng.randint(0, 2))])
            prices.append(inv[b][t][i].msrp)
        if all(0.9 * min(prices) <= x.budget <= statistics.median(prices) for x in buyers):
            return inv
    raise DataError(f"no inventory for the type-{buyer_type} {brand} {car_type} buyers fits their budgets")


def _car(catalog: Catalog, brand: str, car_type: str, features: list[str]) -> Car:
    return Car(brand, car_type, tuple(features), catalog.msrp(brand, car_type, features))


def all_cars(inv: Inventory) -> list[Car]:
    return [car for by_type in inv.values() for cars in by_type.values() for car in cars]
