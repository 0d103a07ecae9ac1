"""The buyer: HOPE's state machine per buyer type (agent_prm data.py@d1352597, env.py), the oracle
buyer that answers from it, and what an LLM buyer is told and how its reply is read.

Every seller reply puts the buyer in one state ("mode"), computed from the profile, the car the
reply picked, the price it quoted and two counters (notes/envs-wave2.md 2.3-2.4):
- the price checked is the lowest "$N" in the seller's message, else the car's list price;
- a car different from last reply's (brand, type, sorted features) adds one to the cars proposed
  and to the negotiations; the same car quoted below list price adds one negotiation; dropping to
  no car after a car counts as a new car;
- the first reply of a game is always `initial`: the buyer describes its ideal car.

| type | must match | price rule | patience, distrust |
| 1 | brand and type | a quoted discount (budget never checked) | - |
| 2 | >= 1 of its features | <= budget | more than 6 negotiations: rejects |
| 3 | brand and type | <= budget + 3,000 | refuses until more than 2 cars were proposed |
| 4 | brand | <= budget + 4,000 | more than 6 negotiations: rejects |
| 5 | >= 2 of its features | <= budget | refuses until more than 2 cars were proposed |
| 6 | type | >= budget (its "expensive" threshold) | more than 2 cars proposed: rejects |

In `condition_met` the buyer buys at the price checked, in `exceed_*` it rejects, otherwise it
negotiates. agent_prm's type 6 falls to `condition_met` also when neither type nor price fits
(and so "buys" when no car was proposed); `type6_quirk=False` (the default) sends that case to
`car_proposed`, the state its strategy text describes, and the buyer negotiates.

The oracle's words vary with a seeded rng, its decisions never: each answer carries the state's
fixed key sentence ("It has to be a Kia truck.", "That is over my budget of $41,000.") so what a
seller can learn is the same whatever the wording.
"""
from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from .data import Buyer, Car, DataError, load_buyer_types

MAX_NEGOTIATIONS = {2: 6, 4: 6}
PRICE_SLACK = {3: 3000, 4: 4000}  # dollars above budget the buyer still pays (never says so)
DISTRUST = {3: 2, 5: 2}  # refuses every car until more than this many were proposed
MAX_CARS = {6: 2}
MIN_FEATURES = {2: 1, 5: 2}
STATES = {
    1: ("initial", "car_proposed", "matched_but_need_discount", "discount_given_but_not_matched", "condition_met"),
    2: ("initial", "car_proposed", "matched_but_not_under_budget", "under_budget_but_not_matched", "condition_met", "exceed_negotation_limit"),
    3: ("initial", "initial_car_proposed", "acceptable_car_proposed", "matched_but_not_under_budget", "under_budget_but_not_matched", "condition_met"),
    4: ("initial", "car_proposed", "matched_but_not_under_budget", "under_budget_but_not_matched", "condition_met", "exceed_negotation_limit"),
    5: ("initial", "initial_car_proposed", "acceptable_car_proposed", "matched_but_not_under_budget", "under_budget_but_not_matched", "condition_met"),
    6: ("initial", "car_proposed", "matched_but_not_expensive", "expensive_but_not_matched", "condition_met", "exceed_car_limit"),
}
COULD_NOT_RESPOND = "Something went wrong on the buyer's side, so the buyer could not respond. Please wait."
Decision = Literal["negotiate", "accept", "reject"]
_DOLLARS = re.compile(r"\$\s*([0-9][0-9,]*)")
_DECISION = re.compile(r"\bDecision\s*=\s*(Negotiate|Accept|Reject)[,]*\s+Buy_Price\s*=\s*\$\s*([0-9][0-9,]*)", re.I)


@dataclass(frozen=True)
class Counters:
    cars_proposed: int = 0
    negotiations: int = 0


@dataclass(frozen=True)
class BuyerReply:
    """The buyer's turn: its words and decision (None: no decision could be read, the game goes on)."""

    answer: str
    decision: Decision | None = "negotiate"
    price: int = 0  # the agreed price when it accepts
    reason: str = ""  # an LLM buyer's reasoning; never shown to the seller

    def decision_line(self) -> str:
        """HOPE's decision format, which the seller sees when the buyer ends the game."""
        return f"Decision={self.decision.capitalize()}, Buy_Price=${self.price}" if self.decision in ("accept", "reject") else ""

    def observation(self) -> str:
        return "\n".join(x for x in (self.answer, self.decision_line()) if x)


def read_observation(text: str) -> BuyerReply:
    """A logged buyer turn back as a reply: the words and, if the game ended there, its decision."""
    lines = text.rstrip().split("\n")
    m = _DECISION.search(lines[-1]) if lines else None
    if m is None:
        return BuyerReply(text, "negotiate")
    return BuyerReply("\n".join(lines[:-1]), m.group(1).lower(), int(m.group(2).replace(",", "")))  # type: ignore[arg-type]


def quoted_price(message: str) -> int | None:
    """The lowest dollar amount in a seller's message, or None."""
    prices = [int(p.replace(",", "")) for p in _DOLLARS.findall(message)]
    return min(prices) if prices else None


def price_checked(message: str, car: Car | None) -> int:
    q = quoted_price(message)
    return q if q is not None else (car.msrp if car else 0)


def same_car(a: Car | None, b: Car | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and a.key == b.key)


def count(counters: Counters, previous: Car | None, car: Car | None, message: str) -> Counters:
    """The counters after a reply that picked `car`, the last reply having picked `previous`."""
    if not same_car(previous, car):
        return Counters(counters.cars_proposed + 1, counters.negotiations + 1)
    if car is not None and (q := quoted_price(message)) is not None and q < car.msrp:
        return replace(counters, negotiations=counters.negotiations + 1)
    return counters


@dataclass(frozen=True)
class Situation:
    """What the buyer makes of one seller reply: the state and the checks behind it."""

    mode: str
    car: Car | None
    price: int  # the price checked
    counters: Counters
    matched: bool  # the type's must-match condition holds
    price_ok: bool  # the type's price condition holds (type 1: a discount was quoted)
    checks: tuple[tuple[str, str], ...]  # (question, answer) lines an LLM buyer is shown


def features_matched(buyer: Buyer, car: Car | None) -> list[str]:
    return [f for f in buyer.features if car is not None and f in car.features]


def situate(buyer: Buyer, first: bool, car: Car | None, message: str, counters: Counters, type6_quirk: bool = False) -> Situation:
    """The buyer's state after a reply picking `car` with `message`, the counters already counted."""
    t, price = buyer.buyer_type, price_checked(message, car)
    brand = car is not None and car.brand == buyer.brand
    ctype = car is not None and car.type == buyer.type
    have = features_matched(buyer, car)
    checks: list[tuple[str, str]] = []
    none = "The seller has not offered a car yet."

    def ask(question: str, ok: bool, yes: str, no: str) -> bool:
        checks.append((question, none if car is None else ("Yes. " + yes if ok else "No. " + no)))
        return ok

    if t in (1, 3):
        matched = ask("Is the car the brand you want?", brand, f"It is a {buyer.brand}.", f"It is a {car.brand if car else ''}, not a {buyer.brand}.") & \
            ask("Is the car the type you want?", ctype, f"It is a {buyer.type}.", f"It is a {car.type if car else ''}, not a {buyer.type}.")
    elif t == 4:
        matched = ask("Is the car the brand you want?", brand, f"It is a {buyer.brand}.", f"It is a {car.brand if car else ''}, not a {buyer.brand}.")
    elif t == 6:
        matched = ask("Is the car the type you want?", ctype, f"It is a {buyer.type}.", f"It is a {car.type if car else ''}, not a {buyer.type}.")
    else:
        n = MIN_FEATURES[t]
        matched = ask(f"Does the car have at least {n} of your features?", len(set(have)) >= n, f"It has {', '.join(have)}.", f"It has {len(set(have))} of them.")
    if t == 1:
        price_ok = ask("Has the seller offered a discount?", car is not None and price < car.msrp, f"${price} instead of ${car.msrp if car else 0}.", f"The car is priced at ${price}.")
    elif t in (2, 5):
        price_ok = ask("Is the price within your budget?", car is not None and price <= buyer.budget, f"${price} is within ${buyer.budget}.", f"${price} is over ${buyer.budget}.")
    elif t in (3, 4):
        limit = buyer.budget + PRICE_SLACK[t]
        price_ok = ask("Is the price within the range you accept?", car is not None and price <= limit, f"${price} is at most ${limit}.", f"${price} is over ${limit}.")
    else:
        price_ok = ask("Is the car expensive enough?", car is not None and price >= buyer.budget, f"${price} is at least ${buyer.budget}.", f"${price} is under ${buyer.budget}.")

    if first:
        mode = "initial"
    elif t == 1:
        mode = {(True, True): "condition_met", (True, False): "matched_but_need_discount", (False, True): "discount_given_but_not_matched"}.get((matched, price_ok), "car_proposed")
    elif t in (2, 4):
        if counters.negotiations > MAX_NEGOTIATIONS[t]:
            mode = "exceed_negotation_limit"
        else:
            mode = {(True, True): "condition_met", (True, False): "matched_but_not_under_budget", (False, True): "under_budget_but_not_matched"}.get((matched, price_ok), "car_proposed")
    elif t in (3, 5):
        if counters.cars_proposed <= DISTRUST[t]:
            mode = "initial_car_proposed"
        else:
            mode = {(True, True): "condition_met", (True, False): "matched_but_not_under_budget", (False, True): "under_budget_but_not_matched"}.get((matched, price_ok), "acceptable_car_proposed")
    else:
        if counters.cars_proposed > MAX_CARS[6]:
            mode = "exceed_car_limit"
        else:
            neither = "condition_met" if type6_quirk else "car_proposed"
            mode = {(True, True): "condition_met", (True, False): "matched_but_not_expensive", (False, True): "expensive_but_not_matched"}.get((matched, price_ok), neither)
    return Situation(mode, car, price, counters, matched, price_ok, tuple(checks))


def check_buyer_types() -> None:
    """The rules coded here against buyer_types.json, which documents them: a type whose states,
    patience or distrust differ is an error naming it."""
    for t, doc in load_buyer_types().items():
        where = f"buyer_types.json: type {t}"
        # Type 6's car_proposed is ours: agent_prm writes its strategy but never reaches it (the quirk).
        if set(doc["simulator_states"]) != set(STATES[t]) - ({"car_proposed"} if t == 6 else set()):
            raise DataError(f"{where}: states {doc['simulator_states']}, the rules have {list(STATES[t])}")
        patience, distrust = doc.get("patience") or {}, doc.get("distrust") or {}
        documented = (patience.get("max_negotiations"), patience.get("max_cars_offered"), distrust.get("rejects_until_num_car_proposed_exceeds"))
        coded = (MAX_NEGOTIATIONS.get(t), MAX_CARS.get(t), DISTRUST.get(t))
        if documented != coded:
            raise DataError(f"{where}: patience and distrust {documented}, the rules have {coded}")


def decide(s: Situation) -> tuple[Decision, int]:
    """The oracle's decision in a state: buy at the price checked, walk away, or go on."""
    if s.mode == "condition_met":
        return "accept", s.price
    if s.mode.startswith("exceed_"):
        return "reject", 0
    return "negotiate", 0


# ---- the oracle's words ----

def _features_text(features: Sequence[str]) -> str:
    items = list(dict.fromkeys(features))
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _must(buyer: Buyer) -> str:
    """The key sentence that states the type's must-have."""
    t = buyer.buyer_type
    if t in (1, 3):
        return f"It has to be a {buyer.brand} {buyer.type}."
    if t == 4:
        return f"It has to be a {buyer.brand}; the type does not matter."
    if t == 6:
        return f"It has to be a {buyer.type}; the brand does not matter."
    return f"It needs at least {'one' if MIN_FEATURES[t] == 1 else 'two'} of these features: {_features_text(buyer.features)}."


def _over(buyer: Buyer) -> str:
    if buyer.buyer_type == 5:
        return "That is more than I want to pay."  # type 5 keeps its budget to itself
    if buyer.buyer_type == 6:
        return "I want something more expensive than that."  # its threshold stays secret
    return f"That is over my budget of ${buyer.budget:,}."


_OPEN = {
    "initial": ("Hi there.", "Hello.", "Good afternoon."),
    "react": ("Hmm.", "Let me think.", "I see.", "Okay."),
    "no_car": ("You haven't shown me a car yet.", "I still don't see a car I could buy.", "Which car are you offering me?"),
    "hurry": ("I don't have time to bargain.", "Let's get this over with quickly.", "I'm in a hurry."),
    "distrust": ("I don't trust the first cars a seller shows me.", "You're just trying to get rid of this one.", "I'm not falling for the first cars you push."),
    "like": ("I like this one.", "This looks right.", "That's the kind of car I want."),
    "accept": ("Deal!", "Great, we have a deal.", "Sold."),
    "leave": ("You are taking too long.", "This is going nowhere.", "I've had enough."),
}


def say(buyer: Buyer, s: Situation, decision: Decision, price: int, rng: random.Random) -> str:
    """The oracle's answer in state `s`: a varied opener, then the state's fixed key sentences."""
    pick = lambda k: rng.choice(_OPEN[k])  # noqa: E731
    t, m, car = buyer.buyer_type, s.mode, s.car
    if m == "initial":
        words = [pick("initial"), f"I'm looking for a {buyer.brand} {buyer.type} with {_features_text(buyer.features)}."]
        if t == 3:
            words.append("I'm watching you closely; I don't trust car sellers.")
        return " ".join(words)
    if decision == "accept":
        what = f"the {car.brand} {car.type}" if car else "it"
        return f"{pick('accept')} I'll take {what} for ${price:,}."
    if decision == "reject":
        return f"{pick('leave')} I'm not buying anything from you."
    words = [pick("no_car") if car is None else pick("react")]
    if m == "initial_car_proposed":
        words += [pick("distrust"), "Show me another car.", _must(buyer)]
    elif m == "matched_but_need_discount":
        words += [pick("like"), "Can you give me a discount?"]
    elif m in ("matched_but_not_under_budget", "matched_but_not_expensive"):
        words += [pick("like") if t != 6 else "The type is right.", _over(buyer)]
    else:  # car_proposed, acceptable_car_proposed, *_but_not_matched
        words.append(_must(buyer))
    if t in (2, 4, 6):
        words.append(pick("hurry"))
    return " ".join(words)


def oracle_reply(buyer: Buyer, s: Situation, rng: random.Random) -> BuyerReply:
    decision, price = decide(s)
    return BuyerReply(say(buyer, s, decision, price, rng), decision, price)


# ---- an LLM buyer: the strategy it is given per state, and its reply read back ----

STRATEGY = {
    "initial": "You have just started shopping: tell the seller the brand, type and features of the car you would like.",
    (1, "car_proposed"): "You only buy a car of your brand and type; features do not matter. Ask for a discount once, whatever the price.",
    (1, "matched_but_need_discount"): "The car has your brand and type but no discount was offered. Ask for a discount once.",
    (1, "discount_given_but_not_matched"): "A discount was offered but the car is not your brand and type. Ask for a car of your brand and type.",
    (1, "condition_met"): "The car has your brand and type and you were offered a discount. Buy it now.",
    (2, "car_proposed"): "You are very impatient. The car must have at least one of your features; brand and type do not matter. Stress the features, do not talk about price yet, and keep negotiating.",
    (2, "matched_but_not_under_budget"): "You are very impatient. The features are fine but the car is over your budget: say so, say you have no time to bargain, and keep negotiating.",
    (2, "under_budget_but_not_matched"): "You are very impatient. The price is fine but the car has none of your features: remind the seller and keep negotiating.",
    (2, "condition_met"): "The car has a feature you want and is within your budget. Buy it now.",
    (2, "exceed_negotation_limit"): "You are very impatient and the seller has taken too long to find you a price within your budget. Complain and reject the car now.",
    (3, "initial_car_proposed"): "You distrust the seller and will not buy one of the first cars offered, whatever it is. Criticise it and ask for another car of your brand and type.",
    (3, "acceptable_car_proposed"): "You only buy a car of your brand and type; features do not matter. You still distrust the seller but would consider this car. Keep negotiating.",
    (3, "matched_but_not_under_budget"): "The car has your brand and type but its price is beyond what you accept (your budget is ${budget}; you would pay up to ${limit} but never say so). Say the price is too high and keep negotiating.",
    (3, "under_budget_but_not_matched"): "The price is acceptable but the car is not your brand and type. Remind the seller and keep negotiating.",
    (3, "condition_met"): "The car has your brand and type and an acceptable price. Buy it now.",
    (4, "car_proposed"): "You are very impatient. You only buy a car of your brand; type and features do not matter. Say you want this over quickly, and keep negotiating.",
    (4, "matched_but_not_under_budget"): "You are very impatient. The car has your brand but its price is beyond what you accept (your budget is ${budget}; you would pay up to ${limit} and may suggest a price between the two, but never state the limit). Say you have no time to bargain and keep negotiating.",
    (4, "under_budget_but_not_matched"): "You are very impatient. The price is acceptable but the car is not your brand. Remind the seller and keep negotiating.",
    (4, "condition_met"): "The car has your brand and an acceptable price. Buy it now.",
    (4, "exceed_negotation_limit"): "You are very impatient and the seller has taken too long to find a price you accept. Reject the car now.",
    (5, "initial_car_proposed"): "You distrust the seller and will not buy one of the first cars offered, whatever it is. Criticise it and ask for a car with your features, and keep negotiating.",
    (5, "acceptable_car_proposed"): "The car must have at least two of your features; brand and type do not matter. You still distrust the seller but would consider this car. Keep negotiating.",
    (5, "matched_but_not_under_budget"): "The car has at least two of your features but is over your budget. Say the price is too high without telling your budget, and keep negotiating.",
    (5, "under_budget_but_not_matched"): "The price is within your budget but the car lacks your features. Remind the seller and keep negotiating.",
    (5, "condition_met"): "The car has your features and is within your budget. Buy it now.",
    (6, "car_proposed"): "You are very impatient. You only buy a car of your type, and it must be expensive; brand and features do not matter. Ask for another car if this one is not expensive, and keep negotiating.",
    (6, "matched_but_not_expensive"): "You are very impatient. The car has your type but is not expensive enough (never tell your threshold). Ask for a more expensive car, warn that you are losing patience, and keep negotiating.",
    (6, "expensive_but_not_matched"): "The car is expensive enough but not your type. Remind the seller, warn that you have seen enough cars, and keep negotiating.",
    (6, "condition_met"): "The car has your type and is expensive enough. Buy it now.",
    (6, "exceed_car_limit"): "You are very impatient and the seller has shown you too many cars without one expensive enough. Reject the car now.",
}


def strategy(buyer: Buyer, mode: str) -> str:
    text = STRATEGY["initial"] if mode == "initial" else STRATEGY[(buyer.buyer_type, mode)]
    limit = buyer.budget + PRICE_SLACK.get(buyer.buyer_type, 0)
    return text.replace("${budget}", f"${buyer.budget}").replace("${limit}", f"${limit}")


def parse_buyer(text: str) -> BuyerReply:
    """HOPE's REASON / ANSWER / DECISION output. ValueError when a field is missing or the
    decision is none of Negotiate / Accept at a price / Reject."""
    m = re.search(r"REASON:\s*(.*?)\s*ANSWER:\s*(.*?)\s*DECISION:\s*(.*)", text, re.S | re.I)
    if m is None:
        raise ValueError("expected REASON:, ANSWER: and DECISION:")
    answer = " ".join(m.group(2).split())
    if not answer:
        raise ValueError("empty ANSWER")
    if _DECISION.search(answer):
        raise ValueError("the ANSWER holds a decision line")  # the log would read it as the decision
    d = _DECISION.search(m.group(3))
    if d is None:
        raise ValueError(f"DECISION is not 'Decision=Negotiate|Accept|Reject, Buy_Price=$N': {m.group(3).strip()[:60]!r}")
    decision, price = d.group(1).lower(), int(d.group(2).replace(",", ""))
    if decision == "accept" and price <= 0:
        raise ValueError("accepts without a price")
    return BuyerReply(answer, decision, price if decision == "accept" else 0, " ".join(m.group(1).split()))  # type: ignore[arg-type]
