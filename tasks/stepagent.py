"""stepagent: StepAgent's reflection on the practice pairs (`stepagent.variant`).

implicit (StepAgent-Implicit, Eq. 6; tasks/train/stepagent_implicit.py): the policy starts from
`stepagent.base_model`, whose frozen copy is DPO's reference pi_ref, and one pass of sigmoid DPO
(beta: `stepagent.beta`) prefers the expert's action over each action the policy practised at the
same state. pi_ref is the start-of-iteration policy, the one that practised: by default both are
the SFT base, data/bootstrap/model; metrics.json says whether the practice pairs came from it.
Pairs whose agent action matched the expert's, and samples that failed, are counted and left out
of the loss; a pair that cannot be encoded (an action longer than the model's context) is
quarantined with its reason. With nothing left to learn from (every sample matched the expert),
the stage keeps the base model and metrics.json says why, as the actor does.

Writes out_dir/model, out_dir/loss.json (loss, implicit-reward margin and accuracy by step) and
out_dir/metrics.json. With nproc_per_node > 1 the stage runs on that many ranks under torchrun
(tasks/train/distributed.py), as train does: rank 0 computes the reference's log-probabilities and
sends the pairs to every rank, every rank runs the DPO update under DeepSpeed, rank 0 writes.

inverse (StepAgent-Inverse, Eq. 9-11, Algorithm 1; tasks/train/stepagent_inverse.py): a
discriminator D(s, a) = P(expert | s, a) on the base model's body (tasks/train/discriminator.py)
and the policy alternate per batch of practice rows: one step of D's cross-entropy (expert 1,
agent 0), then `ppo_epochs` steps of PPO (tasks/train/ppo.py) on the batch's one-step episodes
with reward max(log D, reward_floor) from the updated D, a value head's baseline, clip
`clip_epsilon` and per-token KL (`kl_coef`) to pi_ref, the base model, which is also the
behaviour policy: rank 0 computes its per-token log-probabilities of the agent's actions once.
Samples equal to the expert's action stay in (the agent's own steps), failed ones are left out.
Also writes out_dir/discriminator (loads with AutoModelForSequenceClassification, as the critic);
loss.json's `loss` and `accuracy` are the discriminator's (Eq. 11), with the batch's mean reward,
the KL to pi_ref, PPO's policy and value losses and clipped share. On ranks, each model is a
DeepSpeed engine and every rank takes its share of every global batch.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

from models.hf import model_fingerprint, native_bf16
from storage.schema import chat_message, to_table
from storage.validate import RAW_CHARS, StageInputs
from tasks.params import Params
from tasks.rollout import derive_seed
from tasks.train import critic, discriminator, online_dpo, stepagent_implicit, stepagent_inverse
from tasks.train.distributed import deepspeed_config, from_rank0, launch, partition, rank, save, world_size


def practice_rows(table) -> list[dict]:
    """The practice table's rows with their messages as chat messages."""
    rows = table.to_pylist()
    for r in rows:
        r["prompt"] = [chat_message(m) for m in r["prompt"]]
        r["expert"] = chat_message(r["expert"])
        r["agent"] = chat_message(r["agent"])
    return rows


INVERSE_KNOBS = ("discriminator_learning_rate", "ppo_epochs", "clip_epsilon", "kl_coef", "value_coef", "reward_floor", "whiten_advantages")


def run_stepagent(params: Params, pairs: Path, out_dir: Path) -> dict:
    """Writes out_dir/model, out_dir/discriminator (implicit: only NONE.txt saying it has none),
    out_dir/loss.json, out_dir/quarantine.parquet and out_dir/metrics.json."""
    t0 = time.time()
    s = params.stepagent
    implicit = s.variant == "implicit"
    if s.nproc_per_node > 1 and not torch.distributed.is_torchelastic_launched():
        return launch(params, pairs, out_dir, None, s.nproc_per_node, stage="stepagent")
    main, ranks = rank() == 0, world_size()
    if ranks > 1 and not torch.distributed.is_initialized():
        import deepspeed

        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        deepspeed.init_distributed()
    inputs = StageInputs()
    table = inputs.read(pairs, "practice")
    rows = practice_rows(table)
    kept, counts = (stepagent_implicit if implicit else stepagent_inverse).teaching(rows)
    set_seed(params.seed)
    torch.use_deterministic_algorithms(True)
    model = AutoModelForCausalLM.from_pretrained(s.base_model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(s.base_model)
    encoded, refused, cut = stepagent_implicit.encode(tokenizer, kept, model.config.max_position_embeddings)
    if refused:
        numbers = dict(zip((r["pair_id"] for r in rows), inputs.file_rows(pairs, table)))
        inputs.add(str(pairs), to_table([
            {"source_file": str(pairs), "row": numbers[kept[i]["pair_id"]], "field": "agent", "reason": f"pair {kept[i]['pair_id']}: {why}",
             "raw": json.dumps({k: kept[i][k] for k in ("pair_id", "trajectory_id", "step", "sample")})[:RAW_CHARS]}
            for i, why in refused
        ], "quarantine"))
    # Rank 0 alone asks the frozen start-of-iteration policy (the base model, as it practised):
    # DPO's reference log-probabilities (implicit); PPO's pi_old = pi_ref, per token (inverse).
    start = AutoModelForCausalLM.from_pretrained(s.base_model, dtype=torch.float32) if main and encoded else None
    train_rows = (online_dpo.pair_rows if implicit else stepagent_inverse.examples)(start, tokenizer, encoded) if start else []
    if ranks > 1:
        train_rows = from_rank0(train_rows)
    if main:
        left = f"{counts['equal_dropped']} equal to the expert's action and " if implicit else f"{counts['equal_kept']} equal to the expert's action kept, "
        print(f"stepagent: {s.variant} on {len(train_rows)} pairs ({left}{counts['failed_dropped']} failed samples left out, {len(refused)} quarantined)"
              + (f" on {ranks} ranks" if ranks > 1 else ""), flush=True)
    kwargs = {k: getattr(s, k) for k in ("epochs", "batch_size", "learning_rate", "warmup_ratio", "weight_decay")}
    seed = derive_seed(params.seed, "stepagent")
    curve, judge = [], None
    if implicit and train_rows:
        curve = stepagent_implicit.train(model, tokenizer, train_rows, seed=seed, beta=s.beta, bf16=s.bf16, max_loss_ratio=s.max_loss_ratio,
                                         padding_free=s.padding_free, deepspeed=deepspeed_config(s.deepspeed), **kwargs)
    elif not implicit:
        judge, _ = discriminator.load(s.base_model, derive_seed(params.seed, "stepagent-discriminator"))
        if train_rows:
            curve = stepagent_inverse.train(model, judge, tokenizer, train_rows, seed=seed, bf16=native_bf16() if s.bf16 == "auto" else s.bf16,
                                            deepspeed=deepspeed_config(s.deepspeed), **kwargs, **{k: getattr(s, k) for k in INVERSE_KNOBS})
    shares = partition(model)
    save(model, tokenizer, out_dir / "model", main)
    if judge is not None:
        save(judge, tokenizer, out_dir / "discriminator", main)
    if not main:
        return {}
    if judge is None:  # a DVC output either way: the implicit variant says it trains none
        shutil.rmtree(out_dir / "discriminator", ignore_errors=True)
        (out_dir / "discriminator").mkdir(parents=True)
        (out_dir / "discriminator" / "NONE.txt").write_text("stepagent.variant implicit trains no discriminator (inverse does)\n")
    keys = ("loss", "margin", "accuracy") if implicit else ("loss", "accuracy", "reward", "kl", "policy_loss", "value_loss", "clip_fraction")
    points = [{"step": e["step"], **{k: e[k] for k in keys if k in e}} for e in curve]
    (out_dir / "loss.json").write_text(json.dumps(points) + "\n")
    # pi_ref should be the policy that practised (Algorithm 1): the pairs name theirs by weights.
    base_id = f"{Path(s.base_model).name}@{model_fingerprint(s.base_model)}"
    practised = sorted({r["policy_id"] for r in rows})
    last = points[-1] if points else {}
    untrained = "no pair to learn from: every practised action " + ("matched the expert's, or failed" if implicit else "failed") + "; the policy is the base model"
    metrics = {
        "inputs": inputs.write(out_dir),
        "variant": s.variant,
        "base_model": s.base_model,
        **({"beta": s.beta} if implicit else {k: getattr(s, k) for k in INVERSE_KNOBS}),
        "practice_policies": practised,
        "reference_practised": practised == [base_id],
        **counts,
        "quarantined": len(refused),
        "pairs": len(train_rows),
        "pairs_cut_to_context": cut,
        **({"untrained": untrained} if not train_rows else {}),
        **({"world_size": ranks, "partition": shares} if ranks > 1 else {}),
        "first_loss": points[0]["loss"] if points else None,
        "final_loss": last.get("loss"),
        **({"final_margin": last.get("margin")} if implicit else {"final_reward": last.get("reward"), "final_kl": last.get("kl")}),
        "final_accuracy": last.get("accuracy"),
        "seconds": round(time.time() - t0, 1),
    }
    if not metrics["reference_practised"]:
        print(f"stepagent: the pairs were practised by {', '.join(practised)}, not by the base model {base_id}: pi_ref is not the policy that practised", flush=True)
    if "untrained" in metrics:
        print(f"stepagent: {metrics['untrained']}", flush=True)
        if judge is not None:  # as the critic stage marks a critic it left untrained
            (out_dir / "discriminator" / critic.UNTRAINED).write_text(untrained.replace("the policy is the base model", "the discriminator's head is untrained") + "\n")
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics
