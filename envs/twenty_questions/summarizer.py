"""The oracle summarizer: HOPE's trajectory summary, written from the environment's hidden state.

It sees the secret, so it can say what the questions established about it, what the player
missed, and how the game ended, in 2-4 sentences as HOPE's summary prompt asks (the secret word
and its general category are always named).
"""
from __future__ import annotations

from .kb import Entity, KnowledgeBase

VERSION = "oracle-summary-v1"  # bump when the wording changes: summaries are cached by it


def summarize_game(kb: KnowledgeBase, secret: Entity, history: list[tuple[str, str]], success: bool) -> str:
    """history: (question, answer) per turn, as the oracle answered them."""
    category = next(q for q in kb.questions if q.kind == "category" and q.key == secret.category)
    established: list[str] = []
    asked: set[str] = set()
    repeats = unanswerable = 0
    wrong_guesses: list[str] = []
    for question, answer in history:
        guess = kb.resolve_guess(question)
        if guess is not None:
            if guess != secret:
                wrong_guesses.append(guess.name)
            continue
        q = kb.match_question(question)
        if q is None:
            unanswerable += 1
            continue
        if q.key in asked:
            repeats += 1
            continue
        asked.add(q.key)
        established.append(q.label if answer == "yes" else q.no_label)

    sentences = [f"The secret was {secret.name}, in the category {category.label}."]
    if established:
        sentences.append(f"The questions established: {', '.join(established)}.")
    missed = []
    if category.key not in asked and not success:
        missed.append(f"never asked about its category ({category.label})")
    if repeats:
        missed.append(f"repeated {repeats} question{'s' * (repeats > 1)}")
    if unanswerable:
        missed.append(f"asked {unanswerable} question{'s' * (unanswerable > 1)} the oracle could not answer")
    if wrong_guesses:
        missed.append(f"guessed wrong ({', '.join(wrong_guesses[:3])}{', ...' if len(wrong_guesses) > 3 else ''})")
    if missed:
        sentences.append("The player " + "; ".join(missed) + ".")
    turns = len(history)
    sentences.append(f"It found the answer in {turns} turns." if success else f"It failed to find it in {turns} turns.")
    return " ".join(sentences)
