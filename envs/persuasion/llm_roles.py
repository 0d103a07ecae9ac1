"""Persuasion roles played by an LLM: their prompts (Jinja2 files in prompts/, in our own words
after HR's App. B: the controller's top places, the forward model's completion with a clear
decision, the two-step donation labeler) and the parsers that check what comes back.

Every parser raises ValueError saying what is wrong, so the caller samples again and in the end
records the reason. What enters a trajectory as the persuader's message must be something the
persuader could say: it must not name the donor's hidden profile (`leak`).
"""
from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence

from envs.base import Counterfactual, Request
from envs.base import Unfinished as Unfinished_
from envs.question_roles import parse_summary, proposal_items
from envs.rubric import Rubric

from .donor import OPENING, REACT, WARMTH, DonorReply, money, read_decision_line, read_observation
from .donors import Donor
from .format import PROMPTS, render_action
from .game import Conversation
from .roles import history

chat = PROMPTS.chat
template_hash = PROMPTS.hash
TEMPLATES = {
    "simulator": ("simulator.j2",), "summarizer": ("summary.j2",), "proposer": ("proposer.j2",), "controller": ("controller.j2",),
    "forward": ("forward.j2",), "labeler": ("labeler.j2",), "judge": ("judge.j2",),
}
PERSONA_TEXT = {
    "philanthropic": "You like giving to good causes and are glad to hear about them; you still want to know the money is well used.",
    "caring": "You care deeply about children and are moved by stories and by what children go through; dry numbers move you less.",
    "unfriendly": "You are busy and unfriendly: you want short, concrete messages, you dislike sad stories and small talk, and pushing makes you refuse.",
    "skeptical": "You distrust charities: you want facts, evidence and proof of where the money goes; emotional appeals and pressure make you trust them less.",
}
CONCERN_TEXT = {"overhead": "how much of the money actually reaches the children", "scam": "whether the charity is a scam",
                "impact": "whether a couple of dollars can make any difference"}
RUBRIC = Rubric(("Rapport", "Adaptation", "Arguments", "Respect", "Outcome", "Overall"))
ECHO_MARKS = ("=== DIALOGUE ===", "<Dialogue", "Reply with", "Rate this persuader", "Here is the start of a conversation", "Name the top")
MAX_REPLY_CHARS = 600


def no_echo(text: str) -> None:
    mark = next((m for m in ECHO_MARKS if m in text), None)
    if mark:
        raise ValueError(f"the output repeats the prompt ({mark!r})")


def dialogue(pairs: Sequence[tuple[str | None, str]], decisions: bool = True) -> str:
    """HR's transcript: "AI:" the persuader, "H:" the donor. Without `decisions` the game's
    decision lines are left out, so a labeler reads the donation from the donor's words alone."""
    lines = []
    for message, observation in pairs:
        lines.append(f"AI: {message if message is not None else '(said nothing: its message did not follow the format)'}")
        reply = read_observation(observation)
        if reply.text.startswith("Invalid action ("):
            reply = DonorReply(reply.text.split("\n", 1)[1] if "\n" in reply.text else "", reply.donation)
        words = reply.text.strip() or "(silence)"
        lines.append(f"H: {words}")
        if decisions and reply.donation is not None:
            lines.append(reply.decision_line())
    return "\n".join(lines)


def donor_phrases() -> list[str]:
    """The oracle donor's wording, for the tokenizer."""
    return [*sum(OPENING.values(), []), *sum(WARMTH, []), *REACT["pressure"].values(), *REACT["emotion_cold"].values(), REACT["long"]]


_LEAK = re.compile(r"\b(persona|philanthropic|unfriendly|skeptic\w*|willingness|donor profile|hidden)\b", re.I)
_CHILDREN = re.compile(r"\byour (own )?(kids|children|son|daughter)\b", re.I)


def leak(message: str, replies: str) -> str | None:
    """Why `message` uses what only the donor's profile tells, or None: a persona label, or the
    donor's children before the donor mentioned any."""
    if m := _LEAK.search(message):
        return f"names the donor's hidden profile ({m.group(0)!r})"
    if _CHILDREN.search(message) and not re.search(r"\b(kids|children|son|daughter)\b", replies, re.I):
        return "speaks of the donor's children, which the donor never mentioned"
    return None


def _replies(pairs: Sequence[tuple[str | None, str]]) -> str:
    return " ".join(obs for _, obs in pairs)


# ---- the LLM donor ----

_DONOR = re.compile(r"REASON:\s*(.*?)\s*RESPONSE:\s*(.*?)\s*DECISION:\s*(.*)", re.S | re.I)
_DECIDE = re.compile(r"^\s*(none|no donation|donate\s+\$?(\d+(?:\.\d+)?))\s*\.?\s*$", re.I)


def parse_donor(text: str) -> DonorReply:
    """REASON / RESPONSE / DECISION, the decision one of "none" (the talk goes on), "donate $X"
    with X in (0, 2], or "no donation"."""
    no_echo(text)
    m = _DONOR.search(text)
    if m is None:
        raise ValueError("expected REASON:, RESPONSE: and DECISION:")
    words = " ".join(m.group(2).split())
    if not words:
        raise ValueError("empty RESPONSE")
    if len(words) > MAX_REPLY_CHARS:
        raise ValueError(f"RESPONSE of {len(words)} characters, over {MAX_REPLY_CHARS}")
    if read_decision_line(words) is not None or "Decision:" in words:
        raise ValueError("the RESPONSE holds a decision line")  # the log would read it as the decision
    first = next((line for line in m.group(3).splitlines() if line.strip()), "")
    d = _DECIDE.match(first)
    if d is None:
        raise ValueError(f"DECISION is not 'none', 'donate $X' or 'no donation': {first.strip()[:60]!r}")
    if d.group(1).lower() == "none":
        donation = None
    elif d.group(1).lower() == "no donation":
        donation = 0.0
    else:
        donation = float(d.group(2))
        if not 0 < donation <= 2:
            raise ValueError(f"a donation of {money(donation)} is outside ($0, $2]")
    return DonorReply(words, donation, " ".join(m.group(1).split()))


# ---- summarizer ----

def summary_request(donor: Donor, max_turns: int, turns) -> Request[str]:
    pairs = history(turns)
    last = read_observation(turns[-1]["observation"]).donation if turns else None
    outcome = "unfinished: no decision" if last is None else (f"donated {money(last)}" if last > 0 else "donated nothing")
    prompt = chat("summary.j2", donor=donor, persona=PERSONA_TEXT[donor.persona], concern=CONCERN_TEXT.get(donor.concern or ""),
                  dialogue=dialogue(pairs), outcome=outcome, max_turns=max_turns)
    return Request(prompt, parse_summary)


# ---- hindsight proposer (HOPE's pi_H) ----

def _proposals(text: str, n: int, replies: str) -> list[Counterfactual]:
    no_echo(text)
    out = []
    for i, (_, fields) in enumerate(proposal_items(text, n, ("teacher_reason", "message", "persuader_reason"))):
        for key in ("message", "persuader_reason"):
            if why := leak(fields[key], replies):
                raise ValueError(f"proposal {i}: the {key} {why}")
        out.append(Counterfactual(render_action(fields["persuader_reason"], fields["message"]), fields["message"], fields["persuader_reason"], fields["teacher_reason"]))
    return out


def proposer_request(donor: Donor, max_turns: int, prefix, n: int, summary: str) -> Request[list[Counterfactual]]:
    pairs = history(prefix)
    prompt = chat("proposer.j2", n=n, summary=summary, dialogue=dialogue(pairs), turn=len(pairs), max_turns=max_turns)
    return Request(prompt, lambda text: _proposals(text, n, _replies(pairs)))


def proposal_reply(proposals: Sequence[Counterfactual]) -> str:
    if not proposals:
        raise ValueError("no proposals to write a reply of")
    items = [{"teacher_reason": p.rationale, "message": p.action, "persuader_reason": p.reason} for p in proposals]
    return "```json\n" + json.dumps(items, ensure_ascii=False) + "\n```"


# ---- hindsight controller (HR App. B.1) ----

_PLACE = re.compile(r'^\s*\d+\.\s*"(?P<said>[^"]+)"\s*;(?P<critique>[^;]*);\s*"(?P<instead>[^"]+)"\s*/?\s*$')


def _norm(text: str) -> str:
    text = re.sub(r"^\s*(AI|Al|A)\s*:\s*", "", text)  # HR's quotes keep the speaker tag (and OCR'd it as "Al:")
    return " ".join(re.sub(r"[^\w$%.']+", " ", text.lower()).split()).rstrip(".")


def controller_request(donor: Donor, turns, top: int) -> Request[list[tuple[int, Counterfactual]]]:
    pairs = history(turns)
    last = read_observation(turns[-1]["observation"]).donation if turns else None
    prompt = chat("controller.j2", dialogue=dialogue(pairs), top=top, persona=PERSONA_TEXT[donor.persona],
                  outcome="no decision" if last is None else (f"the donor gave {money(last)}" if last > 0 else "the donor gave nothing"))

    def parse(text: str) -> list[tuple[int, Counterfactual]]:
        """HR's `1. "said";critique;"instead"/` lines; a quote must be one of the persuader's
        messages (speaker tag, case and punctuation aside), the replacement a message it could say."""
        no_echo(text)
        said = [_norm(m) if m is not None else None for m, _ in pairs]
        out, seen = [], set()
        for line in (line for line in text.strip().splitlines() if line.strip()):
            m = _PLACE.match(line)
            if not m:
                raise ValueError(f"not a place line: {line.strip()[:60]!r}")
            turn = next((i for i, s in enumerate(said) if s == _norm(m["said"])), None)
            if turn is None:
                raise ValueError(f"quotes {m['said'][:60]!r}, which the persuader never said")
            instead = " ".join(re.sub(r"^\s*(AI|Al|A)\s*:\s*", "", m["instead"]).split())
            if why := leak(instead, _replies(pairs[:turn])):
                raise ValueError(f"the replacement at {m['said'][:30]!r} {why}")
            if turn in seen or _norm(instead) == said[turn]:
                continue
            seen.add(turn)
            out.append((turn, Counterfactual(render_action("", instead), instead, "", " ".join(m["critique"].split()))))
        if not out:
            raise ValueError("no place to improve")
        return out[:top]

    return Request(prompt, parse)


# ---- forward model (HR App. B.2): the rest of the conversation, both sides ----

_LINE = re.compile(r"^\s*(AI|H)\s*:\s*(.*?)\s*$")


def parse_continuation(text: str, start: Conversation) -> list[tuple[str, DonorReply]]:
    """Alternating "AI:" / "H:" lines, a "Decision: ..." line after the donor's line where it
    decides; replayed on a copy of `start`, the conversation must end exactly at the last line."""
    no_echo(text)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if not lines:
        raise ValueError("empty continuation")
    game, out, i = copy.deepcopy(start), [], 0
    while i < len(lines):
        if game.done:
            raise ValueError(f"line {i + 1} comes after the donor decided")
        a = _LINE.match(lines[i])
        if not a or a.group(1) != "AI" or not a.group(2):
            raise ValueError(f"line {i + 1}: expected 'AI: <message>', got {lines[i].strip()[:50]!r}")
        if why := leak(a.group(2), _replies(game.history)):
            raise ValueError(f"line {i + 1}: the message {why}")
        h = _LINE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if not h or h.group(1) != "H" or not h.group(2):
            raise ValueError(f"line {i + 2}: expected 'H: <reply>' after the persuader's message")
        i += 2
        donation = read_decision_line(lines[i]) if i < len(lines) else None
        if donation is not None:
            if donation > 2:
                raise ValueError(f"line {i + 1}: a donation of {money(donation)} is over $2")
            i += 1
        reply = DonorReply(h.group(2), donation)
        game.step(a.group(2), reply)
        out.append((render_action("", a.group(2)), reply))
    if not game.done:
        raise Unfinished(f"the continuation stops at turn {game.turn} before the donor decides")
    if game.ended_by_donor is False and read_decision_line(lines[-1]) is None:
        raise Unfinished("the last turn ends without the donor's decision")
    return out


def continuation_reply(turns) -> str:
    """The logged turns after a prefix in the forward model's format (what parse_continuation
    reads): "AI:" / "H:" lines, a "Decision:" line where the donor decides. A turn whose action
    did not follow the format has no message to write: ValueError."""
    pairs = history(turns)
    if any(m is None for m, _ in pairs):
        raise ValueError("a turn of the continuation did not follow the action format (the donor heard nothing)")
    return dialogue(pairs)


def forward_request(state: Conversation) -> Request[list[tuple[str, DonorReply]]]:
    start = copy.deepcopy(state)  # each parse (a retry too) replays from the game as it is now
    d = start.donor
    prompt = chat("forward.j2", donor=d, persona=PERSONA_TEXT[d.persona], concern=CONCERN_TEXT.get(d.concern or ""),
                  dialogue=dialogue(start.history), next=start.turn + 1, max_turns=start.max_turns)
    return Request(prompt, lambda text: parse_continuation(text, start))


# ---- the donation labeler (HR App. B.3: finished or not, then the amount) ----

_UNFINISHED = re.compile(r"^\s*(?:Unfinished\s*:\s*)?(yes|no)\b\.?\s*$", re.I)
_AMOUNT = re.compile(r"^\s*Final Donation Amount\s*:\s*\$?\s*(-?\d+(?:\.\d+)?)\s*$", re.I)


class Unfinished(Unfinished_):
    """The labeler judged the dialogue unfinished, or a forward model's continuation stops before
    the donor decides: HR discards it, so it gets no reward (status "unfinished", not retried)."""


def parse_finished(text: str) -> bool:
    """Step 1: one "Unfinished: yes|no" (or bare yes/no) line; True when the dialogue is finished."""
    no_echo(text)
    found = [m.group(1).lower() for m in (_UNFINISHED.match(line) for line in text.splitlines()) if m]
    if len(found) != 1:
        raise ValueError("no line 'Unfinished: yes|no'" if not found else f"{len(found)} 'Unfinished:' lines; expected one")
    return found[0] == "no"


def parse_amount(text: str) -> float:
    """Step 2: the one "Final Donation Amount: <number>" line, in [0, 2]. Amounts elsewhere in the
    output (a quoted ask, a refused sum) are not read."""
    no_echo(text)
    found = [float(m.group(1)) for m in (_AMOUNT.match(line) for line in text.splitlines()) if m]
    if len(found) != 1:
        raise ValueError("no line 'Final Donation Amount: <number>'" if not found else f"{len(found)} 'Final Donation Amount:' lines; expected one")
    if not 0 <= found[0] <= 2:
        raise ValueError(f"donation {found[0]:g} outside [0, 2]")
    return found[0]


def parse_label(text: str) -> float:
    """Both steps in one reply: Unfinished: no, then the amount; Unfinished: yes raises Unfinished."""
    lines = text.strip().splitlines()
    step1 = [line for line in lines if _UNFINISHED.match(line)]
    if not parse_finished("\n".join(step1) if step1 else text):
        raise Unfinished("the labeler judged the dialogue unfinished (no donation decision)")
    return parse_amount("\n".join(line for line in lines if not _UNFINISHED.match(line)))


def _unfinished_cut(turns: Sequence[Mapping]) -> list[Mapping]:
    """An example made unfinished: the dialogue before the donor's decision."""
    return list(turns[:-1])


def _shots(examples, both: bool) -> list[dict]:
    """Examples for the prompt: every other one cut before its decision (unfinished) when the
    prompt asks step 1, as HR's step-1 shots mix unfinished and finished dialogues."""
    out = []
    for i, (turns, reward) in enumerate(examples):
        cut = both and i % 2 == 0 and len(turns) > 1
        shown = _unfinished_cut(turns) if cut else turns
        out.append({"dialogue": dialogue(history(shown), decisions=False), "unfinished": cut, "amount": None if cut else float(reward)})
    return out


def _label_prompt(turns, examples, step: str) -> list[dict]:
    return chat("labeler.j2", step=step, examples=_shots(examples, step != "amount"), dialogue=dialogue(history(turns), decisions=False))


def labeler_request(turns, examples) -> Request[float]:
    return Request(_label_prompt(turns, examples, "both"), parse_label)


def finished_request(turns, examples) -> Request[bool]:
    return Request(_label_prompt(turns, examples, "finished"), parse_finished)


def amount_request(turns, examples) -> Request[float]:
    return Request(_label_prompt(turns, examples, "amount"), parse_amount)


# ---- rubric judge (Refit) ----

def judge_request(donor: Donor, turns) -> Request[dict[str, float]]:
    def parse(text: str) -> dict[str, float]:
        no_echo(text)
        return RUBRIC.parse(text)

    return Request(chat("judge.j2", persona=PERSONA_TEXT[donor.persona], dialogue=dialogue(history(turns))), parse)
