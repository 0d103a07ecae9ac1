"""Scripted sellers that produce CarDealer demonstrations.

They see what a seller sees, never the buyer's profile: the buyer's words, the calls made and what
they found, the cars listed and their own offers. The expert reads the buyer's key sentences
(buyer.py keeps them fixed whatever the wording) and plays as HOPE's agent prompt asks:

- first turn: no search, ask what the buyer wants;
- search the brand and type of the buyer's ideal car; when the buyer says features matter, search
  its features one at a time until cars have enough of them (a search that finds nothing keeps the
  last list, and the expert keeps offering what it offered);
- offer the most expensive car that meets what the buyer asked, at list price; a discount only
  when asked, 2 % then 5, 8, 10; over budget, the car worth most that the budget buys within 10 %
  off (budget unknown: the cheapest at 10 % off); a distrustful buyer gets another car, and the
  one it will weigh (the third) is chosen to pass: the best within a known budget, or, when the
  buyer keeps its budget to itself, the cheapest at 10 % off.

The noisy seller is the expert with, per action, a random action (p_random), the same action as
its last one of that kind (p_repeat: a stalled search, an offer not moved) or, in a reply, a
discount past the 10 % limit (p_early_guess: the sale is then invalid). The random seller calls
random APIs and offers random listed cars at random allowed discounts.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Literal

from envs.base import check_noise

from .buyer import quoted_price
from .data import Car, Catalog
from .format import render_api, render_reply
from .game import Dealership
from .tools import API_NAMES, DISCOUNTS, ApiCall, discounted

GREETING = "Welcome to our dealership! What kind of car are you looking for?"
_BUDGET = re.compile(r"over my budget of \$([0-9][0-9,]*)")


@dataclass(frozen=True)
class Offer:
    car: Car | None
    price: int | None  # the price quoted, if any


@dataclass(frozen=True)
class SellerView:
    """What the seller has seen before its next action."""

    phase: Literal["api", "reply"]
    turn: int  # 0-based seller turn of the next action
    max_turns: int
    buyer_said: tuple[str, ...]  # the buyer's answers, in order
    calls: tuple[tuple[ApiCall, int], ...]  # every call and how many cars it found
    listing: tuple[Car, ...]  # the list a reply picks from (the last call that found cars)
    offers: tuple[Offer, ...]  # per reply, the car it picked and the price it quoted


def view(state: Dealership) -> SellerView:
    """What the seller has seen of a game (the database's lists and the buyer's words)."""
    return SellerView(
        phase=state.phase,
        turn=len(state.turns) - (state.phase == "reply"),
        max_turns=state.rules.max_turns,
        buyer_said=tuple(t.answer.answer for t in state.turns if t.answer is not None),
        calls=tuple((t.call, t.found) for t in state.turns),
        listing=state.listing.cars if state.listing else (),
        offers=tuple(Offer(t.car, quoted_price(t.reply.response)) for t in state.turns if t.reply is not None),
    )


@dataclass(frozen=True)
class Knowledge:
    """What the buyer's words established."""

    brand: str | None
    type: str | None
    features: tuple[str, ...]
    need: str | None  # brand_type | brand | type | features1 | features2
    budget: int | None


def learn(catalog: Catalog, said: tuple[str, ...]) -> Knowledge:
    first = said[0] if said else ""
    brand = next((b for b in catalog.brands if re.search(rf"\b{re.escape(b)}\b", first)), None)
    ctype = next((t for t in catalog.types if re.search(rf"\b{re.escape(t)}\b", first)), None)
    features = tuple(sorted((f for f in catalog.features if f in first), key=first.index))
    need, budget = None, None
    for text in said[1:]:
        if "of these features" in text:
            need = "features2" if "at least two" in text else "features1"
        elif "the type does not matter" in text:
            need = "brand"
        elif "the brand does not matter" in text:
            need = "type"
        elif "It has to be a" in text:
            need = "brand_type"
        if m := _BUDGET.search(text):
            budget = int(m.group(1).replace(",", ""))
    return Knowledge(brand, ctype, features, need, budget)


def meets(k: Knowledge, car: Car) -> bool:
    if k.need in ("features1", "features2"):
        return len(set(k.features) & set(car.features)) >= (1 if k.need == "features1" else 2)
    if k.need == "brand":
        return car.brand == k.brand
    if k.need == "type":
        return car.type == k.type
    return (car.brand, car.type) == (k.brand, k.type)


def within(car: Car, budget: int) -> int | None:
    """The highest price at most `budget` and at most 10 % off, or None."""
    price = min(car.msrp, budget)
    return price if price * 10 >= car.msrp * 9 else None


def describe(car: Car) -> str:
    extras = ", ".join(dict.fromkeys(car.features)) or "no extra features"
    return f"a {car.brand} {car.type} with {extras}"


class Expert:
    name = "expert"

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    def act(self, view: SellerView, rng: random.Random) -> str:
        k = learn(self.catalog, view.buyer_said)
        return self.api(view, k) if view.phase == "api" else self.reply(view, k)

    def api(self, view: SellerView, k: Knowledge) -> str:
        if not view.buyer_said or k.brand is None or k.type is None:
            return render_api("The buyer has not said what it wants yet.", ApiCall("no_op"))
        if any(meets(k, c) for c in view.listing):
            return render_api("The cars listed already meet the request.", ApiCall("no_op"))
        if k.need in ("features1", "features2"):
            tried = {f for call, _ in view.calls for f in call.features}
            todo = [f for f in k.features if f not in tried]
            if todo:
                return render_api(f"The buyer wants cars with its features; look for {todo[0]}.", ApiCall.make("search_car_that_have_features", features=[todo[0]]))
        call = ApiCall.make("search_car_by_brand_type", k.brand, k.type)
        if any(c == call for c, _ in view.calls):
            return render_api("Searching again would find the same cars.", ApiCall("no_op"))
        return render_api(f"The buyer wants a {k.brand} {k.type}; look it up.", call)

    def reply(self, view: SellerView, k: Knowledge) -> str:
        if not view.buyer_said:
            return render_reply("Nothing is known yet: ask the buyer.", GREETING, 0, None)
        last = view.offers[-1] if view.offers else Offer(None, None)
        said = view.buyer_said[-1]
        candidates = sorted((c for c in view.listing if meets(k, c)), key=lambda c: -c.msrp)
        if not candidates:
            if last.car is not None and last.car in view.listing:
                return self.offer(view, last.car, None, "Nothing listed fits yet; keep the offer while searching.", "Let me check what else we have for you.")
            return render_reply("Nothing listed fits yet.", "Let me check what else we have for you.", 0, None)
        proposed = {o.car.key for o in view.offers if o.car is not None}
        fresh = [c for c in candidates if c.key not in proposed] or candidates
        if "discount" in said and last.car is not None and last.car in candidates:
            given = [p for p in DISCOUNTS if last.price is not None and discounted(last.car.msrp, p) >= last.price]
            step = next((p for p in DISCOUNTS if p not in given), DISCOUNTS[-1])
            return self.offer(view, last.car, discounted(last.car.msrp, step), f"The buyer asked for a discount: offer {step}% off.", f"I can give you {step}% off:")
        if "Show me another car" in said and len(proposed) >= 2 and k.need in ("features1", "features2"):
            car, price = self.safe(fresh, k)
            return self.offer(view, car, price, "The buyer refuses the first cars and keeps its budget to itself: the third car must pass.", "Here is another option,")
        if "Show me another car" in said or "more expensive" in said:
            return self.offer(view, fresh[0], fresh[0].msrp, "The buyer wants another car: the most expensive one left.", "Here is another option,")
        if "over my budget" in said or "more than I want to pay" in said or k.budget is not None:
            car, price = self.safe(candidates, k)
            return self.offer(view, car, price, "The price is too high: the best car the budget buys.", "This one fits your budget:")
        return self.offer(view, candidates[0], candidates[0].msrp, "Offer the most expensive car that meets the request.", "I can offer you")

    def safe(self, cars: list[Car], k: Knowledge) -> tuple[Car, int]:
        """The car worth most that the known budget buys within 10 % off; with no known budget,
        the cheapest at 10 % off, which every buyer's budget was drawn to allow."""
        if k.budget is not None:
            fits = [(c, p) for c in cars if (p := within(c, k.budget)) is not None]
            if fits:
                return max(fits, key=lambda cp: cp[1] * cp[1] / cp[0].msrp)
        car = min(cars, key=lambda c: c.msrp)
        return car, discounted(car.msrp, 10)

    def offer(self, view: SellerView, car: Car, price: int | None, reason: str, lead: str) -> str:
        index = view.listing.index(car) + 1
        words = f"{lead} {describe(car)}" + (f" for ${price:,}." if price is not None else ".")
        return render_reply(reason, words, index, car)


class Noisy:
    name = "noisy"

    def __init__(self, catalog: Catalog, p_random: float, p_repeat: float, p_early_guess: float):
        check_noise(p_random, p_repeat, p_early_guess)
        self.p_random, self.p_repeat, self.p_early_guess = p_random, p_repeat, p_early_guess
        self.expert, self.random = Expert(catalog), Random(catalog)

    def act(self, view: SellerView, rng: random.Random) -> str:
        u = rng.random()
        if u < self.p_random:
            return self.random.act(view, rng)
        u -= self.p_random
        if u < self.p_repeat and view.phase == "api" and view.calls:
            return render_api("Search as before.", view.calls[-1][0])
        if u < self.p_repeat and view.phase == "reply" and view.offers and view.offers[-1].car in view.listing:
            last = view.offers[-1]
            return self.expert.offer(view, last.car, last.price, "Keep the offer.", "As I said,")
        u -= self.p_repeat
        if u < self.p_early_guess and view.phase == "reply" and view.listing and view.buyer_said:
            car = max(view.listing, key=lambda c: c.msrp)
            return self.expert.offer(view, car, discounted(car.msrp, 15), "Close the deal with a big discount.", "Special deal, 15% off:")
        return self.expert.act(view, rng)


class Random:
    name = "random"

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    def act(self, view: SellerView, rng: random.Random) -> str:
        c = self.catalog
        if view.phase == "api":
            name = rng.choice(API_NAMES)
            features = rng.sample(c.features, rng.randint(1, 2))
            return render_api("Try something.", ApiCall.make(name, rng.choice(c.brands), rng.choice(c.types), features))
        index = rng.randint(0, len(view.listing))
        if index == 0:
            return render_reply("Try something.", "What else can I tell you about our cars?", 0, None)
        car = view.listing[index - 1]
        price = discounted(car.msrp, rng.choice((0, *DISCOUNTS)))
        return render_reply("Try something.", f"How about {describe(car)} for ${price:,}?", index, car)
