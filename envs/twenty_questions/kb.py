"""The TwentyQuestions world: objects, their categories and attributes, and the question set.

Everything the oracle may answer is defined in `data/objects.yaml`; anything else gets "unknown".
"""
from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml

DATA_PATH = Path(__file__).parent / "data" / "objects.yaml"
# HOPE's split sizes; a word list that drifts from them is a data error, not a config choice.
EXPECTED_COUNTS = {"train": 110, "val": 28, "test": 20}

_GUESS = re.compile(r"^is it (?:(?:a|the) )?(.+)$")  # applied to normalize()d text


class KBError(ValueError):
    """The objects YAML is malformed; the message names the file, object and field."""


@dataclass(frozen=True)
class Entity:
    name: str
    aliases: tuple[str, ...]
    category: str
    split: str
    attributes: frozenset[str]
    also: frozenset[str] = frozenset()  # further categories it plainly belongs to

    @property
    def id(self) -> str:
        """The task id: trajectories name an object by its name."""
        return self.name


@dataclass(frozen=True)
class Question:
    text: str
    kind: Literal["category", "attribute"]
    key: str  # category name or attribute name
    label: str  # short fact when the answer is yes, e.g. "animal"
    no_label: str  # short fact when the answer is no, e.g. "not animal"


def normalize(text: str) -> str:
    """Lower case, single spaces, no trailing punctuation, "an" read as "a"."""
    words = text.lower().split()
    text = " ".join("a" if w == "an" else w for w in words)
    return text.rstrip("?.!,;: ")


class KnowledgeBase:
    def __init__(self, entities: Iterable[Entity], questions: Iterable[Question]):
        self.entities: tuple[Entity, ...] = tuple(entities)
        self.questions: tuple[Question, ...] = tuple(questions)
        self.categories: tuple[str, ...] = tuple(q.key for q in self.questions if q.kind == "category")
        self._by_text = {normalize(q.text): q for q in self.questions}
        self._by_name = {normalize(n): e for e in self.entities for n in (e.name, *e.aliases)}

    def split(self, name: str) -> list[Entity]:
        if name not in EXPECTED_COUNTS:
            raise KeyError(f"unknown split {name!r}; expected one of {sorted(EXPECTED_COUNTS)}")
        return [e for e in self.entities if e.split == name]

    def get(self, name: str) -> Entity:
        """The object with this name or alias (case-insensitive)."""
        try:
            return self._by_name[normalize(name)]
        except KeyError:
            raise KeyError(f"unknown object {name!r}") from None

    def truth(self, entity: Entity, question: Question) -> bool:
        if question.kind == "category":
            return question.key == entity.category or question.key in entity.also
        return question.key in entity.attributes

    def match_question(self, text: str) -> Question | None:
        return self._by_text.get(normalize(text))

    def resolve_guess(self, text: str) -> Entity | None:
        """The object named by "Is it X?" / "Is it a/an/the X?", from any split."""
        m = _GUESS.match(normalize(text))
        return self._by_name.get(m.group(1)) if m else None


@functools.cache
def load_kb(path: str | Path = DATA_PATH) -> KnowledgeBase:
    """Load and validate the objects YAML (cached per path)."""
    path = Path(path)
    try:
        return _build(yaml.safe_load(path.read_text()))
    except yaml.YAMLError as e:
        raise KBError(f"{path}: not valid YAML: {e}") from None
    except KBError as e:
        raise KBError(f"{path}: {e}") from None


def _require(cond: object, where: str, msg: str) -> None:
    if not cond:
        raise KBError(f"{where}: {msg}")


def _question(spec: object, kind: Literal["category", "attribute"], key: str) -> Question:
    where = f"{kind} {key!r}"
    _require(isinstance(spec, dict), where, "expected a mapping with 'question' and 'label'")
    unknown = set(spec) - {"question", "label", "no_label"}
    _require(not unknown, where, f"unknown field(s) {sorted(unknown)}")
    for field in ("question", "label"):
        _require(isinstance(spec.get(field), str) and spec[field].strip(), where, f"'{field}' must be a non-empty string")
    no_label = spec.get("no_label", f"not {spec['label']}")
    _require(isinstance(no_label, str) and no_label.strip(), where, "'no_label' must be a non-empty string")
    return Question(spec["question"], kind, key, spec["label"], no_label)


def _build(raw: object) -> KnowledgeBase:
    _require(isinstance(raw, dict), "top level", "expected a mapping")
    for key in ("attributes", "categories", "splits"):
        _require(isinstance(raw.get(key), dict), "top level", f"missing mapping '{key}'")
    questions = [_question(spec, "category", key) for key, spec in raw["categories"].items()]
    questions += [_question(spec, "attribute", key) for key, spec in raw["attributes"].items()]

    entities: list[Entity] = []
    for split, by_category in raw["splits"].items():
        _require(split in EXPECTED_COUNTS, f"split {split!r}", f"unknown split; expected {sorted(EXPECTED_COUNTS)}")
        _require(isinstance(by_category, dict), f"split {split!r}", "expected category -> objects")
        for category, objects in by_category.items():
            _require(category in raw["categories"], f"split {split!r}", f"unknown category {category!r}")
            _require(isinstance(objects, list), f"{split}/{category}", "expected a list of objects")
            entities += [_entity(obj, split, category, raw) for obj in objects]

    for split, expected in EXPECTED_COUNTS.items():
        n = sum(e.split == split for e in entities)
        _require(n == expected, f"split {split!r}", f"has {n} objects, expected {expected}")

    owner: dict[str, str] = {}
    for e in entities:
        for n in (e.name, *e.aliases):
            other = owner.setdefault(normalize(n), e.name)
            _require(other == e.name, f"object {e.name!r}", f"name/alias {n!r} already used by {other!r}")

    # Questions alone must be able to tell any two objects apart.
    seen: dict[tuple[str, frozenset[str]], str] = {}
    for e in entities:
        other = seen.setdefault((e.category, e.attributes), e.name)
        _require(other == e.name, f"object {e.name!r}", f"same category and attributes as {other!r}")

    kb = KnowledgeBase(entities, questions)
    texts: dict[str, str] = {}
    for q in questions:
        where = f"{q.kind} {q.key!r}"
        other = texts.setdefault(normalize(q.text), q.key)
        _require(other == q.key, where, f"question text duplicates that of {other!r}")
        _require(kb.resolve_guess(q.text) is None, where, f"question {q.text!r} reads as a guess")
    return kb


def _entity(obj: object, split: str, category: str, raw: dict) -> Entity:
    _require(isinstance(obj, dict) and isinstance(obj.get("name"), str), f"{split}/{category}", f"object without a 'name': {obj!r}")
    name = obj["name"]
    where = f"object {name!r} ({split}/{category})"
    unknown = set(obj) - {"name", "aliases", "also", "attributes"}
    _require(not unknown, where, f"unknown field(s) {sorted(unknown)}")
    aliases, also, attributes = obj.get("aliases", []), obj.get("also", []), obj.get("attributes")
    _require(isinstance(aliases, list) and all(isinstance(a, str) for a in aliases), where, "'aliases' must be a list of strings")
    _require(isinstance(attributes, list) and attributes, where, "'attributes' must be a non-empty list")
    bad = [a for a in attributes if a not in raw["attributes"]]
    _require(not bad, where, f"unknown attribute(s) {bad} in 'attributes'")
    _require(len(set(attributes)) == len(attributes), where, "duplicate entries in 'attributes'")
    _require(isinstance(also, list), where, "'also' must be a list of categories")
    bad = [c for c in also if c not in raw["categories"] or c == category]
    _require(not bad, where, f"unknown or own category {bad} in 'also'")
    return Entity(name, tuple(aliases), category, split, frozenset(attributes), frozenset(also))
