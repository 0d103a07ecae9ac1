"""The oracle hindsight roles: HOPE's counterfactual proposer and HR's hindsight controller.

Both see the secret city. Their *rationale* may use it ("the secret is Busan, ..."), and
hindsight chooses *which* question to ask, but the action itself is one the player could justify
from what it saw: a question of the most general level that still splits the consistent cities
(policies.best_questions, the expert's candidates), or a guess. Among those questions hindsight
puts first the one whose answer for the actual city leaves the fewest cities (then the most
informative, then QUESTIONS' order): the question that, this time, would have narrowed most.

A guess never reads the secret. It is `justified_guess`: the only city the answers leave, or,
when several are left and the player must guess anyway (the forced last turn, or no unasked
question splits them), the first of them in the candidate list's order. So on the last turn
with several cities left the proposed guess may be wrong; the rationale says so. The same rule
vets an LLM proposer's, controller's or forward model's guesses (`unjustified_guess`).
"""
from __future__ import annotations

from dataclasses import dataclass

from envs.reason_question import Action

from .cities import City, normalize
from .game import guessed_city
from .oracle import QUESTIONS, Oracle, topic
from .policies import PlayerView, ask, asked, best_questions, consistent, gain, guess, only_fits

VERSION = "guess-my-city-oracle-proposer-v1"  # bump when proposals or wording change: relabels are keyed by it


@dataclass(frozen=True)
class Proposal:
    action: Action  # reason + question, in the policy's own format
    rationale: str  # hindsight reasoning; may name the secret, never enters the action


def same_action(oracle: Oracle, a: str, b: str) -> bool:
    """The same move: the same text, guesses of the same city, or questions on the same topic
    (the oracle answers them alike)."""
    if normalize(a) == normalize(b):
        return True
    ga, gb = guessed_city(oracle.cities, a), guessed_city(oracle.cities, b)
    if ga is not None or gb is not None:
        return ga == gb
    ta = topic(a)
    return ta is not None and ta == topic(b)


def justified_guess(oracle: Oracle, view: PlayerView) -> City | None:
    """The guess the player could justify from the answers alone, or None when it should still ask.

    One city left: that city. Several left on the forced last turn, or when no unasked question
    splits them: the first of them in the candidate list's order. The rule reads neither the
    secret nor an rng, so two games with the same dialogue get the same guess whatever their
    secrets."""
    left = consistent(oracle, view)
    if len(left) == 1 or view.is_final_turn or not best_questions(oracle, left, view.history):
        return left[0]
    return None


def unjustified_guess(oracle: Oracle, secret: City, view: PlayerView, question: str) -> str | None:
    """Why `question` guesses the secret with hindsight (the answers do not single it out and it
    is not `justified_guess`'s pick), or None. Guesses of other cities, and questions, pass: they
    do not use the secret. Answers that no city agrees with (a model's answer against the
    knowledge base) justify nothing and are not judged."""
    if guessed_city(oracle.cities, question) != secret:
        return None
    try:
        left = consistent(oracle, view)
        pick = justified_guess(oracle, view)
    except ValueError:
        return None
    if pick == secret:
        return None
    if pick is None:
        return f"guesses the secret while {len(left)} cities still fit the answers"
    return f"guesses the secret, not the player's pick among the {len(left)} cities that fit the answers ({pick.name})"


class OracleProposer:
    def __init__(self, oracle: Oracle):
        self.oracle = oracle

    def remaining(self, secret: City, view: PlayerView, question: str) -> int:
        """How many cities would still fit after asking `question` of this secret (hindsight); a
        guess leaves none when right and ends the game when wrong, so it leaves all it did not test."""
        left = consistent(self.oracle, view)
        g = guessed_city(self.oracle.cities, question)
        if g is not None:
            return 0 if g == secret else len([c for c in left if c != g])
        t = topic(question)
        if t is None or t == "name" or t in asked(view.history):
            return len(left)  # unanswerable, refused or repeated: nothing learned
        return sum(1 for c in left if self.oracle.says(c, t) == self.oracle.says(secret, t))

    def propose(self, secret: City, view: PlayerView, n: int) -> list[Proposal]:
        """HOPE's pi_H(a | s_t, summary): up to n distinct better actions at this state."""
        left = consistent(self.oracle, view)
        pick = justified_guess(self.oracle, view)
        if pick is not None:
            # The guess is the rule's pick, never read from the secret; hindsight only comments.
            if len(left) == 1:
                why, situation = only_fits(self.oracle, view.history, pick.name), f"only {pick.name} fits the answers"
            else:
                why = f"Last turn, guess {pick.name}." if view.is_final_turn else f"Guess {pick.name}."
                situation = f"{len(left)} cities fit the answers and the player guesses the first of them in the candidate list, {pick.name}"
            verdict = "right" if pick == secret else "wrong"
            return [Proposal(guess(pick.name, why), f"The secret is {secret.name}; {situation}, which hindsight shows is {verdict}.")]
        order = {q.topic: i for i, q in enumerate(QUESTIONS)}
        scored = []
        for q in best_questions(self.oracle, left, view.history):
            said = self.oracle.says(secret, q.topic)
            after = sum(1 for c in left if self.oracle.says(c, q.topic) == said)
            scored.append((after, -gain(self.oracle, left, q), order[q.topic], q, said))
        scored.sort(key=lambda s: s[:3])
        out = []
        for after, _, _, q, said in scored[:n]:
            rationale = (
                f"The secret is {secret.name} ({self.oracle.labels[(q.topic, said)]}). {len(left)} cities fit the answers so far; "
                f"'{q.text}' tells them apart and, for {secret.name}, leaves {after}."
            )
            out.append(Proposal(ask(q), rationale))
        return out

    def critique(self, secret: City, candidates: list[City], history: list[tuple[str, str]], max_turns: int, top: int) -> list[tuple[int, Proposal, int]]:
        """HR's hindsight controller: the `top` turns where the player lost most against the best
        proposal, as (turn, replacement, cities the original left minus those the replacement
        would leave). Turns where the original was as good are not named."""
        places = []
        for turn, (question, _) in enumerate(history):
            view = PlayerView(candidates, history[:turn], turn, max_turns)
            best = self.propose(secret, view, 1)
            if not best:
                continue
            loss = self.remaining(secret, view, question) - self.remaining(secret, view, best[0].action.question)
            if loss > 0 and not same_action(self.oracle, question, best[0].action.question):
                places.append((loss, turn, best[0]))
        places.sort(key=lambda p: (-p[0], p[1]))
        return [(turn, proposal, loss) for loss, turn, proposal in places[:top]]
