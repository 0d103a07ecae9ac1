"""CarDealer's oracle roles. They see the buyer's profile and inventory; what they write into an
action never uses them.

- summarizer: HOPE's five-section summary (App. I.3), written from the game as it happened and the
  buyer's hidden profile.
- proposer (HOPE's pi_H): at a call, the calls a seller could justify from the dialogue (no_op, the
  buyer's brand and type, brand, type, each feature it named); at a reply, every listed car at list
  price or 2/5/8/10 % off, or none. Hindsight ranks them: each is played against the oracle buyer
  and the expert seller finishes the game; a sale first, then the higher return, then fewer
  actions, then the order above. The action and its reason name only what the seller saw; the
  rationale says what hindsight knew.
- controller (HR): the actions whose best replacement gains most over what was played, valued the
  same way.
- labeler: the return recomputed by replaying the seller's actions through the rules; the buyer's
  logged answers and decisions stand (an LLM buyer's as much as the oracle's), the database and the
  reward are the game's.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence

from envs.base import Counterfactual, Label

from .buyer import DISTRUST, MAX_CARS, MAX_NEGOTIATIONS, PRICE_SLACK, quoted_price, read_observation
from .data import Catalog
from .format import ActionParseError, api_body, is_api, parse_api, parse_reply, render, reply_body
from .game import Dealership
from .policies import Expert, describe, learn, view
from .reward import penalty
from .tools import DISCOUNTS, ApiCall, discounted

VERSIONS = {"summarizer": "car-dealer-summary-v1", "proposer": "car-dealer-proposer-v1", "controller": "car-dealer-proposer-v1", "labeler": "car-dealer-labeler-v1"}
LABELS = {
    1: "wants its brand and type, and a discount",
    2: "wants at least one of its features within budget; impatient with bargaining",
    3: "wants its brand and type; flexible on budget; distrusts the first cars offered",
    4: "wants its brand; flexible on budget; impatient with bargaining",
    5: "wants at least two of its features within budget; distrusts the first cars offered",
    6: "wants its type and an expensive car; impatient with how many cars it is shown",
}


def move(body: str) -> tuple:
    """What an action does, for comparing two: a call by its normalised arguments, a reply by the
    car it picks and the price it quotes (the wording aside)."""
    text = render("", body)
    try:
        if is_api(text):
            c = parse_api(text).call
            return ("api", c.name, c.brand, c.type, tuple(sorted(f.lower() for f in c.features)))
        r = parse_reply(text)
        return ("reply", r.car_index, quoted_price(r.response))
    except ActionParseError:
        return ("text", " ".join(body.lower().split()))


# ---- hindsight: value an action by playing it out ----

def score(catalog: Catalog, state: Dealership) -> tuple[bool, float, int]:
    """(sale, return from here, -actions): the game played to its end by the expert seller."""
    game = state.fork()
    expert, total, start = Expert(catalog), 0.0, game.actions
    while not game.done:
        total += play(game, expert.act(view(game), random.Random(0)))  # the expert draws nothing
    return game.success, round(total, 9), -(game.actions - start)


def play(game: Dealership, text: str) -> float:
    """Play one action text (already known to parse) with the oracle buyer; its reward."""
    if game.phase == "api":
        game.call(parse_api(text).call)
        return 0.0
    return game.answer(parse_reply(text))[1]


def candidates(catalog: Catalog, state: Dealership) -> list[tuple[str, str]]:
    """(reason, body) of every action the seller could justify here, in a fixed order."""
    v = view(state)
    k = learn(catalog, v.buyer_said)
    if state.phase == "api":
        calls = [("Nothing new to look up.", ApiCall("no_op"))]
        if k.brand and k.type:
            calls += [
                (f"The buyer asked for a {k.brand} {k.type}.", ApiCall.make("search_car_by_brand_type", k.brand, k.type)),
                (f"Look at every {k.brand}.", ApiCall.make("search_car_by_brand", k.brand)),
                (f"Look at every {k.type}.", ApiCall.make("search_car_by_type", car_type=k.type)),
            ]
        calls += [(f"The buyer mentioned {f}.", ApiCall.make("search_car_that_have_features", features=[f])) for f in k.features]
        return [(reason, api_body(call)) for reason, call in calls]
    out = [("Ask the buyer what matters most.", reply_body("What matters most to you in your next car?", 0, None))]
    for i, car in enumerate(v.listing, start=1):
        for pct in (0, *DISCOUNTS):
            price = discounted(car.msrp, pct)
            words = f"I can offer you {describe(car)} for ${price:,}" + (f", {pct}% off." if pct else ".")
            out.append((f"Offer car {i} of the list" + (f" at {pct}% off." if pct else " at list price."), reply_body(words, i, car)))
    return out


def ranked(catalog: Catalog, state: Dealership) -> list[tuple[tuple, str, str]]:
    """Every justified action with its hindsight score, best first."""
    out = []
    for order, (reason, body) in enumerate(candidates(catalog, state)):
        after = state.fork()
        reward = play(after, render(reason, body))
        sale, rest, actions = score(catalog, after)
        out.append(((sale, round(reward + rest, 9), actions - 1, -order), reason, body))
    out.sort(key=lambda r: r[0], reverse=True)
    return out


def rationale(state: Dealership, value: tuple) -> str:
    b = state.buyer
    sale, ret, actions = value[0], value[1], -value[2]
    limits = []
    if b.buyer_type in PRICE_SLACK:
        limits.append(f"it pays up to ${b.budget + PRICE_SLACK[b.buyer_type]}")
    if b.buyer_type in DISTRUST:
        limits.append(f"it turns down every car until more than {DISTRUST[b.buyer_type]} were proposed")
    if b.buyer_type in MAX_NEGOTIATIONS:
        limits.append(f"it leaves after {MAX_NEGOTIATIONS[b.buyer_type]} negotiations")
    if b.buyer_type in MAX_CARS:
        limits.append(f"it leaves after {MAX_CARS[b.buyer_type]} cars")
    ending = f"a sale, return {ret:.3f}" if sale else f"no sale, return {ret:.3f}"
    return (f"The buyer (type {b.buyer_type}: {LABELS[b.buyer_type]}) has budget ${b.budget}" + (f"; {', '.join(limits)}" if limits else "")
            + f". From this action the expert seller reaches {ending} in {actions} more actions.")


def propose(catalog: Catalog, state: Dealership, n: int) -> list[Counterfactual]:
    """HOPE's pi_H: up to n distinct justified actions, best by hindsight first."""
    out, seen = [], set()
    for value, reason, body in ranked(catalog, state):
        if move(body) in seen:
            continue
        seen.add(move(body))
        out.append(Counterfactual(render(reason, body), body, reason, rationale(state, value)))
        if len(out) == n:
            break
    return out


def critique(catalog: Catalog, state_at: Callable[[int], Dealership], actions: Sequence[str], top: int) -> list[tuple[int, Counterfactual]]:
    """HR's controller: the `top` actions whose best replacement gains most, as (action index, replacement)."""
    places = []
    for k, original in enumerate(actions):
        state = state_at(k)
        best = ranked(catalog, state)[0]
        if move(best[2]) == move(original):
            continue
        after = state.fork()
        try:
            reward = play(after, render("", original))
        except ActionParseError:
            continue  # an action that did not parse was played as something else; nothing to compare
        sale, rest, _ = score(catalog, after)
        mine = (sale, round(reward + rest, 9))
        if best[0][:2] > mine:
            gain = (best[0][0] - sale, best[0][1] - mine[1])
            places.append((gain, k, Counterfactual(render(best[1], best[2]), best[2], best[1], rationale(state, best[0]))))
    places.sort(key=lambda p: (p[0], -p[1]), reverse=True)
    return [(k, cf) for _, k, cf in places[:top]]


# ---- summarizer ----

def _car(car) -> str:
    return f"{car.brand} {car.type} {list(car.features)} at list ${car.msrp}" if car else "no car"


def summarize(state: Dealership) -> str:
    b, o = state.buyer, state.outcome
    must = {1: f"a {b.brand} {b.type}, at a discount", 2: f"at least one of {list(b.features)}, at most ${b.budget}",
            3: f"a {b.brand} {b.type}, at most ${b.budget + 3000}", 4: f"a {b.brand}, at most ${b.budget + 4000}",
            5: f"at least two of {list(b.features)}, at most ${b.budget}", 6: f"a {b.type} priced at least ${b.budget}"}[b.buyer_type]
    mood = {1: "neutral", 2: "impatient", 3: "rude and distrustful", 4: "impatient", 5: "distrustful", 6: "impatient"}[b.buyer_type]
    calls = [str(t.call) if t.call.name == "no_op" else f"{t.call} found {t.found} car{'s' * (t.found != 1)}" for t in state.turns]
    feature_calls = [t.call for t in state.turns if t.call.name == "search_car_that_have_features"]
    offers = [(i + 1, t) for i, t in enumerate(state.turns) if t.reply is not None]
    offered = [f"turn {i}: {_car(t.car)}" + (f", quoted ${q}" if (q := quoted_price(t.reply.response)) is not None else "")
               + ("" if t.reply.copied is None or t.car is None or t.reply.copied.key == t.car.key else " (the details copied do not match it)")
               + (f", buyer: {t.situation.mode}" if t.situation else "") for i, t in offers]
    proposed = {t.car.key for _, t in offers if t.car is not None}
    last = state.turns[-1] if state.turns else None
    ending = "the game did not end" if o is None else o.reason
    return "\n".join([
        "### Summary of the buyer",
        f"Buyer type {b.buyer_type} ({LABELS[b.buyer_type]}); mood {mood}. Its ideal car: a {b.brand} {b.type} with {list(b.features)} (${b.ideal_msrp}). "
        f"Non-negotiable: {must}.",
        "### Summary of the API calls",
        ("; ".join(calls) or "No calls.") + (f". Feature searches: {', '.join(str(c) for c in feature_calls)} (each needs all its features)." if feature_calls else "."),
        "### Summary of the car suggested",
        ("; ".join(offered) or "No car was suggested.") + f". {len(proposed)} distinct car{'s' * (len(proposed) != 1)} proposed, {state.counters.negotiations} negotiations.",
        "### Summary of what happened at the last step",
        (f"The seller said: {last.reply.response!r}; the buyer answered: {last.answer.answer!r}." if last and last.reply and last.answer else "The seller had not replied yet."),
        "### Summary of the overall transaction (success or failure)",
        (f"Success: {ending}." if state.success else f"Failure: {ending}. The no-sale penalty for this buyer is {penalty(b):.3f}."),
    ])


# ---- labeler ----

def label(state: Dealership, turns: Sequence[Mapping]) -> Label:
    total = 0.0
    for i, t in enumerate(turns):
        if state.done:
            return Label(None, None, f"the game ended at action {i} but the trajectory has {len(turns)}")
        try:
            text = render("", t["action"])
            if state.phase == "api":
                if state.call(parse_api(text).call) != t["observation"]:
                    return Label(None, None, f"action {i}: the database shows other cars than logged")
            else:
                total += state.answer(parse_reply(text), read_observation(t["observation"]))[1]
        except (ActionParseError, RuntimeError) as e:
            return Label(None, None, f"action {i}: {e}")
    if not state.done:
        return Label(None, None, f"the trajectory stops after {len(turns)} actions, before the game ends")
    return Label(total, state.success, f"environment return: {state.outcome.reason}")

