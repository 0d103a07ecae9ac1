"""LEAP: imitate the hindsight proposer's corrective actions (HOPE's Table 2 baseline).

    loss = - E_{(s, a^H)} [ sum_t log pi(a^H_t | s, a^H_<t) ]

(s, a^H) ranges over relabel's counterfactuals: s is the state at a relabelled turn, the logged
parent's messages before its action number `branch_turn` (observations as logged, never asked
again, as regenerate splices them); a^H is a counterfactual the proposer gave there (status ok),
written as the game records the agent's text (Game.message: CarDealer's API calls as tool calls).
Each counterfactual is one example, so a site with n of them gives n. Only a^H's tokens carry
loss: the earlier agent turns in s are the logging policy's own actions, the ones the proposer
corrected, and cloning them is what LEAP is meant not to do (the mask is online_dpo.encode's).

HOPE (2.9) trains LEAP for one epoch from the base model, not from pi_0 (from pi_0 it degraded);
here it starts, like every method, from train.base_model, with train's epochs. It sees neither
the regenerations nor any reward: what the proposer would have done is the whole signal. A
state longer than the model's context keeps its last positions (the action whole); an action
alone longer than the context is left out and counted.
"""
from __future__ import annotations

from envs.base import Environment
from tasks.rollout import episode_from_prefix
from tasks.train.online_dpo import encode
from tasks.train.sft import MaskError, train_sft


def counterfactuals(env: Environment, relabels: list[dict], parents: dict[str, dict]) -> list[dict]:
    """One row per counterfactual (relabels rows with status ok, whose parent is in `parents`;
    regenerate.ok_relabels gives them), in (trajectory, turn, rank) order: its lineage, its state
    (`prompt`) and its action message (`action`)."""
    rows = []
    usable = [r for r in relabels if r["status"] == "ok" and r["trajectory_id"] in parents]
    for r in sorted(usable, key=lambda r: (r["trajectory_id"], r["branch_turn"], r["rank"])):
        # The seed is the episode's record only: nothing is sampled here.
        ep = episode_from_prefix(env, parents[r["trajectory_id"]], r["branch_turn"], seed=0)
        rows.append({
            "relabel_id": r["relabel_id"], "trajectory_id": r["trajectory_id"], "branch_turn": r["branch_turn"],
            "prompt": ep.messages, "action": ep.game.message(r["counterfactual_text"]),
        })
    return rows


def examples(tokenizer, rows: list[dict], context: int) -> tuple[list[dict], dict]:
    """The SFT examples (input_ids, labels on the action alone) and what was cut or left out."""
    out, counts = [], {"truncated": 0, "too_long": 0}
    for r in rows:
        try:
            example, cut = encode(tokenizer, r["prompt"], r["action"], context)
        except MaskError as e:
            if "longer than" not in str(e):
                raise MaskError(f"leap: relabel {r['relabel_id']}: {e}") from None
            counts["too_long"] += 1
            continue
        counts["truncated"] += cut
        out.append(example)
    return out, counts


def train(model, tokenizer, rows: list[dict], cfg, seed: int) -> dict:
    """rows: counterfactuals() of the relabel table, which run_train builds once for the stage."""
    found, counts = examples(tokenizer, rows, model.config.max_position_embeddings)
    if not found:
        return {"rows": 0, **counts, "curve": []}
    curve = train_sft(model, tokenizer, found, seed=seed, **cfg.trainer_kwargs())
    return {"rows": len(found), "sites": len({(r["trajectory_id"], r["branch_turn"]) for r in rows}), **counts, "curve": curve}
