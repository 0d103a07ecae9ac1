"""ETO (Song et al. 2024, "Trial and Error"; a baseline of StepAgent's Table 2): trajectory-level
DPO of the expert's trajectory over the policy's failed one on the same task.

    loss = - log sigmoid( beta * [ (log pi(t_e|x) - log ref(t_e|x)) - (log pi(t_f|x) - log ref(t_f|x)) ] )
    log pi(t|x) = the sum of log p(token) over the assistant turns of t, all of them

x is the task, t_e the expert's trajectory on it (the expert stage) and t_f one the policy played
on it and failed (the collect stage: ETO's exploration, in the environment). After the first turn
the two see different observations; those are the environment's, not the policy's, so every
user/observation and system token is masked (sft.tokenize_chats' assistant mask, SFT's own). A
trajectory longer than the model's context keeps its first positions, as SFT cuts it (its later
turns carry no loss); such pairs are counted. The reference is the frozen base: its
log-probabilities are taken once, before the first step, from the model the method starts from
(train.base_model, as every train method). beta: the method's `beta`, ETO's 0.1 (0.5 in its later
iterations). ETO's one round of exploration and DPO is what is built; its iterations are not.

Pairing (`pairs`); every collect trajectory lands in exactly one count:
- success false is a failure; each failure is paired with its task's expert trajectory, so a task
  with several failures (collect.m episodes a task) gives one pair per failure, each failure a
  distinct negative against the same expert;
- the expert trajectory is the task's first successful one by (seed, trajectory_id) (expert.m > 1
  plays more); a task none of whose expert trajectories succeeded (or says whether it did) gives
  no pair: a losing expert is not the better trajectory ETO's contrast needs
  (failures_expert_failed);
- a failure on a task the expert did not play (another split, a limit_tasks cut) gives no pair
  (failures_without_expert);
- successes are no negative (a task without a failure gives no pair), and a trajectory that does
  not say whether it succeeded (an import) is neither (outcome_unknown).

The loss, the pair collator and the trainer are HOPE's actor's (online_dpo.py), which
StepAgent-Implicit shares: ETO differs only in its sequences, whole trajectories with every
assistant turn labelled, where those two label one action after a shared state.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

from tasks.train import online_dpo
from tasks.train.distributed import _zero3_params
from tasks.train.sft import tokenize_chats


def pairs(expert: list[dict], policy: list[dict]) -> tuple[list[dict], dict]:
    """(expert, failure) pairs by task (split, task_id), in (split, task_id, seed, trajectory_id)
    order, and the counts of the pairing rule (the module's docstring)."""
    order = lambda t: (t["seed"], t["trajectory_id"])  # noqa: E731
    experts: dict[tuple, list[dict]] = defaultdict(list)
    for t in expert:
        experts[t["split"], t["task_id"]].append(t)
    failures: dict[tuple, list[dict]] = defaultdict(list)
    tasks = set()
    for t in policy:
        tasks.add((t["split"], t["task_id"]))
        if t["success"] is False:
            failures[t["split"], t["task_id"]].append(t)
    out: list[dict] = []
    counts = {"failures_paired": 0, "failures_expert_failed": 0, "failures_without_expert": 0}
    tasks_paired = tasks_several = tasks_expert_failed = tasks_without_expert = 0
    for task in sorted(failures):
        lost = sorted(failures[task], key=order)
        won = sorted((t for t in experts.get(task, []) if t["success"] is True), key=order)
        if task not in experts:
            counts["failures_without_expert"] += len(lost)
            tasks_without_expert += 1
        elif not won:
            counts["failures_expert_failed"] += len(lost)
            tasks_expert_failed += 1
        else:
            counts["failures_paired"] += len(lost)
            tasks_paired += 1
            tasks_several += len(lost) > 1
            out += [{"split": task[0], "task_id": task[1], "expert_id": won[0]["trajectory_id"], "failure_id": f["trajectory_id"],
                     "chosen": won[0]["messages"], "rejected": f["messages"]} for f in lost]
    return out, {
        "policy_trajectories": len(policy),
        "successes": sum(t["success"] is True for t in policy),
        "outcome_unknown": sum(t["success"] is None for t in policy),
        **counts,
        "tasks": len(tasks), "tasks_paired": tasks_paired, "tasks_several_failures": tasks_several,
        "tasks_without_failure": len(tasks) - len(failures), "tasks_expert_failed": tasks_expert_failed,
        "tasks_without_expert": tasks_without_expert,
        "expert_trajectories": len(expert), "experts_paired": len({p["expert_id"] for p in out}),
    }


def encode(tokenizer, rows: list[dict], context: int) -> tuple[list[tuple[dict, dict]], int]:
    """Each pair as (chosen, rejected) encodings, labels on every assistant turn; and how many
    pairs had a trajectory cut to the context."""
    encoded, cut = [], 0
    for r in rows:
        chats = tokenize_chats(tokenizer, [r["chosen"], r["rejected"]], context)
        encoded.append(tuple(chats.examples))
        cut += chats.truncated > 0
    return encoded, cut


def _gathered(model):
    """The whole weights on every rank while the reference is read, where ZeRO-3 partitioned them
    (a multi-rank run whose model was loaded under DeepSpeed's init)."""
    zero3 = _zero3_params(model)
    if not zero3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(zero3, modifier_rank=None)


def train(model, tokenizer, rows: list[dict], cfg, seed: int) -> dict:
    """rows: pairs() of the expert and collect tables, which run_train builds once for the stage.
    `model` is the base: its log-probabilities, read before any update, are the reference's."""
    encoded, cut = encode(tokenizer, rows, model.config.max_position_embeddings)
    if not encoded:
        return {"rows": 0, "beta": cfg.beta, "pairs_cut": 0, "curve": []}
    with _gathered(model):  # every rank reads the same reference: the same weights, the same pairs
        dpo_rows = online_dpo.pair_rows(model, tokenizer, encoded)
    # The pair collator pads; a packed batch would need its sequence bounds.
    curve = online_dpo.fit(model, tokenizer, dpo_rows, seed, cfg.beta, **cfg.trainer_kwargs())
    last = curve[-1] if curve else {}
    return {"rows": len(dpo_rows), "beta": cfg.beta, "pairs_cut": cut, "final_margin": last.get("margin"),
            "final_accuracy": last.get("accuracy"), "curve": curve}
