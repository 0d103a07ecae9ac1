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
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

from models.hf import model_fingerprint
from storage.schema import chat_message, to_table
from storage.validate import RAW_CHARS, StageInputs
from tasks.params import Params
from tasks.rollout import derive_seed
from tasks.train import online_dpo, stepagent_implicit
from tasks.train.distributed import deepspeed_config, from_rank0, launch, partition, rank, save, world_size


def practice_rows(table) -> list[dict]:
    """The practice table's rows with their messages as chat messages."""
    rows = table.to_pylist()
    for r in rows:
        r["prompt"] = [chat_message(m) for m in r["prompt"]]
        r["expert"] = chat_message(r["expert"])
        r["agent"] = chat_message(r["agent"])
    return rows


def run_stepagent(params: Params, pairs: Path, out_dir: Path) -> dict:
    """Writes out_dir/model, out_dir/loss.json, out_dir/quarantine.parquet and out_dir/metrics.json."""
    t0 = time.time()
    s = params.stepagent
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
    kept, counts = stepagent_implicit.teaching(rows)
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
    # Rank 0 alone asks the frozen reference (pi_ref: the base model, as it practised).
    dpo_rows = online_dpo.pair_rows(AutoModelForCausalLM.from_pretrained(s.base_model, dtype=torch.float32), tokenizer, encoded) if main and encoded else []
    if ranks > 1:
        dpo_rows = from_rank0(dpo_rows)
    if main:
        print(f"stepagent: {s.variant} on {len(dpo_rows)} pairs ({counts['equal_dropped']} equal to the expert's action and "
              f"{counts['failed_dropped']} failed samples left out, {len(refused)} quarantined)" + (f" on {ranks} ranks" if ranks > 1 else ""), flush=True)
    curve = []
    if dpo_rows:
        kwargs = {k: getattr(s, k) for k in ("epochs", "batch_size", "learning_rate", "warmup_ratio", "weight_decay", "bf16", "max_loss_ratio")}
        curve = stepagent_implicit.train(model, tokenizer, dpo_rows, seed=derive_seed(params.seed, "stepagent"), beta=s.beta,
                                         deepspeed=deepspeed_config(s.deepspeed), **kwargs)
    shares = partition(model)
    save(model, tokenizer, out_dir / "model", main)
    if not main:
        return {}
    points = [{"step": e["step"], **{k: e[k] for k in ("loss", "margin", "accuracy") if k in e}} for e in curve]
    (out_dir / "loss.json").write_text(json.dumps(points) + "\n")
    # pi_ref should be the policy that practised (Algorithm 1): the pairs name theirs by weights.
    base_id = f"{Path(s.base_model).name}@{model_fingerprint(s.base_model)}"
    practised = sorted({r["policy_id"] for r in rows})
    metrics = {
        "inputs": inputs.write(out_dir),
        "variant": s.variant,
        "base_model": s.base_model,
        "beta": s.beta,
        "practice_policies": practised,
        "reference_practised": practised == [base_id],
        **counts,
        "quarantined": len(refused),
        "pairs": len(dpo_rows),
        "pairs_cut_to_context": cut,
        **({"untrained": "no pair to learn from: every practised action matched the expert's, or failed; the policy is the base model"} if not dpo_rows else {}),
        **({"world_size": ranks, "partition": shares} if ranks > 1 else {}),
        "first_loss": points[0]["loss"] if points else None,
        "final_loss": points[-1]["loss"] if points else None,
        "final_margin": points[-1].get("margin") if points else None,
        "final_accuracy": points[-1].get("accuracy") if points else None,
        "seconds": round(time.time() - t0, 1),
    }
    if not metrics["reference_practised"]:
        print(f"stepagent: the pairs were practised by {', '.join(practised)}, not by the base model {base_id}: pi_ref is not the policy that practised", flush=True)
    if "untrained" in metrics:
        print(f"stepagent: {metrics['untrained']}", flush=True)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics
