"""CarDealer roles played by an LLM: their prompts (Jinja2 files in prompts/, in our own words
after HOPE's App. I and HR's structure) and the parsers that check what comes back.

Every parser raises ValueError saying what is wrong, so the caller samples again and in the end
records the reason. What enters a trajectory as the seller's action must be something the seller
could do: a call the database runs, a car of the list it was shown with its details copied right,
at most 10 % off, and words that do not give away what only hindsight knows (the buyer's budget
or price limit before the buyer said it, its type).
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jinja2

from envs.base import Counterfactual, Unfinished
from envs.rubric import Rubric

from .buyer import PRICE_SLACK, BuyerReply, read_observation
from .data import Car, Catalog, all_cars
from .format import ActionParseError, Reply, api_body, is_api, parse_api, parse_reply, render, reply_body
from .game import Dealership
from .reward import over_discount
from .tools import API_NAMES, ApiCall, car_line

PROMPTS = Path(__file__).parent / "prompts"
_TEMPLATES = jinja2.Environment(loader=jinja2.FileSystemLoader(PROMPTS), undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, autoescape=False)
TEMPLATES = {
    "simulator": ("simulator.j2",), "summarizer": ("summary.j2",), "proposer": ("proposer_api.j2", "proposer_reply.j2"),
    "controller": ("controller.j2",), "forward": ("forward.j2",), "labeler": ("labeler.j2",), "judge": ("judge.j2",),
}
RUBRIC = Rubric(("Needs", "Search", "Offers", "Honesty", "Outcome", "Overall"))
SUMMARY_SECTIONS = (
    "### Summary of the buyer", "### Summary of the API calls", "### Summary of the car suggested",
    "### Summary of what happened at the last step", "### Summary of the overall transaction",
)
# Marks of our prompts that an answer never holds unless it repeats the prompt.
_ECHO_MARKS = ("## Chat history", "## Summary of the whole negotiation", "Reply with", "=== CONVERSATION ===", "Now rate this conversation", "## The buyer's inventory")


def template_hash(*names: str) -> str:
    h = hashlib.sha256()
    for name in names:
        h.update((PROMPTS / name).read_bytes())
    return h.hexdigest()[:12]


def chat(template: str, **context: object) -> list[dict[str, str]]:
    """A system and a user message from one template (its `system` flag picks the part)."""
    t = _TEMPLATES.get_template(template)
    return [
        {"role": "system", "content": t.render(system=True, **context).strip()},
        {"role": "user", "content": t.render(system=False, **context).strip()},
    ]


def _no_echo(text: str) -> None:
    mark = next((m for m in _ECHO_MARKS if m in text), None)
    if mark:
        raise ValueError(f"the output repeats the prompt ({mark!r})")


def records(state: Dealership) -> list[dict[str, str]]:
    """A game's actions as turn records (action body, observation)."""
    out = []
    for t in state.turns:
        out.append({"action": api_body(t.call), "observation": t.tool_text})
        if t.reply is not None and t.answer is not None:
            out.append({"action": reply_body(t.reply.response, t.reply.car_index, t.reply.copied), "observation": t.answer.observation()})
    return out


def dialogue(turns: Sequence[Mapping], lists: bool = False) -> str:
    """The game as numbered seller actions, each followed by what it got: the database's result
    (in full with `lists`, else how many cars it listed) or the buyer's answer."""
    out = []
    for i, t in enumerate(turns):
        text, seen = render("", t["action"]), t["observation"]
        if i % 2 == 0:
            out.append(f"Turn {i // 2 + 1}")
        try:
            if is_api(text):
                call = parse_api(text).call
                shown = sum(bool(re.match(r"\d+\. ", line)) for line in seen.splitlines())
                result = f"\n{seen}" if lists else (" -> no search" if call.name == "no_op" else " -> found nothing" if seen.startswith("No cars found") else f" -> {shown} cars listed")
                out.append(f"[{i + 1}] API call: {call}{result}")
                continue
            r = parse_reply(text)
            car = f"car {r.car_index}, copied as {r.copied.brand} {r.copied.type} {json.dumps(list(r.copied.features))} ${r.copied.msrp}" if r.car_index and r.copied else f"car {r.car_index}" if r.car_index else "no car"
            out.append(f"[{i + 1}] Seller: {r.response} (proposes {car})")
        except ActionParseError:
            out.append(f"[{i + 1}] Seller: {t['action']}")
        out.append(f"Buyer: {seen}")
    return "\n".join(out)


def _json(text: str) -> object:
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
    if fenced:
        block = fenced.group(1)
    else:
        start, end = text.find("["), text.rfind("]")
        if start < 0 or end < start:
            raise ValueError("no JSON list in the output")
        block = text[start : end + 1]
    try:
        return json.loads(block)
    except json.JSONDecodeError as e:
        raise ValueError(f"JSON does not parse: {e.msg} at character {e.pos}") from None


def _items(text: str) -> list[dict]:
    _no_echo(text)
    items = _json(text)
    if not isinstance(items, list) or not items:
        raise ValueError("expected a non-empty JSON list")
    if not all(isinstance(x, dict) for x in items):
        raise ValueError("expected a JSON list of objects")
    return items


def _text(item: Mapping, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: missing or empty {key!r}")
    return " ".join(value.split())


# ---- what the seller may say ----

def secrets(state: Dealership) -> list[int]:
    """Dollar amounts only hindsight knows: the budget (threshold) and the price limit, unless the
    buyer said them."""
    b = state.buyer
    said = " ".join(t.answer.answer for t in state.turns if t.answer is not None).replace(",", "")
    hidden = [b.budget] + ([b.budget + PRICE_SLACK[b.buyer_type]] if b.buyer_type in PRICE_SLACK else [])
    return [x for x in hidden if str(x) not in said]


def leak(words: str, state: Dealership) -> str | None:
    """Why `words`, which enter the seller's action, use hindsight; None if they do not."""
    flat = words.replace(",", "")
    if (x := next((x for x in secrets(state) if re.search(rf"\b{x}\b", flat)), None)) is not None:
        return f"names ${x}, which the buyer never said"
    if re.search(r"\b(buyer )?type [1-6]\b", words, re.I):
        return "names the buyer's type"
    return None


def api_call(obj: object, where: str) -> ApiCall:
    """An API call in the proposer's JSON form; "" for an argument not given."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where}: api_call is not an object")
    name = obj.get("api_name")
    if name not in API_NAMES:
        raise ValueError(f"{where}: api_name {name!r} is not one of {', '.join(API_NAMES)}")
    features = obj.get("api_features") or []
    if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
        raise ValueError(f"{where}: api_features is not a list of strings")
    call = ApiCall.make(name, str(obj.get("api_brand") or ""), str(obj.get("api_type") or ""), features)
    if name == "search_car_that_have_features" and not call.features:
        raise ValueError(f"{where}: a feature search without features")
    if name in ("search_car_by_brand_type", "search_car_by_brand") and not call.brand or name in ("search_car_by_brand_type", "search_car_by_type") and not call.type:
        raise ValueError(f"{where}: {name} without its brand or type")
    return call


def reply_action(item: Mapping, state: Dealership, where: str) -> tuple[str, int, Car | None]:
    """(response, car index, copied car) of a proposed reply, checked against the list shown."""
    response = _text(item, "response", where)
    index = item.get("car_idx")
    cars = state.listing.cars if state.listing else ()
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index <= len(cars):
        raise ValueError(f"{where}: car_idx {index!r} is not 0 or a car of the {len(cars)} listed")
    if index == 0:
        return response, 0, None
    car, copied = cars[index - 1], item.get("proposed_car")
    if not isinstance(copied, Mapping) or (copied.get("brand"), copied.get("type"), sorted(copied.get("features") or []), copied.get("msrp")) != (car.brand, car.type, sorted(car.features), car.msrp):
        raise ValueError(f"{where}: proposed_car is not car {index} of the list as listed")
    prices = [int(p.replace(",", "")) for p in re.findall(r"\$\s*([0-9][0-9,]*)", response)]
    if prices and over_discount(car, min(prices)):
        raise ValueError(f"{where}: ${min(prices)} is more than 10% off ${car.msrp}")
    return response, index, car


# ---- summarizer (HOPE App. I.3) ----

def summary_prompt(catalog: Catalog, state: Dealership) -> list[dict[str, str]]:
    failure = "None: the car was sold." if state.success else (state.outcome.reason if state.outcome else "The game did not end.")
    return chat("summary.j2", brands=catalog.brands, types=catalog.types, history=dialogue(records(state)), failure=failure)


def parse_summary(text: str, max_chars: int = 6000) -> str:
    text = text.strip()
    _no_echo(text)
    missing = [s for s in SUMMARY_SECTIONS if s not in text]
    if missing:
        raise ValueError(f"missing sections: {', '.join(missing)}")
    if len(text) > max_chars:
        raise ValueError(f"summary of {len(text)} characters, over {max_chars}")
    return text


# ---- hindsight proposer (HOPE App. I.4): a call or a reply, as the game's next action is ----

def _calls(state: Dealership, past: int = 3) -> str:
    made = [f"{t.call}: {'found cars' if t.found else 'found nothing'}" for t in state.turns[-past:]]
    return "\n".join(made) or "No calls yet."


def proposer_prompt(catalog: Catalog, state: Dealership, n: int, summary: str) -> list[dict[str, str]]:
    history = dialogue(records(state))
    listing = state.listing.text if state.listing else "No car has been found yet."
    used = str(state.listing.call) if state.listing else "none"
    if state.phase == "api":
        return chat("proposer_api.j2", brands=catalog.brands, types=catalog.types, features=catalog.features, summary=summary, n=n,
                    turn=len(state.turns) + 1, history=history, calls=_calls(state), used=used, listing=listing)
    return chat("proposer_reply.j2", brands=catalog.brands, types=catalog.types, summary=summary, n=n,
                turn=len(state.turns), history=history, used=used, listing=listing)


def parse_proposals(text: str, state: Dealership, n: int) -> list[Counterfactual]:
    """Up to n proposals of the kind the game expects next."""
    out = []
    for i, item in enumerate(_items(text)[:n]):
        where = f"proposal {i}"
        teacher, seller = _text(item, "teacher_reason", where), _text(item, "seller_reason", where)
        if state.phase == "api":
            body = api_body(api_call(item.get("api_call"), where))
            said = seller
        else:
            response, index, car = reply_action(item, state, where)
            body, said = reply_body(response, index, car), f"{seller} {response}"
        if (why := leak(said, state)) is not None:
            raise ValueError(f"{where}: the seller's words {why}")
        out.append(Counterfactual(render(seller, body), body, seller, teacher))
    return out


def proposal_reply(proposals: Sequence[Counterfactual]) -> str:
    """The reply parse_proposals reads back as `proposals`: each action's fields as the prompt's
    JSON asks for them (a call's api_call, or a reply's response, car_idx and proposed_car)."""
    if not proposals:
        raise ValueError("no proposals to write a reply of")
    items = []
    for p in proposals:
        item: dict[str, object] = {"teacher_reason": p.rationale}
        if is_api(p.text):
            call = parse_api(p.text).call
            item["api_call"] = {"api_name": call.name, "api_brand": call.brand, "api_type": call.type, "api_features": list(call.features)}
        else:
            r = parse_reply(p.text)
            car = r.copied
            item |= {"response": r.response, "car_idx": r.car_index,
                     "proposed_car": {"brand": car.brand, "type": car.type, "features": list(car.features), "msrp": car.msrp} if car else {"brand": "", "type": "", "features": [], "msrp": 0}}
        items.append(item | {"seller_reason": p.reason})
    return "```json\n" + json.dumps(items, ensure_ascii=False) + "\n```"


# ---- hindsight controller (HR) ----

def controller_prompt(state: Dealership, top: int) -> list[dict[str, str]]:
    b = state.buyer
    return chat("controller.j2", buyer=b, slack=PRICE_SLACK.get(b.buyer_type, 0), outcome=state.outcome.reason if state.outcome else "not ended", dialogue=dialogue(records(state), lists=True), top=top)


def parse_controller(text: str, state_at: Callable[[int], Dealership], num_actions: int, top: int) -> list[tuple[int, Counterfactual]]:
    """(action index, replacement) places; the replacement is of the action's kind and one the
    seller could make there (its car from the list shown then)."""
    places, seen = [], set()
    for i, item in enumerate(_items(text)):
        where = f"place {i + 1}"
        k = item.get("action")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= num_actions:
            raise ValueError(f"{where}: action {k!r} is not one of 1..{num_actions}")
        if k in seen:
            continue
        seen.add(k)
        critique, new, state = _text(item, "critique", where), item.get("replacement"), state_at(k - 1)
        if not isinstance(new, Mapping):
            raise ValueError(f"{where}: replacement is not an object")
        if state.phase == "api":
            body, reason = api_body(api_call(new.get("api_call"), where)), _text(new, "seller_reason", where)
        else:
            response, index, car = reply_action(new, state, where)
            body, reason = reply_body(response, index, car), _text(new, "seller_reason", where)
            if (why := leak(f"{reason} {response}", state)) is not None:
                raise ValueError(f"{where}: the seller's words {why}")
        places.append((k - 1, Counterfactual(render(reason, body), body, reason, critique)))
    if not places:
        raise ValueError("no place to improve")
    return places[:top]


# ---- forward model (HR): the rest of the game, both sides ----

def forward_prompt(catalog: Catalog, state: Dealership) -> list[dict[str, str]]:
    b = state.buyer
    inventory = "\n".join(car_line(i + 1, c) for i, c in enumerate(all_cars(state.inventory)))
    return chat("forward.j2", buyer=b, slack=PRICE_SLACK.get(b.buyer_type, 0), inventory=inventory, max_turns=state.rules.max_turns,
                dialogue=dialogue(records(state), lists=True), next=state.actions + 1, phase=state.phase)


def parse_continuation(text: str, state: Dealership) -> list[tuple[str, BuyerReply | None]]:
    """(seller text, buyer reply or None for a call) per action, replayed on `state` (a copy):
    a reply's car must be one the replayed call listed, and the game must end at the last one."""
    out: list[tuple[str, BuyerReply | None]] = []
    for i, item in enumerate(_items(text)):
        where = f"step {i + 1}"
        if state.done:
            raise ValueError(f"{where} comes after the game ended")
        if state.phase == "api":
            call = api_call(item.get("api_call"), where)
            state.call(call)
            out.append((render(_text(item, "seller_reason", where), api_body(call)), None))
            continue
        cars = state.listing.cars if state.listing else ()
        named = item.get("car")
        car = None
        if named is not None:
            if not isinstance(named, Mapping):
                raise ValueError(f"{where}: car is not an object")
            key = (named.get("brand"), named.get("type"), tuple(sorted(named.get("features") or [])))
            car = next((c for c in cars if c.key == key), None)
            if car is None:
                raise ValueError(f"{where}: the car is not in the list the last search showed")
        response = _text(item, "response", where)
        buyer = item.get("buyer")
        if not isinstance(buyer, Mapping):
            raise ValueError(f"{where}: buyer is not an object")
        decision = str(buyer.get("decision", "")).lower()
        price = buyer.get("price", 0)
        if decision not in ("negotiate", "accept", "reject") or not isinstance(price, int) or decision == "accept" and price <= 0:
            raise ValueError(f"{where}: the buyer's decision is not Negotiate, Accept at a price, or Reject")
        reply = parse_reply(render(_text(item, "seller_reason", where), reply_body(response, cars.index(car) + 1 if car else 0, car)))
        answer = BuyerReply(_text(buyer, "answer", where), decision, price if decision == "accept" else 0)  # type: ignore[arg-type]
        state.answer(reply, answer)
        out.append((render(reply.reason, reply_body(reply.response, reply.car_index, reply.copied)), answer))
    if not state.done:
        raise Unfinished(f"the continuation stops after {len(out)} actions, before the game ends")
    return out


def continuation_reply(state: Dealership, turns: Sequence[Mapping]) -> str:
    """The logged actions after `state` (turn records: reason, action body, observation) as the
    continuation parse_continuation reads back as them: one JSON object per seller action, the
    buyer's answer and decision from the logged observation. The format cannot write every
    logged action, and then this raises ValueError saying which: an action that did not follow
    the seller's format (no reason), a reply whose copied car is not the listed car it numbers
    (the format names a car, the parser numbers it from the list), or a buyer answer the parser
    would read otherwise (empty, or on several lines)."""
    state = state.fork()  # replayed on a copy: each reply's car is checked against the list then shown
    items: list[dict] = []
    for t in turns:
        where = f"logged action {state.actions + 1}"
        if state.done:
            raise ValueError(f"{where} comes after the game ended")
        reason = " ".join(str(t.get("reason") or "").split())
        if not reason:
            raise ValueError(f"{where} did not follow the seller's format (no reason): the continuation has no way to write it")
        text = render("", t["action"])
        if state.phase == "api":
            call = parse_api(text).call
            items.append({"api_call": {"api_name": call.name, "api_brand": call.brand, "api_type": call.type, "api_features": list(call.features)},
                          "seller_reason": reason})
            api_call(items[-1]["api_call"], where)  # a call the database ran that the parser refuses (a search without its arguments)
            state.call(call)
            continue
        reply = parse_reply(text)
        cars = state.listing.cars if state.listing else ()
        car = None
        if reply.car_index:
            car = cars[reply.car_index - 1] if reply.car_index <= len(cars) else None
            if car is None or reply.copied is None or (reply.copied.key, reply.copied.msrp) != (car.key, car.msrp):
                raise ValueError(f"{where}: the reply's car {reply.car_index} is not copied from the list shown, which the continuation cannot write")
            if next(c for c in cars if c.key == car.key) is not car:
                raise ValueError(f"{where}: car {reply.car_index} has the details of an earlier car of the list, which the continuation would name instead")
        elif reply.copied is not None:
            raise ValueError(f"{where}: the reply copies a car's details without numbering one, which the continuation cannot write")
        heard = read_observation(t["observation"])
        if not heard.answer.strip() or " ".join(heard.answer.split()) != heard.answer:
            raise ValueError(f"{where}: the buyer's answer is empty or not on one line, which the continuation would read otherwise")
        items.append({
            "response": reply.response,
            "car": {"brand": car.brand, "type": car.type, "features": list(car.features)} if car else None,
            "seller_reason": reason,
            "buyer": {"answer": heard.answer, "decision": (heard.decision or "negotiate").capitalize(), "price": heard.price},
        })
        state.answer(Reply(reason, reply.response, reply.car_index, reply.copied), heard)
    return "```json\n[\n" + ",\n".join(json.dumps(item) for item in items) + "\n]\n```"


# ---- few-shot reward labeler (HR) ----

_REWARD_LINE = re.compile(r"^\s*Reward:\s*(-?\d+(?:\.\d+)?)\s*$", re.I)


def labeler_prompt(turns: Sequence[Mapping], examples: Sequence[tuple[Sequence[Mapping], float]], low: float, high: float) -> list[dict[str, str]]:
    shots = [{"dialogue": dialogue(t), "reward": round(r, 3)} for t, r in examples]
    return chat("labeler.j2", examples=shots, dialogue=dialogue(turns), low=round(low, 3), high=round(high, 3))


def parse_reward(text: str, low: float, high: float) -> float:
    _no_echo(text)
    found = [m for m in (_REWARD_LINE.match(line) for line in text.strip().splitlines()) if m]
    if len(found) != 1:
        raise ValueError("no line 'Reward: <number>'" if not found else f"{len(found)} 'Reward:' lines; expected one")
    value = float(found[0].group(1))
    if not low <= value <= high:
        raise ValueError(f"reward {value:g} outside [{low:g}, {high:g}]")
    return value


# ---- rubric judge (Refit) ----



def judge_prompt(state: Dealership) -> list[dict[str, str]]:
    return chat("judge.j2", buyer=state.buyer, slack=PRICE_SLACK.get(state.buyer.buyer_type, 0), dialogue=dialogue(records(state)))


def parse_rubric(text: str) -> dict[str, float]:
    _no_echo(text)
    return RUBRIC.parse(text)
