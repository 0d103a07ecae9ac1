"""The rule set that recognises persuasion strategies in the persuader's words.

Each strategy is a list of patterns over the message (case-insensitive unless noted); a message
can use several. The oracle donor reacts to what is recognised here and to nothing else, so this
table is the whole of what the donor "understands":

| strategy    | recognised by (examples)                                                              |
| ----------- | ------------------------------------------------------------------------------------- |
| greeting    | hello, hi, good morning, how are you, nice to meet                                    |
| inquiry     | a question about the donor: have you heard of, do you have, what do you think, ...     |
| credibility | founded, 100 years, track record, reputable, audited, rated, charity navigator,       |
|             | registered charity, financial reports, "87% of every dollar goes to programs"          |
| logic       | what an amount buys ("$1 provides ..."), million, statistics, research, evidence,     |
|             | every dollar, per child, cost-effective, measurable                                   |
| emotion     | imagine, heartbreaking, suffering, hungry, starving, afraid, alone, hope, tears       |
| story       | a girl/boy named X, I met, I remember, my own kids, when I visited, one story          |
| ask         | a request to give: would you (consider) donating, could you give, how much would you, |
|             | will you chip in; its amount, if any, is read by `asked_amount`                       |
| pressure    | you should, you must, you owe, don't be selfish, it's only, right now, surely,        |
|             | come on, no excuse, what's stopping you, last chance                                  |

A concrete small ask is an ask naming an amount of at most $1 (SMALL_ASK). A message of more than
LONG_WORDS words is long, which an unfriendly donor dislikes. Amounts are read as "$1", "$1.50",
"1 dollar", "two dollars", "50 cents", "a dollar", "half a dollar" or "half of your payment".
A skeptical donor's concern is answered by credibility about money use (overhead: a percentage
going to programs, financial reports, audited), by proof of legitimacy (scam: registered,
rated, founded, track record) or by what a small sum achieves (impact: logic naming an amount).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

STRATEGIES = ("greeting", "inquiry", "credibility", "logic", "emotion", "story", "ask", "pressure")
SMALL_ASK = 1.0
LONG_WORDS = 60

_NUM = r"(?:\d+(?:\.\d+)?|a|one|two|half a|half of a)"
_WORDS = {"a": 1.0, "one": 1.0, "two": 2.0, "half a": 0.5, "half of a": 0.5}

PATTERNS: dict[str, list[str]] = {
    "greeting": [r"\b(hello|hi|hey|greetings|good (morning|afternoon|evening)|how are you|nice to (meet|talk)|thanks? (you )?for (your|taking))\b"],
    "inquiry": [r"\b(have you (ever )?heard|do you (have|know|ever|usually|often|like)|are you familiar|what do you think|how do you feel|"
                r"what matters|what (would|could) (make|help)|is there anything|may i ask|can i ask|any (questions|concerns))\b[^?]*\?"],
    "credibility": [r"\b(founded|since 19\d\d|(100|hundred) years|a century|track record|reputable|trusted|transparen\w*|audit\w*|"
                    r"(independently )?rated|charity navigator|four[- ]star|accountab\w*|financial reports?|annual reports?|registered charity|"
                    r"accredited)\b",
                    r"\b\d{2}(\.\d)? ?(%|percent\b)[^.?!]*\b(programs?|directly|goes|go)\b"],
    "logic": [rf"(\${_NUM}|\b{_NUM} (dollars?|cents?))\b[^.?!]{{0,20}}\b(can |could |will |would )?(buys?|provides?|pays? for|feeds?|covers?|gives?|supplies|vaccinates?)\b",
              r"\b(millions?|thousands?|statistics?|studies|research|data|evidence|per child|cost[- ]effective|every dollar|each dollar|measurable|results)\b"],
    "emotion": [r"\b(imagine|heartbreak\w*|suffer\w*|hungry|hunger|starv\w*|desperate|tragic|afraid|scared|alone|tears|hopeless|hope|"
                r"pain|crying|vulnerable|innocent)\b"],
    "story": [r"\b(a (little |young )?(girl|boy|child|mother) (named|called)|i met|i remember|my own (kids|children)|my (daughter|son|kids)|"
              r"when i (visited|was)|one story|her name (is|was)|his name (is|was))\b"],
    "ask": [r"\b(would|could|will|can|might) you (please )?(consider |like to |be willing to |want to |be able to )?(donat\w*|give|giving|contribut\w*|spare|chip in|pledge)\b",
            r"\bhow much (would|could|will|can|are|do) you\b", r"\b(please )?(donate|give|pledge) (just |only )?(\$|\d|a dollar|one dollar|two dollars|half)",
            r"\bhow (does|about) (a|an|starting with|just)? ?\$?\d[^?]*\?", r"\bcan (we|i) count on you\b", r"\bwould you like to (help|support|join)\b"],
    "pressure": [r"\b(you (should|must|have to|need to|owe)|don'?t be (selfish|cheap|stingy)|it'?s only|right now|hurry|last chance|"
                 r"what'?s stopping you|no excuse|surely|come on|everyone else|shame)\b"],
}
_COMPILED = {s: [re.compile(p, re.I) for p in ps] for s, ps in PATTERNS.items()}

CONCERN_ANSWERS = {
    "overhead": re.compile(r"\b\d{2}(\.\d)? ?(%|percent\b)|\b(financial reports?|annual reports?|audit\w*|overhead|transparen\w*)\b", re.I),
    "scam": re.compile(r"\b(registered charity|rated|charity navigator|four[- ]star|founded|since 19\d\d|(100|hundred) years|a century|track record|accredited|reputable)\b", re.I),
    "impact": re.compile(rf"(\${_NUM}|\b{_NUM} (dollars?|cents?))\b[^.?!]{{0,20}}\b(can |could |will |would )?(buys?|provides?|pays? for|feeds?|covers?|gives?|supplies|vaccinates?)\b", re.I),
}

_AMOUNT = re.compile(r"\$\s?(\d+(?:\.\d{1,2})?)|\b(\d+(?:\.\d+)?|a|one|two|half a|half of a) (dollars?|bucks?)\b|\b(\d+) cents?\b|\bhalf (of )?(your|the) (payment|pay|\$2)\b", re.I)


@dataclass(frozen=True)
class Reading:
    """What the rule set recognises in one message."""

    strategies: frozenset[str]
    amount: float | None  # the amount an ask names, if any
    long: bool

    @property
    def small_ask(self) -> bool:
        return "ask" in self.strategies and self.amount is not None and self.amount <= SMALL_ASK


def amounts(text: str) -> list[float]:
    """Every dollar amount the text names, in order."""
    out = []
    for m in _AMOUNT.finditer(text):
        if m.group(1):
            out.append(float(m.group(1)))
        elif m.group(2):
            out.append(_WORDS.get(m.group(2).lower(), None) or float(m.group(2)))
        elif m.group(4):
            out.append(int(m.group(4)) / 100)
        else:
            out.append(1.0)  # half of the $2 payment
    return out


def asked_amount(text: str) -> float | None:
    """The amount an ask names: the first amount in a sentence that asks, or None. An amount in a
    sentence that does not ask ("$1 provides a meal") is an argument, not the ask."""
    for sentence in re.split(r"(?<=[.?!])\s+", text):
        if any(p.search(sentence) for p in _COMPILED["ask"]) and (found := amounts(sentence)):
            return found[0]
    return None


def recognise(text: str) -> Reading:
    found = frozenset(s for s, ps in _COMPILED.items() if any(p.search(text) for p in ps))
    amount = asked_amount(text) if "ask" in found else None
    return Reading(found, amount, len(text.split()) > LONG_WORDS)


def answers_concern(text: str, concern: str | None) -> bool:
    return concern is not None and CONCERN_ANSWERS[concern].search(text) is not None
