"""The oracle hindsight roles: HOPE's counterfactual proposer and HR's hindsight controller.

Both see the secret. Their *rationale* may use it ("the secret is an apple, ..."), but the action
they propose is one the player could justify from what it saw: the unasked question that splits
the still-consistent objects most evenly (HOPE's "better question"), or a guess when only one
object is left. Among equally informative questions, hindsight breaks the tie: the one whose
answer for the actual secret leaves the fewest objects comes first.
"""
from __future__ import annotations

from dataclasses import dataclass

from .format import Action
from .kb import Entity, KnowledgeBase, normalize
from .policies import PlayerView, _asked, consistent

VERSION = "oracle-proposer-v1"  # bump when proposals or wording change: relabels are keyed by it


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


class OracleProposer:
    def __init__(self, kb: KnowledgeBase):
        self.kb = kb

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

    def propose(self, secret: Entity, view: PlayerView, n: int) -> list[Proposal]:
        """HOPE's pi_H(a | s_t, summary): up to n distinct better actions at this state."""
        left = consistent(self.kb, view)
        if len(left) == 1 or view.is_final_turn:
            why = "Only {0} fits." if len(left) == 1 else "Last turn, guess {0}."
            action = Action(why.format(secret.name), f"Is it {secret.name}?")
            rationale = f"The secret is {secret.name}; {len(left)} object(s) fit the answers, so guessing it ends the game."
            return [Proposal(action, rationale)]
        asked = {q.key for q in _asked(self.kb, view.history)}
        scored = []
        for order, q in enumerate(self.kb.questions):
            if q.key in asked:
                continue
            yes = sum(self.kb.truth(e, q) for e in left)
            split = min(yes, len(left) - yes)
            if split > 0:
                truth = self.kb.truth(secret, q)
                after = yes if truth else len(left) - yes
                scored.append((-split, after, order, q, truth, yes))
        scored.sort(key=lambda s: s[:3])
        out = []
        for _, after, _, q, truth, yes in scored[:n]:
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
            best = self.propose(secret, view, 1)
            if not best:
                continue
            loss = self.remaining(secret, view, question) - self.remaining(secret, view, best[0].action.question)
            if loss > 0 and not same_action(self.kb, question, best[0].action.question):
                places.append((loss, turn, best[0]))
        places.sort(key=lambda p: (-p[0], p[1]))
        return [(turn, proposal, loss) for loss, turn, proposal in places[:top]]
