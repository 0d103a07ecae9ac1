"""The oracle hindsight roles: HOPE's counterfactual proposer and HR's hindsight controller.

Both see the secret. Their *rationale* may use it ("the secret is an apple, ..."), and hindsight
may choose *which* of several justified actions comes first, but the action itself is one the
player could justify from what it saw: the unasked question that splits the still-consistent
objects most evenly (HOPE's "better question"), or a guess. Equally informative questions come in
the question set's order, the expert's: a tie broken by which side the secret is on would teach
the player to choose by what it cannot know, and a model that learnt the expert's tree loses its
way off it (measured in the README's first look: the hindsight tie-break's regenerations won 0.30
where their parents won 0.90).

Given the action the player took there (relabeling), the proposer only proposes actions better
than it by the player's own measure (`worth`); where the player's action was already as good as
any, hindsight has nothing to add and the site gets no counterfactual.

A guess never reads the secret. It is `justified_guess`: the only object the answers leave, or,
when several are left and the player must guess anyway (the forced last turn, or no unasked
question splits them), the first of them in the candidate list's order. So on the last turn
with several objects left the proposed guess may be wrong; the rationale says so. The same rule
vets an LLM proposer's, controller's or forward model's guesses (`unjustified_guess`).
"""
from __future__ import annotations

from dataclasses import dataclass

from .format import Action
from .kb import Entity, KnowledgeBase, normalize
from .policies import PlayerView, _asked, consistent, only_fits

VERSION = "oracle-proposer-v3"  # bump when proposals or wording change: relabels are keyed by it


@dataclass(frozen=True)
class Proposal:
    action: Action  # reason + question, in the policy's own format
    rationale: str  # hindsight reasoning; may name the secret, never enters the action


def same_action(kb: KnowledgeBase, a: str, b: str) -> bool:
    """Equal after normalisation: the same text, the same question, or a guess of the same object."""
    if normalize(a) == normalize(b):
        return True
    ga, gb = kb.resolve_guess(a), kb.resolve_guess(b)
    if ga is not None or gb is not None:
        return ga == gb
    qa, qb = kb.match_question(a), kb.match_question(b)
    return qa is not None and qa == qb


def justified_guess(kb: KnowledgeBase, view: PlayerView) -> Entity | None:
    """The guess the player could justify from the answers alone, or None when it should still ask.

    One object left: that object. Several left on the forced last turn, or when no unasked
    question splits them: the first of them in the candidate list's order (`consistent` keeps
    that order). The rule reads neither the secret nor an rng, so two games with the same
    dialogue get the same guess whatever their secrets."""
    left = consistent(kb, view)
    if len(left) == 1 or view.is_final_turn or not _splitting(kb, left, view.history):
        return left[0]
    return None


def unjustified_guess(kb: KnowledgeBase, secret: Entity, view: PlayerView, question: str) -> str | None:
    """Why `question` guesses the secret with hindsight (the answers do not single it out and it
    is not `justified_guess`'s pick), or None. Guesses of other objects, and questions, pass: they
    do not use the secret. Answers that no candidate agrees with (a model's answer against the
    knowledge base) justify nothing and are not judged."""
    if kb.resolve_guess(question) != secret:
        return None
    try:
        left = consistent(kb, view)
        pick = justified_guess(kb, view)
    except ValueError:
        return None
    if pick == secret:
        return None
    if pick is None:
        return f"guesses the secret while {len(left)} objects still fit the answers"
    return f"guesses the secret, not the player's pick among the {len(left)} objects that fit the answers ({pick.name})"


def _splitting(kb: KnowledgeBase, left: list[Entity], history: list[tuple[str, str]]) -> bool:
    asked = {q.key for q in _asked(kb, history)}
    return any(0 < sum(kb.truth(e, q) for e in left) < len(left) for q in kb.questions if q.key not in asked)


def worth(kb: KnowledgeBase, view: PlayerView, action: str) -> int:
    """What `action` is worth to the player from the answers alone: for a question, how many of the
    still-consistent objects it rules out at worst (its smaller side), nothing on the last turn
    (which must guess); for a guess of one of them, one; for a repeat, an unanswerable question or
    a guess the answers exclude, nothing."""
    left = consistent(kb, view)
    guess = kb.resolve_guess(action)
    if guess is not None:
        return int(guess in left)
    q = kb.match_question(action)
    if q is None or view.is_final_turn or q in _asked(kb, view.history):
        return 0
    yes = sum(kb.truth(e, q) for e in left)
    return min(yes, len(left) - yes)


class OracleProposer:
    def __init__(self, kb: KnowledgeBase, listed: bool = True):
        self.kb, self.listed = kb, listed  # listed: a guess's reason lists the answers (policies.only_fits)

    def remaining(self, secret: Entity, view: PlayerView, question: str) -> int:
        """How many objects would still fit after asking `question` of this secret (hindsight)."""
        left = consistent(self.kb, view)
        guess = self.kb.resolve_guess(question)
        if guess is not None:
            return 0 if guess == secret else len([e for e in left if e != guess])
        q = self.kb.match_question(question)
        if q is None or q in _asked(self.kb, view.history):
            return len(left)  # unanswerable or repeated: nothing learned
        truth = self.kb.truth(secret, q)
        return sum(1 for e in left if self.kb.truth(e, q) == truth)

    def propose(self, secret: Entity, view: PlayerView, n: int, original: str | None = None) -> list[Proposal]:
        """HOPE's pi_H(a | s_t, summary): up to n distinct better actions at this state; given the
        action the player took (`original`), only those worth more to the player than it."""
        left = consistent(self.kb, view)
        pick = justified_guess(self.kb, view)
        floor = -1 if original is None else worth(self.kb, view, original)
        if pick is not None:
            if floor >= 1:  # the player guessed one that fits: as good as the pick
                return []
            # The guess is the rule's pick, never read from the secret; hindsight only comments.
            if len(left) == 1:
                why, situation = only_fits(self.kb, view.history, pick.name, self.listed), f"only {pick.name} fits the answers"
            else:
                why = f"Last turn, guess {pick.name}." if view.is_final_turn else f"Guess {pick.name}."
                situation = f"{len(left)} objects fit the answers and the player guesses the first of them in the candidate list, {pick.name}"
            verdict = "right" if pick == secret else "wrong"
            rationale = f"The secret is {secret.name}; {situation}, which hindsight shows is {verdict}."
            return [Proposal(Action(why, f"Is it {pick.name}?"), rationale)]
        asked = {q.key for q in _asked(self.kb, view.history)}
        scored = []
        for order, q in enumerate(self.kb.questions):
            if q.key in asked:
                continue
            yes = sum(self.kb.truth(e, q) for e in left)
            split = min(yes, len(left) - yes)
            if split > max(floor, 0):
                truth = self.kb.truth(secret, q)
                after = yes if truth else len(left) - yes
                scored.append((-split, order, after, q, truth, yes))
        scored.sort(key=lambda s: s[:2])
        out = []
        for _, _, after, q, truth, yes in scored[:n]:
            rationale = (
                f"The secret is {secret.name} ({q.label if truth else q.no_label}). {len(left)} objects fit the answers "
                f"so far; '{q.text}' splits them {yes}/{len(left) - yes} and, for {secret.name}, leaves {after}."
            )
            out.append(Proposal(Action(f"Ask about {q.label}.", q.text), rationale))
        return out

    def critique(self, secret: Entity, candidates: list[Entity], history: list[tuple[str, str]], max_turns: int, top: int) -> list[tuple[int, Proposal, int]]:
        """HR's hindsight controller: the `top` turns where the player lost most against the best
        proposal, as (turn, replacement, objects the original left minus those the replacement
        would leave). Turns where the original was as good are not named."""
        places = []
        for turn, (question, _) in enumerate(history):
            view = PlayerView(candidates, history[:turn], turn, max_turns)
            best = self.propose(secret, view, 1, question)
            if not best:
                continue
            loss = self.remaining(secret, view, question) - self.remaining(secret, view, best[0].action.question)
            if loss > 0 and not same_action(self.kb, question, best[0].action.question):
                places.append((loss, turn, best[0]))
        places.sort(key=lambda p: (-p[0], p[1]))
        return [(turn, proposal, loss) for loss, turn, proposal in places[:top]]
