"""critic: HOPE's process critic Q(s, a) on the buffer's selected pairs (tasks/train/critic.py).

A `heldout_share` of the selected pairs, chosen by a hash of (seed, key), is kept out of
training; the critic's calibration on them (its error against their Monte Carlo targets, beside
the error of always predicting the training targets' mean) is the stage's metric. A pair longer
than the model's context is left out and counted.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from transformers import set_seed

from storage.schema import chat_message
from storage.validate import StageInputs
from tasks.params import Params
from tasks.rollout import derive_seed
from tasks.train import _deepspeed_config, _partition, _save
from tasks.train import critic as algorithm
from tasks.train.launch import launch, rank, world_size


def heldout(key: str, seed: int, share: float) -> bool:
    return derive_seed(seed, "critic-heldout", key) / 0x7FFFFFFF < share


def calibration(predicted: list[float], targets: list[float], mean: float) -> dict:
    """Mean absolute error, root mean squared error, and agreement on which side of 0.5 a pair is,
    against the error of predicting the training targets' mean for every pair."""
    n = len(targets)
    if n == 0:
        return {"pairs": 0}
    err = [p - t for p, t in zip(predicted, targets)]
    return {
        "pairs": n,
        "mae": round(sum(map(abs, err)) / n, 4),
        "rmse": round((sum(e * e for e in err) / n) ** 0.5, 4),
        "side_agreement": round(sum((p >= 0.5) == (t >= 0.5) for p, t in zip(predicted, targets)) / n, 4),
        "mae_of_mean": round(sum(abs(mean - t) for t in targets) / n, 4),
    }


def run_critic(params: Params, pairs: Path, out_dir: Path) -> dict:
    """Writes out_dir/model (a sequence-classification model directory), out_dir/loss.json and
    out_dir/metrics.json. With critic.nproc_per_node > 1, relaunches itself on that many ranks."""
    t0 = time.time()
    c = params.critic
    if c.nproc_per_node > 1 and not torch.distributed.is_torchelastic_launched():
        return launch(params, pairs, out_dir, None, c.nproc_per_node, stage="critic")
    main = rank() == 0
    inputs = StageInputs()
    table = inputs.read(pairs, "pairs")
    rows = [r for r in table.to_pylist() if r["selected"]]
    set_seed(params.seed)
    torch.use_deterministic_algorithms(True)
    model, tokenizer = algorithm.load_critic(c.base_model, base=True)
    context = model.config.max_position_embeddings
    train, held, too_long = [], [], 0
    for r in rows:
        ids = algorithm.encode(tokenizer, [chat_message(m) for m in r["prompt"]], chat_message(r["action"]))
        if len(ids) > context:
            too_long += 1
            continue
        (held if heldout(r["key"], params.seed, c.heldout_share) else train).append({"input_ids": ids, "target": r["target"]})
    if not train:
        raise ValueError(f"{pairs}: no selected pair to train the critic on ({len(rows)} selected, {too_long} longer than the model's {context} positions)")
    if main:
        print(f"critic: {len(train)} pairs to train on, {len(held)} held out, {too_long} too long for the context", flush=True)
    kwargs = {k: getattr(c, k) for k in ("epochs", "batch_size", "learning_rate", "warmup_ratio", "weight_decay", "bf16")}
    curve = algorithm.train(
        model, tokenizer, train, params.seed, padding_free=False, deepspeed=_deepspeed_config(c.deepspeed),
        max_loss_ratio=c.max_loss_ratio, **kwargs,
    )
    partition = _partition(model)
    # Every rank scores the same pairs: under ZeRO-3 each forward gathers the layers from all ranks.
    scored = {name: algorithm.score(model, tokenizer, [e["input_ids"] for e in part]) for name, part in (("heldout", held), ("train", train))}
    _save(model, tokenizer, out_dir / "model", main)
    metrics: dict = {"inputs": inputs.write(out_dir) if main else {}}
    if not main:
        return metrics
    if world_size() > 1:
        metrics.update(world_size=world_size(), partition=partition)
    mean = sum(e["target"] for e in train) / len(train)
    points = [{"step": e["step"], "loss": e["loss"]} for e in curve]
    (out_dir / "loss.json").write_text(json.dumps(points) + "\n")
    metrics.update({
        "base_model": c.base_model,
        "pairs_selected": len(rows),
        "pairs_too_long": too_long,
        "calibration": {name: calibration(scored[name], [e["target"] for e in part], mean) for name, part in (("heldout", held), ("train", train))},
        "final_loss": points[-1]["loss"] if points else None,
        "seconds": round(time.time() - t0, 1),
    })
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics
