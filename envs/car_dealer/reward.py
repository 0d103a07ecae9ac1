"""CarDealer's reward and success, by the paper (HOPE App. I.1) or by agent_prm's code.

Every turn but the last scores 0. The last one, by `rule`:

| ending | paper (default) | code (`compute_reward`, env.py) |
| --- | --- | --- |
| buyer accepts car c at price p | valid sale: p^2 / (budget x msrp_c), success; invalid: 0, no success | V_car x V_offer x S x p^2 / (budget x msrp_c), success = S |
| - invalid: c not in the database (the copied details match no car) | 0, no success | V_car = 0, success = S still |
| - invalid: over 10 % off (p < 0.9 msrp_c) | 0, no success | V_offer = 0.5 |
| - invalid: c misses the buyer's constraints (S = 0) | 0, no success | 0, no success |
| buyer accepts with no car proposed | nothing bought: the penalty | 0 |
| buyer rejects | the penalty | the penalty; 0 with no car proposed |
| turns run out | the penalty | 0 |

The penalty is -(budget - msrp) / msrp with the msrp of the buyer's ideal car (the paper leaves
"market price" open; agent_prm uses the ideal car). It is positive for the buyers whose budget is
below their ideal car's price, as in both. S is the buyer type's condition (buyer.py): the must-
match, the price rule at p, and for types 3 and 5 more than one car proposed, for type 4 at most 6
negotiations.

One bound of our own: p counts at most at the car's list price. A buyer may agree to any price
the seller names (an LLM buyer writes its own), and p^2 / (budget x msrp) grows without limit
above it; Refit's weight needs a bounded reward range (`reward_range`).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from .buyer import DISTRUST, MAX_NEGOTIATIONS, MIN_FEATURES, PRICE_SLACK, Counters
from .data import Buyer, Car, Inventory, all_cars

Rule = Literal["paper", "code"]


@dataclass(frozen=True)
class Outcome:
    reward: float
    success: bool
    reason: str  # what made the sale fail, or how the game ended


def penalty(buyer: Buyer) -> float:
    return -(buyer.budget - buyer.ideal_msrp) / buyer.ideal_msrp


def in_database(copied: Car | None, inventory: Inventory) -> bool:
    """agent_prm's check of the copied details: a car of that brand and type with exactly those features."""
    return copied is not None and any(c.key == copied.key for c in inventory.get(copied.brand, {}).get(copied.type, []))


def mismatch(buyer: Buyer, car: Car) -> list[str]:
    """How the car misses the buyer type's must-match (empty: it matches)."""
    t = buyer.buyer_type
    if t in (1, 3) and (car.brand, car.type) != (buyer.brand, buyer.type):
        return [f"the car is not a {buyer.brand} {buyer.type}"]
    if t == 4 and car.brand != buyer.brand:
        return [f"the car is not a {buyer.brand}"]
    if t == 6 and car.type != buyer.type:
        return [f"the car is not a {buyer.type}"]
    if t in MIN_FEATURES and len(set(buyer.features) & set(car.features)) < MIN_FEATURES[t]:
        return [f"the car has fewer than {MIN_FEATURES[t]} of the buyer's features"]
    return []


def price_problems(buyer: Buyer, car: Car, price: int) -> list[str]:
    t = buyer.buyer_type
    if t == 1 and price >= car.msrp:
        return ["no discount was given"]
    if t in (2, 5) and price > buyer.budget:
        return [f"${price} is over the budget of ${buyer.budget}"]
    if t in PRICE_SLACK and price > buyer.budget + PRICE_SLACK[t]:
        return [f"${price} is over what the buyer accepts (${buyer.budget + PRICE_SLACK[t]})"]
    if t == 6 and price < buyer.budget:
        return [f"${price} is under the buyer's threshold of ${buyer.budget}"]
    return []


def unmet(buyer: Buyer, car: Car, price: int, counters: Counters) -> list[str]:
    """The buyer's conditions the sale misses (empty: S = 1)."""
    out = mismatch(buyer, car) + price_problems(buyer, car, price)
    if buyer.buyer_type in DISTRUST and counters.cars_proposed <= 1:
        out.append("only one car was proposed")
    if buyer.buyer_type == 4 and counters.negotiations > MAX_NEGOTIATIONS[4]:
        out.append(f"{counters.negotiations} negotiations, over {MAX_NEGOTIATIONS[4]}")
    return out


def over_discount(car: Car, price: int) -> bool:
    return price * 10 < car.msrp * 9  # more than 10 % off, in integers


def sale_value(buyer: Buyer, car: Car, price: int) -> float:
    p = min(price, car.msrp)
    return p * p / (buyer.budget * car.msrp)


def sale(buyer: Buyer, car: Car | None, copied: Car | None, price: int, counters: Counters, inventory: Inventory, rule: Rule) -> Outcome:
    """The buyer accepted at `price` the car the reply picked (None: none was picked)."""
    if car is None:
        return no_sale(buyer, car, rule, "the buyer accepted, but no car was proposed")
    failures = unmet(buyer, car, price, counters)
    satisfied = not failures
    if not in_database(copied, inventory):
        failures.append("the car the seller wrote down is not in the database")
    if over_discount(car, price):
        failures.append(f"${price} is more than 10% off ${car.msrp}")
    if rule == "paper":
        if failures:
            return Outcome(0.0, False, "invalid sale: " + "; ".join(failures))
        return Outcome(sale_value(buyer, car, price), True, f"sold the {car.brand} {car.type} for ${price}")
    v_car = 1.0 if in_database(copied, inventory) else 0.0
    v_offer = 0.5 if over_discount(car, price) else 1.0
    reward = v_car * v_offer * float(satisfied) * sale_value(buyer, car, price)
    return Outcome(reward, satisfied, "; ".join(failures) or f"sold the {car.brand} {car.type} for ${price}")


def no_sale(buyer: Buyer, car: Car | None, rule: Rule, why: str, timeout: bool = False) -> Outcome:
    """Nothing was bought: the buyer rejected (or accepted nothing), or the turns ran out."""
    if rule == "code" and (timeout or car is None):
        return Outcome(0.0, False, why)
    return Outcome(penalty(buyer), False, why)


def best_sale(buyer: Buyer, inventory: Inventory) -> float:
    """The highest reward a valid sale to this buyer can earn: over the cars meeting its
    must-match, at the highest price in [90 % of list, list] its price rule allows."""
    best = 0.0
    for car in all_cars(inventory):
        low, high = -(-car.msrp * 9 // 10), car.msrp
        if buyer.buyer_type == 1:
            high = car.msrp - 1  # it buys only at a discount
        elif buyer.buyer_type in (2, 5):
            high = min(high, buyer.budget)
        elif buyer.buyer_type in PRICE_SLACK:
            high = min(high, buyer.budget + PRICE_SLACK[buyer.buyer_type])
        else:
            low = max(low, buyer.budget)
        if low <= high and not mismatch(buyer, car):
            best = max(best, sale_value(buyer, car, high))
    return best


def sale_threshold(buyers: Iterable[Buyer]) -> float:
    """The return above which a game surely ended in a sale. The no-sale penalty is positive for
    the buyers whose budget is under their ideal car's price (up to +0.81 here), and valid sales
    earn from about 0.3, so the two overlap: a return above the largest penalty reads as a sale,
    one below it as no sale, which misreads the cheapest sales rather than any failure."""
    return max([0.0, *(penalty(b) for b in buyers)])


def reward_range(buyers: Iterable[tuple[Buyer, Inventory]]) -> tuple[float, float]:
    """The lowest and highest return over the buyers: every penalty, 0, and every best sale."""
    values = [0.0]
    for buyer, inventory in buyers:
        values += [penalty(buyer), best_sale(buyer, inventory)]
    return min(values), max(values)
