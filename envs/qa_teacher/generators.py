"""Question generators over the data the project ships. Each draws its questions from a seeded
generator of its own per split, and from that split's objects only, so a test question is about
objects no train question mentions (checked by tests/test_qa_teacher.py against the data):

- twenty_questions: TwentyQuestions' knowledge base (envs/twenty_questions/data/objects.yaml):
  which of four objects gets "yes" (or "no") to one of its attribute or category questions.
  Tests knowing the properties of everyday things. Objects in the knowledge base's own splits
  (110 / 28 / 20; test holds its two unseen categories, musical instruments and electronics).
- cities: GuessMyCity's cities and facts (envs/guess_my_city/data): the country a city is in, or
  the city a landmark belongs to. Tests world knowledge. Cities in GuessMyCity's splits (119 /
  29 / 30; test holds the unseen countries Canada, Cuba and Ethiopia).
- car_dealer: CarDealer's catalogue (envs/car_dealer/data/catalog.json): a model's base price, or
  its list price with two features by the catalogue's rule (base plus each feature's add-on, all
  given in the question). Tests recall of the catalogue, and reading and adding given numbers.
  The 50 (brand, type) models are partitioned by a seeded shuffle into 30 / 8 / 12.
- arithmetic: two-step word problems with a student's wrong solution shown, in the spirit of
  MathDial: which option is the correct final answer. The student's answer is always an option,
  beside two other typical slips. Tests computing past a plausible wrong lead. A problem (its
  template and numbers) belongs to one split by a seeded hash (60 / 20 / 20 %).

Each option's fact and false fact (questions.py) are short statements of the form
"<subject>: <what holds>", so the scripted answerers' replies stay within a small model's reach.
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

from envs.car_dealer.data import load_catalog
from envs.guess_my_city.cities import load_cities
from envs.guess_my_city.oracle import load_oracle
from envs.twenty_questions.kb import load_kb

from .questions import LETTERS, SPLITS, Question, check_question

# One option: its text, its fact, its false fact. The key comes first in a draw.
Option = tuple[str, str, str]


@dataclass(frozen=True)
class Draw:
    question: str
    options: list[Option]  # the key first, then three distractors
    objects: tuple[str, ...]


def seeded(*parts: object) -> random.Random:
    return random.Random(int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "big"))


def arrange(rng: random.Random, draw: Draw) -> tuple[tuple[str, ...], str, tuple[str, ...], tuple[str, ...]]:
    """The options in a random order: (texts, key letter, facts, false facts)."""
    order = list(range(4))
    rng.shuffle(order)
    texts, facts, false = zip(*(draw.options[i] for i in order))
    return texts, LETTERS[order.index(0)], facts, false


# ---- TwentyQuestions' knowledge base ----

def twenty_questions(split: str, seed: int) -> Callable[[random.Random], Draw]:
    kb = load_kb()
    things = kb.split(split)

    def draw(rng: random.Random) -> Draw:
        # A question one of four objects answers differently from the other three; "no" questions
        # ask for the odd one out among three that have the property.
        wanted = rng.random() < 0.75
        usable = []
        for q in kb.questions:
            odd = [e for e in things if kb.truth(e, q) == wanted]
            rest = [e for e in things if kb.truth(e, q) != wanted]
            if odd and len(rest) >= 3:
                usable.append((q, odd, rest))
        q, odd, rest = rng.choice(usable)
        chosen = [rng.choice(odd), *rng.sample(rest, 3)]

        def option(e) -> Option:
            yes = kb.truth(e, q)
            said, unsaid = (q.label, q.no_label) if yes else (q.no_label, q.label)
            return e.name, f"{e.name}: {said}.", f"{e.name}: {unsaid}."

        answer = "yes" if wanted else "no"
        return Draw(f'For which of these is the answer to "{q.text}" {answer}?', [option(e) for e in chosen], tuple(e.name for e in chosen))

    return draw


# ---- GuessMyCity's cities ----

def cities(split: str, seed: int) -> Callable[[random.Random], Draw]:
    data = load_cities()
    facts = load_oracle(data).facts
    here = data.split(split)
    countries = sorted({c.country for c in data.cities})

    def country(rng: random.Random) -> Draw:
        city = rng.choice(here)
        others = rng.sample([c for c in countries if c != city.country], 3)
        options = [(city.country, f"{city.name}: in {city.country}.", f"{city.name}: not in {city.country}."),
                   *((c, f"{city.name}: not in {c}.", f"{city.name}: in {c}.") for c in others)]
        return Draw(f"In which country is the city of {city.name}?", options, (city.id,))

    def landmark(rng: random.Random) -> Draw:
        city, *others = rng.sample(here, 4)
        sight = facts[city.id].landmark
        # "this": the landmark the question names, kept out of the facts so a reply stays short
        options = [(city.name, f"{city.name}: known for this.", f"{city.name}: not known for this."),
                   *((c.name, f"{c.name}: not known for this.", f"{c.name}: known for this.") for c in others)]
        return Draw(f"Which city is known for {sight}?", options, tuple(c.id for c in (city, *others)))

    return lambda rng: (country if rng.random() < 0.5 else landmark)(rng)


# ---- CarDealer's catalogue ----

CAR_SPLIT_SIZES = {"train": 30, "val": 8, "test": 12}


def car_models(seed: int) -> dict[str, list[tuple[str, str]]]:
    """The catalogue's (brand, type) models partitioned into the splits by a seeded shuffle."""
    catalog = load_catalog()
    models = [(b, t) for b in catalog.brands for t in catalog.types]
    seeded(seed, "car-models").shuffle(models)
    out, start = {}, 0
    for split, n in CAR_SPLIT_SIZES.items():
        out[split], start = models[start : start + n], start + n
    return out


def article(name: str) -> str:
    return "an" if name[0].lower() in "aeiou" else "a"


def car_dealer(split: str, seed: int) -> Callable[[random.Random], Draw]:
    catalog = load_catalog()
    models = car_models(seed)[split]
    price = {m: catalog.base_msrp[m[0]][m[1]] for m in models}
    features = sorted(catalog.added_value)

    def base_price(rng: random.Random) -> Draw:
        model = rng.choice(models)
        name, p = f"{model[0]} {model[1]}", price[model]
        others = rng.sample(sorted({v for v in price.values() if v != p}), 3)
        options = [(f"${p:,}", f"${p:,}: the {name}'s base price.", f"${p:,}: not the {name}'s base price."),
                   *((f"${q:,}", f"${q:,}: not the {name}'s base price.", f"${q:,}: the {name}'s base price.") for q in others)]
        return Draw(f"In the dealership's catalogue, what is the base price of {article(name)} {name}?", options, (name,))

    def list_price(rng: random.Random) -> Draw:
        model = rng.choice(models)
        name, b = f"{model[0]} {model[1]}", price[model]
        f1 = rng.choice(features)
        f2 = rng.choice([f for f in features if catalog.added_value[f] != catalog.added_value[f1]])  # else two slips coincide
        v1, v2 = catalog.added_value[f1], catalog.added_value[f2]
        total = b + v1 + v2
        slips = [(b, "the base price alone"), (b + v1, f"leaves out the {f2}"), (b + v2, f"leaves out the {f1}")]
        options = [(f"${total:,}", f"${b:,} + ${v1:,} + ${v2:,} = ${total:,}.", f"${total:,}: not the list price."),
                   *((f"${x:,}", f"${x:,}: {why}.", f"${x:,}: the list price.") for x, why in slips)]
        question = (f"In the dealership's catalogue {article(name)} {name} has a base price of ${b:,}; {f1} adds ${v1:,} and {f2} adds ${v2:,}. "
                    f"What is the list price of {article(name)} {name} with {f1} and {f2}?")
        return Draw(question, options, (name,))

    return lambda rng: (base_price if rng.random() < 0.5 else list_price)(rng)


# ---- arithmetic with a student's wrong solution (MathDial's spirit) ----

NAMES = ("Ana", "Ben", "Chen", "Dina", "Eli", "Farah", "Gus", "Hana", "Ivan", "Jade")
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "cards", "shells", "books")
ARITHMETIC_SHARES = {"train": 0.6, "val": 0.2, "test": 0.2}


def arithmetic_split(seed: int, key: tuple) -> str:
    """The split a problem (its template and numbers) belongs to, by a seeded hash."""
    u = int.from_bytes(hashlib.sha256(f"{seed}/arithmetic/{key}".encode()).digest()[:8], "big") / 2**64
    edge = 0.0
    for split, share in ARITHMETIC_SHARES.items():
        edge += share
        if u < edge:
            return split
    return "test"


@dataclass(frozen=True)
class Problem:
    key: tuple  # template and numbers: what decides the split
    question: str
    work: str  # the correct computation
    answer: int
    student: tuple[int, str, str]  # the shown wrong solution: its answer, its steps, its slip
    slips: tuple[tuple[int, str], ...]  # two more typical wrong answers and their slips


def _packs(rng: random.Random) -> Problem:
    a, b = rng.randint(2, 9), rng.randint(3, 12)
    c = rng.randint(1, min(9, a * b - 1))
    who, item = rng.choice(NAMES), rng.choice(ITEMS)
    return Problem(
        ("packs", a, b, c), f"{who} buys {a} packs of {item} with {b} in each pack and gives {c} away. How many {item} does {who} have left?",
        f"{a} x {b} = {a * b}, {a * b} - {c} = {a * b - c}.", a * b - c,
        (a + b - c, f"{a} + {b} = {a + b}, {a + b} - {c} = {a + b - c}.", f"adds {a} and {b} instead of multiplying"),
        ((a * b, f"forgets to take away the {c}"), (a * b + c, f"adds the {c} instead of taking it away")))


def _share(rng: random.Random) -> Problem:
    c = rng.randint(2, 6)
    a, b = c * rng.randint(1, 8), c * rng.randint(1, 8)
    who, item = rng.choice(NAMES), rng.choice(ITEMS)
    return Problem(
        ("share", a, b, c), f"{who} has {a} {item} and buys {b} more, then shares them equally among {c} friends. How many {item} does each friend get?",
        f"{a} + {b} = {a + b}, {a + b} / {c} = {(a + b) // c}.", (a + b) // c,
        (a + b // c, f"{b} / {c} = {b // c}, {a} + {b // c} = {a + b // c}.", f"shares only the {b} new {item}"),
        ((a + b, "forgets to share them out"), ((a + b) * c, f"multiplies by {c} instead of dividing")))


def _change(rng: random.Random) -> Problem:
    a, b = rng.randint(2, 9), rng.randint(2, 6)
    c = next(v for v in (20, 50, 100) if v > a * b + a + b)
    who, item = rng.choice(NAMES), rng.choice(ITEMS)
    return Problem(
        ("change", a, b, c), f"{who} buys {b} {item} at ${a} each and pays with a ${c} note. How many dollars of change does {who} get?",
        f"{a} x {b} = {a * b}, {c} - {a * b} = {c - a * b}.", c - a * b,
        (c - a - b, f"{c} - {a} - {b} = {c - a - b}.", f"takes away {a} and {b} instead of {a} x {b}"),
        ((a * b, "is the cost, not the change"), (c - a, "pays for one item only")))


PROBLEMS = (_packs, _share, _change)


def arithmetic(split: str, seed: int) -> Callable[[random.Random], Draw]:
    def draw(rng: random.Random) -> Draw:
        while True:  # a problem of another split is drawn again: the splits never share one
            p = rng.choice(PROBLEMS)(rng)
            slips = [p.student[0::2], *p.slips]
            values = {p.answer, *(x for x, _ in slips)}
            if arithmetic_split(seed, p.key) == split and len(values) == 4 and min(values) >= 0:
                break
        options = [(str(p.answer), p.work, f"{p.answer}: wrong."), *((str(x), f"{x}: {why}.", f"{x}: the right answer.") for x, why in slips)]
        shown = f"A student solved it like this: {p.student[1][:-1]}, and got {p.student[0]}."
        return Draw(f"{p.question} {shown} Which of the following is the correct final answer?", options, ("/".join(map(str, p.key)),))

    return draw


INSTRUCTIONS = {
    "twenty_questions": "This question is about everyday things and their properties.",
    "cities": "This question is about cities of the world.",
    "car_dealer": "This question is about a car dealership's catalogue and its prices.",
    "arithmetic": "This question is about a math word problem. A student's attempt is shown; it may be wrong.",
}
GENERATORS: dict[str, Callable[[str, int], Callable[[random.Random], Draw]]] = {
    "twenty_questions": twenty_questions, "cities": cities, "car_dealer": car_dealer, "arithmetic": arithmetic,
}


def generate(names: tuple[str, ...], sizes: dict[str, int], seed: int) -> dict[str, list[Question]]:
    """Each split's questions: `sizes[split]` shared among the generators `names` as evenly as
    the count allows (the first ones take the remainder), taken in turn. Generator g's k-th
    question of a split is the k-th distinct draw of its own seeded generator, so a larger size
    adds questions and never changes one already made."""
    out = {}
    for split in SPLITS:
        made = {}
        for i, name in enumerate(names):
            n = sizes[split] // len(names) + (i < sizes[split] % len(names))
            made[name] = _distinct(name, split, seed, n)
        longest = max((len(v) for v in made.values()), default=0)
        out[split] = [made[name][k] for k in range(longest) for name in names if k < len(made[name])]
    return out


def _distinct(name: str, split: str, seed: int, n: int, tries: int = 200) -> list[Question]:
    draw, rng = GENERATORS[name](split, seed), seeded(seed, name, split)
    seen, out = set(), []
    misses = 0
    while len(out) < n:
        d = draw(rng)
        texts, answer, facts, false = arrange(rng, d)
        identity = (d.question, frozenset(texts))
        if identity in seen:
            misses += 1
            if misses > tries * max(1, n):
                raise ValueError(f"generator {name!r} found only {len(out)} distinct {split} questions of the {n} asked")
            continue
        seen.add(identity)
        q = Question(f"{name}-{split}-{len(out):03d}", split, name, d.question, texts, answer, INSTRUCTIONS[name], facts, false, d.objects)
        check_question(q)
        out.append(q)
    return out
