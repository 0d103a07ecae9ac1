"""DPO on the final answers (a baseline of Refit/Swift): the best trajectory's final turn over the
worst's, on the same question, asked without the conversation.

    loss = - log sigmoid( beta * [ (log pi(y+|x) - log ref(y+|x)) - (log pi(y-|x) - log ref(y-|x)) ] )

"The final winning and losing responses are used to directly answer the original question. This
baseline shows what is possible without a conversation." Per question (split, task_id), of its
logged trajectories with a reward: y+ is the final assistant turn of the best (STaR-GATE's pick,
star_gate.ranked: highest reward, ties by the lowest trajectory_id), y- that of the worst (lowest
reward, ties by the highest trajectory_id: the other end of the same order). x is the question as
the conversation opens, the system prompt and the teacher's first turn: the paper leaves the
prompt open (gap 9); this one asks the question and nothing of the dialogue after it, which is the
baseline's point. A question whose best and worst rewards are equal (a tie: every run scored
alike) or whose two final turns are the same text (zero gradient) gives no pair, and is counted.

The loss, the action-only mask (online_dpo.encode: the prompt carries no loss), the pair collator
and the trainer are HOPE's actor's, which StepAgent-Implicit and ETO share; the frozen reference
is train.base_model, read before the first step. StepDPO (step_dpo.py) trains its per-step pairs
through `fit` here.
"""
from __future__ import annotations

import polars as pl

from storage.schema import from_table
from tasks.rollout import action_starts
from tasks.train import online_dpo
from tasks.train.sft import MaskError
from tasks.train.star_gate import ranked


def pairs(table: pl.DataFrame) -> tuple[list[dict], dict]:
    """The (prompt, chosen, rejected) pairs of the module's docstring, in (split, task_id) order,
    and the counts: questions, pairs, tied, same_text."""
    out, counts = [], {"questions": 0, "pairs": 0, "tied": 0, "same_text": 0}
    rows = from_table(ranked(table).select("split", "task_id", "trajectory_id", "reward", "messages"))
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["split"], r["task_id"]), []).append(r)
    for (split, task), group in sorted(groups.items()):
        counts["questions"] += 1
        best, worst = group[0], group[-1]
        chosen, rejected = (t["messages"][action_starts(t["messages"])[-1]] for t in (best, worst))
        if best["reward"] == worst["reward"]:
            counts["tied"] += 1
        elif chosen["content"] == rejected["content"]:
            counts["same_text"] += 1
        else:
            prompt = best["messages"][: action_starts(best["messages"])[0]]
            out.append({"split": split, "task_id": task, "chosen_id": best["trajectory_id"], "rejected_id": worst["trajectory_id"],
                        "prompt": prompt, "chosen": chosen, "rejected": rejected})
    counts["pairs"] = len(out)
    return out, counts


def encode(tokenizer, rows: list[dict], context: int) -> tuple[list[tuple[dict, dict]], int, int]:
    """Each pair as (chosen, rejected) encodings at its prompt, labels on the action alone
    (online_dpo.encode); and how many pairs had their prompt's start cut to the context, and how
    many were refused (an action longer than the context)."""
    encoded, cut, refused = [], 0, 0
    for r in rows:
        try:
            (chosen, cut_c), (rejected, cut_r) = (online_dpo.encode(tokenizer, r["prompt"], a, context) for a in (r["chosen"], r["rejected"]))
        except MaskError:
            refused += 1
            continue
        encoded.append((chosen, rejected))
        cut += cut_c or cut_r
    return encoded, cut, refused


def fit(model, tokenizer, rows: list[dict], cfg, seed: int) -> dict:
    """Pairs (prompt, chosen, rejected) trained with the shared DPO loss against `model` as it
    stands (the base: its log-probabilities, read before any update, are the reference's)."""
    encoded, cut, refused = encode(tokenizer, rows, model.config.max_position_embeddings)
    if not encoded:
        return {"rows": 0, "beta": cfg.beta, "pairs_cut": cut, "pairs_refused": refused, "curve": []}
    dpo_rows = online_dpo.pair_rows(model, tokenizer, encoded)
    # The pair collator pads; a packed batch would need its sequence bounds.
    curve = online_dpo.fit(model, tokenizer, dpo_rows, seed, cfg.beta, **cfg.trainer_kwargs())
    last = curve[-1] if curve else {}
    return {"rows": len(dpo_rows), "beta": cfg.beta, "pairs_cut": cut, "pairs_refused": refused,
            "final_margin": last.get("margin"), "final_accuracy": last.get("accuracy"), "curve": curve}


def train(model, tokenizer, table, cfg, seed: int) -> dict:
    rows, counts = pairs(table)
    return {**fit(model, tokenizer, rows, cfg, seed), **counts}
