"""StepAgent-Implicit (StepAgent Eq. 6): step-level DPO of the expert's action over the policy's own.

    loss = - log sigmoid( beta * [ (log pi(a_e|s) - log ref(a_e|s)) - (log pi(a|s) - log ref(a|s)) ] )

s is a prefix of an expert trajectory (Eq. 4), a_e the expert's action there (chosen) and a an
action the policy practised at s (Eq. 5, rejected): the practice stage's pairs, one per sample.

- The denominators are pi_ref, the policy as it stood when it practised, frozen for the iteration
  (ETO's reference is the current model each iteration). The printed Eq. 6 divides by pi_e, the
  expert's likelihood, which no one can query; its text defines pi_ref "initialized with the agent
  policy" and its Section 5 writes the implicit reward as beta * log pi / pi_ref.
- log pi(a|s) sums the action's tokens only (online_dpo.encode's mask): the state, the expert's
  earlier actions included, carries no loss.
- A pair whose agent action matches the expert's (practice's `equal`) is left out, and counted:
  identical texts give exactly zero gradient, and two texts the environment reads as the same
  move differ in their wording alone, which is not the step's lesson (`practice.equal: text`
  keeps them). A sample the backend gave up on is left out too.
- beta: StepAgent gives none; ETO, whose setup it follows, uses 0.1 in iteration 1 and 0.5 after.

The loss, its masks, the pair collator and the trainer are HOPE's actor's (online_dpo.py): one
DPO for both papers, checked against TRL's DPOTrainer in tests/test_actor.py.
"""
from __future__ import annotations

from tasks.train import online_dpo
from tasks.train.sft import MaskError


def teaching(rows: list[dict]) -> tuple[list[dict], dict[str, int]]:
    """The practice rows the loss learns from (practised, and not matching the expert) and how
    many of the rest were left out, by why."""
    failed = [r for r in rows if r["status"] != "ok"]
    equal = [r for r in rows if r["status"] == "ok" and r["equal"]]
    kept = [r for r in rows if r["status"] == "ok" and not r["equal"]]
    return kept, {"rows": len(rows), "equal_dropped": len(equal), "failed_dropped": len(failed), "kept": len(kept)}


def encode(tokenizer, rows: list[dict], context: int) -> tuple[list[tuple[dict, dict]], list[tuple[int, str]], int]:
    """Each row as (chosen, rejected) encodings at its state: the expert's action, the agent's.
    Returns the pairs, the (index, reason) of rows that cannot be encoded (an action longer than
    the context), and how many pairs had their state's start cut to fit."""
    pairs, refused, cut = [], [], 0
    for i, r in enumerate(rows):
        try:
            chosen, cut_c = online_dpo.encode(tokenizer, r["prompt"], r["expert"], context)
            rejected, cut_r = online_dpo.encode(tokenizer, r["prompt"], r["agent"], context)
        except MaskError as e:
            refused.append((i, str(e)))
            continue
        pairs.append((chosen, rejected))
        cut += cut_c or cut_r
    return pairs, refused, cut


def train(model, tokenizer, rows: list[dict], seed: int, beta: float, **trainer_kwargs) -> list[dict]:
    """Trains `model` in place on online_dpo.pair_rows (each pair with pi_ref's log-probabilities
    of its two actions); returns the loss curve with the implicit rewards' margin and accuracy."""
    return online_dpo.fit(model, tokenizer, rows, seed=seed, beta=beta, **trainer_kwargs)
