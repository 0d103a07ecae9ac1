"""NLAC's oracle critic and backup for TwentyQuestions: a language critique written from the
knowledge base and the secret, the ground truth a trained critic is measured against.

A tiny model trained from scratch cannot predict a game's future or judge a question zero-shot,
so on the CPU default these oracles play the critic (`roles.language_critic: {backend: oracle}`)
and the backup (`roles.backup: {backend: oracle}`); the policy learns to critique from their texts
all the same (L1).

Future: the answer the question gets (the oracle's, or at a logged transition the one it got),
how many of the objects that fit the answers are left, then how the game ends if the expert
(the information-gain policy, policies.ExpertPolicy) plays on from there. The oracle cannot know
the trained policy's own continuation, which the paper's successor model predicts: it describes
the continuation of good play, the same for every policy.
Optimality: Yes when no action is worth more to the player by the answers alone (the hindsight
proposer's measure, proposer.worth: nothing better to propose); else No, why, and the proposer's
better move. A terminal transition's future is its outcome and final reward.
"""
from __future__ import annotations

import random
from envs.nlac import Critique

from .format import ActionParseError, parse_action
from .game import Answer, Game, Oracle
from .kb import Entity, KnowledgeBase
from .policies import ExpertPolicy, PlayerView, _asked, consistent
from .proposer import OracleProposer, worth

VERSION = "oracle-critic-v1"  # bump when the texts change


def question_of(text: str) -> str:
    """The move a turn plays: its question, or the raw text when it does not parse (the game asks it as it is)."""
    try:
        return parse_action(text).question
    except ActionParseError:
        return text.strip()


def _left(kb: KnowledgeBase, view: PlayerView) -> list[Entity]:
    try:
        return consistent(kb, view)
    except ValueError:  # an LLM simulator's answers that no object agrees with: nothing is narrowed
        return list(view.candidates)


def expert_ending(kb: KnowledgeBase, secret: Entity, view: PlayerView, listed: bool) -> str:
    """How the game ends if the expert plays on from this state (a fixed rng: one text per state)."""
    game = Game(kb, secret, max_turns=view.max_turns)
    game.restore(view.history)
    expert, rng = ExpertPolicy(kb, listed=listed), random.Random(0)
    while not game.done:
        game.step(expert.act(PlayerView(view.candidates, list(game.history), game.turn, view.max_turns), rng).question)
    if game.success:
        return f"Playing on with the best questions, the object is found at turn {game.turn} of {view.max_turns}."
    return f"Even playing on with the best questions, the object is not found within the {view.max_turns} turns."


def _outcome(kb: KnowledgeBase, view: PlayerView, question: str, answer: str, left: list[Entity]) -> str:
    """What the answer to the question establishes."""
    guess = kb.resolve_guess(question)
    if guess is not None:
        return f"The answer will be {answer}: {'it is' if answer == 'yes' else 'it is not'} {guess.name}."
    q = kb.match_question(question)
    if answer not in ("yes", "no") or q is None or q in _asked(kb, view.history):
        after = len(left)  # nothing learned
    else:
        after = sum(1 for e in left if kb.truth(e, q) == (answer == "yes"))
    return f"The answer will be {answer}, leaving {after} of the {len(left)} objects that fit the answers so far."


def _verdict(kb: KnowledgeBase, proposer: OracleProposer, secret: Entity, view: PlayerView, question: str, left: list[Entity]) -> tuple[bool, str]:
    """(optimal, why not and what instead): optimal when the proposer has nothing worth more."""
    better = proposer.propose(secret, view, 1, question)
    if not better:
        return True, ""
    guess, q = kb.resolve_guess(question), kb.match_question(question)
    if guess is not None:
        why = f"{guess.name} is already ruled out by the answers" if guess not in left else f"guessing {guess.name} now is early: {len(left)} objects still fit"
    elif view.is_final_turn:
        why = "the last turn must be a guess"
    elif q is None:
        why = "the question cannot be answered yes or no for these objects"
    elif q in _asked(kb, view.history):
        why = "it repeats an earlier question, which tells nothing new"
    else:
        why = f"it rules out at most {worth(kb, view, question)} of the {len(left)} objects that fit"
    move = better[0].action.question
    instead = f"guess '{move}' instead" if kb.resolve_guess(move) is not None else f"ask '{move}' instead, which splits them more evenly"
    return False, f"Not the best move: {why}; {instead}."


def critique(kb: KnowledgeBase, proposer: OracleProposer, secret: Entity, view: PlayerView, text: str, listed: bool, answer: str | None = None,
             reward: float | None = None) -> Critique:
    """The critique of the turn `text` at the state `view`. `answer`: the answer it got (a logged
    transition; default the oracle's); `reward`: its final reward when the transition ended the
    game (the future is then the outcome)."""
    question = question_of(text)
    left = _left(kb, view)
    got: Answer | None = None
    if answer is None:
        got = Oracle(kb).answer(secret, question)
        answer = got.text
    won = got.correct if got is not None else answer == "yes" and kb.resolve_guess(question) == secret
    future = _outcome(kb, view, question, answer, left)
    after = PlayerView(view.candidates, [*view.history, (question, answer)], view.turn + 1, view.max_turns)
    if won:
        future += f" The game is won at turn {after.turn} of {view.max_turns}."
    elif after.turn >= view.max_turns:
        future += " That was the last turn: the game is lost."
    else:
        future += " " + expert_ending(kb, secret, after, listed)
    if reward is not None:
        future += f" Final reward (the return of the whole game): {reward:g}."
    optimal, reason = _verdict(kb, proposer, secret, view, question, left)
    return Critique(future, optimal, reason)
