"""The LLM roles of the question games (TwentyQuestions, GuessMyCity): their prompt templates,
and the parsers of what the roles send back that do not depend on the game (summary, proposals,
reward, rubric, controller places, a continuation's lines).

Every parser raises ValueError saying what is wrong, so the caller can sample again and, in the
end, record the reason. A parser reads only the model's output, never the prompt, and refuses an
output that echoes the prompt back: the games' prompts share the section marks below.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import jinja2

from envs.base import Counterfactual, Request, Unfinished
from envs.reason_question import render_action
from envs.rubric import Rubric

# Marks of the games' prompts that an answer never contains unless it is repeating the prompt.
ECHO_MARKS = (
    "## Questions and answers", "## Summary of the whole game", "<Game", "Reply with", "Now rate this game",
    "=== GAME ===", "Name the top", "Use exactly these labels", "Here is the start of a game",
)


class Prompts:
    """One package's Jinja2 templates (its prompts/ folder)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.templates = jinja2.Environment(
            loader=jinja2.FileSystemLoader(folder), undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, autoescape=False
        )

    def render(self, name: str, **context: object) -> str:
        return self.templates.get_template(name).render(**context).strip()

    def chat(self, name: str, **context: object) -> list[dict[str, str]]:
        """A system and a user message from one template (its `system` flag picks the part)."""
        return [
            {"role": "system", "content": self.render(name, system=True, **context)},
            {"role": "user", "content": self.render(name, system=False, **context)},
        ]

    def hash(self, *names: str) -> str:
        """Content hash of the templates a role renders: rows record it, so a reworded prompt shows."""
        h = hashlib.sha256()
        for name in names:
            h.update((self.folder / name).read_bytes())
        return h.hexdigest()[:12]


def dialogue(history: list[tuple[str, str]]) -> str:
    """The game as numbered question/answer lines, the form every role's prompt shows."""
    return "\n".join(f"Q{i + 1}: {q}\nA{i + 1}: {a}" for i, (q, a) in enumerate(history))


def no_echo(text: str) -> None:
    mark = next((m for m in ECHO_MARKS if m in text), None)
    if mark:
        raise ValueError(f"the output repeats the prompt ({mark!r})")


# ---- summarizer (HOPE's pi_sum) ----


def parse_summary(text: str, max_chars: int = 2000) -> str:
    text = text.strip()
    if not text:
        raise ValueError("empty summary")
    no_echo(text)
    if len(text) > max_chars:
        raise ValueError(f"summary of {len(text)} characters, over {max_chars}")
    if not re.search(r"[A-Za-z]{3,}", text):
        raise ValueError("summary has no words")
    return " ".join(text.split())


# ---- hindsight proposer (HOPE's pi_H) ----


@dataclass(frozen=True)
class LLMProposal:
    teacher_reason: str
    question: str
    player_reason: str


def _json_block(text: str) -> str:
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
    if fenced:
        return fenced.group(1)
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end < start:
        raise ValueError("no JSON list in the output")
    return text[start : end + 1]


def proposal_items(text: str, n: int, keys: Sequence[str]) -> list[tuple[dict, dict[str, str]]]:
    """Up to n proposals of a proposer's JSON list (fenced or bare), each as (the item as given,
    its `keys`' non-empty texts with whitespace collapsed); the environment checks the rest
    (and first that the text does not echo its own prompt)."""
    try:
        items = json.loads(_json_block(text))
    except json.JSONDecodeError as e:
        raise ValueError(f"JSON does not parse: {e.msg} at character {e.pos}") from None
    if not isinstance(items, list) or not items:
        raise ValueError("expected a non-empty JSON list of proposals")
    out = []
    for i, item in enumerate(items[:n]):
        if not isinstance(item, dict):
            raise ValueError(f"proposal {i}: expected an object, got {type(item).__name__}")
        fields = {}
        for key in keys:
            value = item.get(key)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"proposal {i}: missing or empty {key!r}")
            fields[key] = " ".join(value.split())
        out.append((item, fields))
    return out


def parse_proposals(text: str, n: int, hidden: Mapping[str, Iterable[str]]) -> list[LLMProposal]:
    """Up to n proposals. The question must be one line; the player's reason must name none of
    the `hidden` words (what it is, e.g. "secret", to its names): it enters the policy's action,
    and only the teacher may use hindsight."""
    no_echo(text)
    out = []
    for i, (item, fields) in enumerate(proposal_items(text, n, ("teacher_reason", "question", "player_reason"))):
        if len(fields["question"]) > 200 or "\n" in item["question"].strip():
            raise ValueError(f"proposal {i}: the question is not one short line")
        leaked = next((what for what, words in hidden.items() for w in words if re.search(rf"\b{re.escape(w)}\b", fields["player_reason"], re.I)), None)
        if leaked:
            raise ValueError(f"proposal {i}: player_reason names the hidden {leaked}")
        out.append(LLMProposal(**fields))
    return out


def proposal_reply(proposals: Sequence[Counterfactual]) -> str:
    """The reply parse_proposals reads back as `proposals`: the JSON list the prompt asks for,
    fenced as it asks, one line (fewer tokens for the distilled proposer to learn)."""
    if not proposals:
        raise ValueError("no proposals to write a reply of")
    items = [{"teacher_reason": p.rationale, "question": p.action, "player_reason": p.reason} for p in proposals]
    return "```json\n" + json.dumps(items, ensure_ascii=False) + "\n```"


# ---- reward labeler (HR's few-shot labeler) ----

_REWARD_LINE = re.compile(r"^\s*Reward:\s*(-?\d+(?:\.\d+)?)\s*$", re.I)


def parse_reward(text: str, low: float, high: float) -> float:
    """The label is the output's one "Reward: <number>" line, in [low, high]. Several such lines
    (an echoed example, a dialogue that itself says "Reward: 10") make the output ambiguous."""
    no_echo(text)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    found = [m for m in (_REWARD_LINE.match(line) for line in lines) if m]
    if not found:
        raise ValueError("no line 'Reward: <number>'")
    if len(found) > 1:
        raise ValueError(f"{len(found)} 'Reward:' lines; expected one")
    value = float(found[0].group(1))
    if not low <= value <= high:
        raise ValueError(f"reward {value:g} outside [{low:g}, {high:g}]")
    return value


# ---- rubric judge (Refit's labeler) ----

RUBRIC = Rubric(("Progress", "Question quality", "Consistency", "Efficiency", "Outcome", "Overall"))


def parse_rubric(text: str) -> dict[str, float]:
    no_echo(text)
    return RUBRIC.parse(text)


# ---- hindsight controller (HR) ----

_PLACE = re.compile(r'^\s*\d+\.\s*"(?P<said>[^"]+)"\s*;(?P<critique>[^;]*);\s*"(?P<instead>[^"]+)"\s*/?\s*$')


@dataclass(frozen=True)
class Place:
    turn: int  # 0-based index of the player's question that the controller quoted
    critique: str  # hindsight; may use the secret, never enters the action
    replacement: str


def parse_controller(text: str, questions: list[str], top: int) -> list[Place]:
    """HR's `1. "said";critique;"instead"/` lines. A quote must be one of the player's questions
    (so the place is known); lines that are not places, or quote nothing the player asked, are
    refused with the output rather than guessed at."""
    no_echo(text)
    norm = [" ".join(q.lower().split()) for q in questions]
    places, seen = [], set()
    for line in (line for line in text.strip().splitlines() if line.strip()):
        m = _PLACE.match(line)
        if not m:
            raise ValueError(f"not a place line: {line.strip()[:60]!r}")
        said = " ".join(m["said"].lower().split())
        turn = next((i for i, q in enumerate(norm) if q == said), None)
        if turn is None:
            raise ValueError(f"quotes {m['said'][:60]!r}, which the player never asked")
        instead = " ".join(m["instead"].split())
        if turn in seen or " ".join(instead.lower().split()) == said:
            continue  # a place named twice, or a replacement equal to what was said
        seen.add(turn)
        places.append(Place(turn, " ".join(m["critique"].split()), instead))
    if not places:
        raise ValueError("no place to improve")
    return places[:top]


# ---- forward model (HR): the rest of the game, both sides ----

_Q_LINE = re.compile(r"^\s*Q(\d+):\s*(.+?)\s*$")
_A_LINE = re.compile(r"^\s*A(\d+):\s*(.*?)\s*$")


def parse_continuation(text: str, start: int, max_turns: int, read_answer: Callable[[str], str | None], expected: str) -> list[tuple[str, str]]:
    """(question, answer) pairs from "Q<n>: ..." / "A<n>: ..." lines, numbered on from `start`
    (1-based), alternating, each question answered, none past question max_turns. `read_answer`
    gives the game's answer from the text after "A<n>:", or None when it is not one (`expected`
    says what is, for the error)."""
    no_echo(text)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if not lines:
        raise ValueError("empty continuation")
    pairs: list[tuple[str, str]] = []
    for i in range(0, len(lines), 2):
        number = start + i // 2
        q = _Q_LINE.match(lines[i])
        if not q or int(q.group(1)) != number:
            raise ValueError(f"line {i + 1}: expected 'Q{number}: <question>', got {lines[i].strip()[:50]!r}")
        if number > max_turns:
            raise ValueError(f"question {number} is past the game's {max_turns}")
        if i + 1 >= len(lines):
            raise ValueError(f"Q{number} has no answer")
        a = _A_LINE.match(lines[i + 1])
        answer = read_answer(a.group(2)) if a and int(a.group(1)) == number else None
        if answer is None:
            raise ValueError(f"line {i + 2}: expected 'A{number}: {expected}', got {lines[i + 1].strip()[:50]!r}")
        pairs.append((q.group(2), answer))
    return pairs


# ---- the requests both question games build alike ----


def history(turns: Sequence[Mapping]) -> list[tuple[str, str]]:
    """(question, answer) pairs of a trajectory's turns."""
    return [(t["action"], t["observation"]) for t in turns]


def replay_continuation(pairs: list[tuple[str, str]], start: int, replay, view: Callable, refused: Callable, answer: Callable) -> list[tuple[str, object]]:
    """A forward model's continuation played out on `replay` (the game after the prefix): the game
    must end exactly at its last line (a win, or the last question answered), and each question
    must be a move the player could have made (`refused(view(replay), question)`: why not, or
    None; the forward model knows the secret, its player must not use it). `answer(replay,
    question, text)` is the game's answer to a line. Returns (action text, answer) per line."""
    out = []
    for k, (q, a) in enumerate(pairs):
        if replay.done:
            raise ValueError(f"Q{start + k} comes after the game ended")
        if (why := refused(view(replay), q)) is not None:
            raise ValueError(f"Q{start + k} {why}")
        try:
            reply = answer(replay, q, a)
        except ValueError as e:
            raise ValueError(f"A{start + k}: {e}") from None
        replay.step(q, reply)
        out.append((render_action("", q), reply))
    if not replay.done:
        raise Unfinished(f"the continuation stops at Q{start + len(out) - 1} before the game ends")
    return out


class QuestionRoleRequests:
    """HR's hindsight controller, the few-shot labeler and the rubric judge, as both question
    games ask them, and the reply format of their proposer. The environment gives its prompts
    (`prompt(template, **values)`), the name its templates give the secret (`secret_key`), and
    `refused(task, prefix, question)`: why the player could not have asked `question` after the
    logged turns `prefix`, or None."""

    secret_key: str
    max_turns: int
    reward_range: tuple[float, float]

    def prompt(self, template: str, **values) -> list[dict]:
        raise NotImplementedError

    def refused(self, task, prefix: Sequence[Mapping], question: str) -> str | None:
        raise NotImplementedError

    def proposer_reply(self, proposals: Sequence[Counterfactual]) -> str:
        return proposal_reply(proposals)

    def forward_reply(self, game, turns) -> str:
        """The logged questions and answers after `game`'s turns, numbered on, as the forward
        model's parser reads them."""
        start = game.turn + 1
        return "\n".join(f"Q{start + i}: {t['action']}\nA{start + i}: {t['observation']}" for i, t in enumerate(turns))

    def controller_request(self, task, turns, top: int) -> Request[list[tuple[int, Counterfactual]]]:
        played = history(turns)
        prompt = self.prompt("controller.j2", **{self.secret_key: task.name}, dialogue=dialogue(played), top=top)

        def parse(text: str) -> list[tuple[int, Counterfactual]]:
            """parse_controller, refusing a replacement the player could not have asked at its
            place (a guess of the secret with hindsight). HR's replacement is the utterance alone,
            so its reason is empty; the critique uses hindsight and stays out of the action."""
            out = []
            for i, place in enumerate(parse_controller(text, [q for q, _ in played], top)):
                if (why := self.refused(task, turns[: place.turn], place.replacement)) is not None:
                    raise ValueError(f"place {i + 1}: the replacement {why}")
                out.append((place.turn, Counterfactual(render_action("", place.replacement), place.replacement, "", place.critique)))
            return out

        return Request(prompt, parse)

    def labeler_request(self, turns, examples) -> Request[float]:
        shots = [{"dialogue": dialogue(history(t)), "reward": r} for t, r in examples]
        prompt = self.prompt("labeler.j2", max_turns=self.max_turns, examples=shots, dialogue=dialogue(history(turns)))
        low, high = self.reward_range
        return Request(prompt, lambda text: parse_reward(text, low, high))

    def judge_request(self, task_id: str, turns) -> Request[dict[str, float]]:
        return Request(self.prompt("judge.j2", max_turns=self.max_turns, **{self.secret_key: task_id}, dialogue=dialogue(history(turns))), parse_rubric)
