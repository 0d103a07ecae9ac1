"""The seller's action format: HOPE's two agent outputs (App. I.2), one per action.

A seller turn is two actions. First an API call:

    REASON: <why>
    API NAME: search_car_by_brand_type
    API BRAND: Kia
    API TYPE: truck
    API FEATURES: []

then, having seen what it found, a reply to the buyer naming one car of the list shown (0: none)
and copying that car's details (the copy is how HOPE catches made-up cars):

    REASON: <why>
    RESPONSE: <1-5 sentences to the buyer>
    CAR INDEX: 2
    PROPOSED CAR BRAND: Kia
    PROPOSED CAR TYPE: truck
    PROPOSED CAR FEATURES: ["backup camera"]
    PROPOSED CAR MSRP: 45000

Field names are read case-insensitively at the start of a line, a value on the same line or on the
lines after (HOPE writes them below); "None" means empty. The action proper (`body`) is the text
after the reason, rendered the same way whatever the input's spacing, which is what a trajectory's
turn records and what `same_action` and the labeler read.
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

from .data import Car
from .tools import API_NAMES, ApiCall, normalise_brand, normalise_type

API_FIELDS = ("API NAME", "API BRAND", "API TYPE", "API FEATURES")
REPLY_FIELDS = ("RESPONSE", "CAR INDEX", "PROPOSED CAR BRAND", "PROPOSED CAR TYPE", "PROPOSED CAR FEATURES", "PROPOSED CAR MSRP")


class ActionParseError(ValueError):
    """A seller output that does not follow the format."""


@dataclass(frozen=True)
class ApiAction:
    reason: str
    call: ApiCall


@dataclass(frozen=True)
class Reply:
    reason: str
    response: str
    car_index: int  # 1-based into the cars shown; 0 proposes none
    copied: Car | None  # the car's details as the seller copied them (None: none copied)


def _none(value: str) -> str:
    return "" if value.strip().lower() in ("none", "null", "") else value.strip()


def _fields(text: str, names: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """(reason, {field: value}) for REASON and `names`, each expected once, in order."""
    labels = ("REASON", *names)
    pattern = re.compile(r"^[ \t*#]*(%s)[ \t*]*:[ \t]*" % "|".join(re.escape(n) for n in labels), re.I | re.M)
    marks = list(pattern.finditer(text))
    found = [m.group(1).upper() for m in marks]
    if found[: len(labels)] != list(labels):
        missing = next((n for n in labels if n not in found), None)
        raise ActionParseError(f"missing '{missing}:'" if missing else f"fields out of order: {', '.join(found)}")
    if text[: marks[0].start()].strip():
        raise ActionParseError(f"unexpected text before 'REASON:': {text[: marks[0].start()].strip()[:40]!r}")
    values = {}
    for m, nxt in zip(marks[: len(labels)], [*marks[1 : len(labels)], None]):
        values[m.group(1).upper()] = text[m.end() : nxt.start() if nxt else len(text)].strip()
    return " ".join(values.pop("REASON").split()), values


def _features(value: str, where: str) -> tuple[str, ...]:
    value = value.strip()
    if _none(value) == "":
        return ()
    try:
        items = json.loads(value)
    except json.JSONDecodeError:
        try:
            items = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ActionParseError(f"{where}: not a list of strings: {value[:60]!r}") from None
    if not isinstance(items, list | tuple) or not all(isinstance(f, str) for f in items):
        raise ActionParseError(f"{where}: not a list of strings: {value[:60]!r}")
    return tuple(" ".join(f.split()) for f in items)


def _integer(value: str, where: str) -> int:
    v = _none(value).replace("$", "").replace(",", "")
    if v == "":
        return 0
    if not re.fullmatch(r"\d+", v):
        raise ActionParseError(f"{where}: not a whole number: {value[:30]!r}")
    return int(v)


def parse_api(text: str) -> ApiAction:
    reason, v = _fields(text, API_FIELDS)
    name = v["API NAME"].split("\n")[0].strip().strip("`'\"")
    if name not in API_NAMES:
        raise ActionParseError(f"unknown API {name[:40]!r}; expected one of {', '.join(API_NAMES)}")
    call = ApiCall.make(name, _none(v["API BRAND"].split("\n")[0]), _none(v["API TYPE"].split("\n")[0]), _features(v["API FEATURES"].split("\n")[0], "API FEATURES"))
    return ApiAction(reason, call)


def parse_reply(text: str) -> Reply:
    reason, v = _fields(text, REPLY_FIELDS)
    response = " ".join(v["RESPONSE"].split())
    if not response:
        raise ActionParseError("empty RESPONSE")
    index = _integer(v["CAR INDEX"].split("\n")[0], "CAR INDEX")
    brand, car_type = _none(v["PROPOSED CAR BRAND"].split("\n")[0]), _none(v["PROPOSED CAR TYPE"].split("\n")[0])
    features = _features(v["PROPOSED CAR FEATURES"].split("\n")[0], "PROPOSED CAR FEATURES")
    msrp = _integer(v["PROPOSED CAR MSRP"].split("\n")[0], "PROPOSED CAR MSRP")
    copied = Car(normalise_brand(brand), normalise_type(car_type), features, msrp) if brand or car_type else None
    return Reply(reason, response, index, copied)


def api_body(call: ApiCall) -> str:
    return "\n".join([
        f"API NAME: {call.name}",
        f"API BRAND: {call.brand or 'None'}",
        f"API TYPE: {call.type or 'None'}",
        f"API FEATURES: {json.dumps(list(call.features))}",
    ])


def reply_body(response: str, car_index: int, copied: Car | None) -> str:
    return "\n".join([
        f"RESPONSE: {' '.join(response.split())}",
        f"CAR INDEX: {car_index}",
        f"PROPOSED CAR BRAND: {copied.brand if copied else 'None'}",
        f"PROPOSED CAR TYPE: {copied.type if copied else 'None'}",
        f"PROPOSED CAR FEATURES: {json.dumps(list(copied.features)) if copied else '[]'}",
        f"PROPOSED CAR MSRP: {copied.msrp if copied else 0}",
    ])


def render(reason: str, body: str) -> str:
    return f"REASON: {' '.join(reason.split())}\n{body}"


def render_api(reason: str, call: ApiCall) -> str:
    return render(reason, api_body(call))


def render_reply(reason: str, response: str, car_index: int, copied: Car | None) -> str:
    return render(reason, reply_body(response, car_index, copied))


def is_api(text: str) -> bool:
    """Whether a text is (meant as) an API call rather than a reply: its first field after the reason."""
    m = re.search(r"^[ \t*#]*(API NAME|RESPONSE)[ \t*]*:", text, re.I | re.M)
    return bool(m) and m.group(1).upper() == "API NAME"


def parse(text: str) -> tuple[str, str]:
    """(reason, body) of either kind of action, the body in its canonical rendering."""
    if is_api(text):
        a = parse_api(text)
        return a.reason, api_body(a.call)
    r = parse_reply(text)
    return r.reason, reply_body(r.response, r.car_index, r.copied)
