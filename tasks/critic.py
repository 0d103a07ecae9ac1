"""critic: HOPE's process critic Q(s, a) on the buffer's selected pairs (tasks/train/critic.py).

A `heldout_share` of the selected pairs, chosen by a hash of (seed, key), is kept out of
training; the critic's calibration on them (its error against their Monte Carlo targets, beside
the error of always predicting the training targets' mean) is the stage's metric. A pair longer
than the model's context is left out and counted.

A handful of pairs (the buffer's balance can keep as few as twice its rarer half) still trains,
and metrics.json says they were fewer than one batch (`few_pairs`). With none to train on, the
stage does not stop the pipeline: the critic is skipped, a zero head that scores every pair 0.5,
its reason printed, in metrics.json (`untrained`) and in model/UNTRAINED.txt, where the actor
reads it (tasks/train/critic.py: untrained).

With select: best_of_n_val the critic after every epoch is kept, each plays best-of-N with the
policy on the val games (HOPE 2.7), and the best is the stage's model (select_checkpoint).

With a checkpoint directory, a killed run resumes (single process): the trainer's checkpoints
and the epoch snapshots are kept there under a key of the pairs, the base model, the critic's
params and the seed, and removed once the stage has written its model.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from transformers import TrainerCallback, set_seed

from models.base import SamplingParams

from storage.schema import chat_message
from storage.validate import StageInputs
from tasks.params import Params
from tasks.roles import policy_generator
from tasks.rollout import BestOfNAgent, derive_seed, new_episode, play
from tasks.simulator import make_simulator
from tasks.train import checkpoint_store, path_digest
from tasks.train import critic as algorithm
from tasks.train.distributed import deepspeed_config, launch, partition, rank, save, world_size
from tasks.train.sft import latest_checkpoint


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


class EpochSnapshots(TrainerCallback):
    """The critic at the end of every epoch, written under `folder` (a collective under ZeRO-3)."""

    def __init__(self, model, tokenizer, folder: Path, main: bool):
        self.model, self.tokenizer, self.folder, self.main = model, tokenizer, folder, main

    @property
    def saved(self) -> list[Path]:  # a resumed run's earlier epochs included
        return sorted((p for p in self.folder.glob("epoch-*") if (p / "config.json").exists()), key=lambda p: int(p.name[6:]))

    def on_epoch_end(self, args, state, control, **kwargs):
        save(self.model, self.tokenizer, self.folder / f"epoch-{round(state.epoch)}", self.main)


def select_checkpoint(params: Params, snapshots: list[Path], held: list[dict], mean: float, out: Path) -> dict:
    """HOPE's choice of the critic: each snapshot plays best-of-select_n with the policy on the val
    games; the highest success wins, ties going to the lower held-out error, then the later
    epoch. The winner is copied to `out`; returns every snapshot's figures and the choice."""
    c, env = params.critic, params.env.environment()
    sampling = SamplingParams(**c.select_sampling.model_dump())
    generator = policy_generator(params, None, params.evaluate.batch_size)
    simulator = make_simulator(params)
    figures = []
    for path in snapshots:
        model, tokenizer = algorithm.load_critic(str(path))
        episodes = [new_episode(env, task, derive_seed(params.seed, "critic-select", task.id)) for task in env.tasks("val")[: params.limit_tasks]]
        score = lambda pairs, m=model, t=tokenizer: algorithm.score_pairs(m, t, pairs)  # noqa: E731
        play(episodes, BestOfNAgent(generator, sampling, c.select_n, score), derive_seed(params.seed, "critic-select"), f"critic {path.name}: best-of-{c.select_n} on val", simulator)
        predicted = algorithm.score(model, tokenizer, [e["input_ids"] for e in held])
        figures.append({
            "checkpoint": path.name, "val_success": round(sum(e.game.success for e in episodes) / len(episodes), 4),
            "heldout_mae": calibration(predicted, [e["target"] for e in held], mean).get("mae"),
        })
    best = max(range(len(figures)), key=lambda i: (figures[i]["val_success"], -(figures[i]["heldout_mae"] or 0.0), i))
    shutil.rmtree(out)
    shutil.copytree(snapshots[best], out)
    print(f"critic: {figures[best]['checkpoint']} chosen by best-of-{c.select_n} on val ({figures})", flush=True)
    return {"by": c.select, "n": c.select_n, "checkpoints": figures, "chosen": figures[best]["checkpoint"]}


def _skipped(model, tokenizer, out_dir: Path, why: str, main: bool, metrics: dict) -> dict:
    """The critic left untrained: a zero head, the reason beside its weights and in its metrics."""
    with torch.no_grad():
        model.score.weight.zero_()
    save(model, tokenizer, out_dir / "model", main)
    if not main:
        return metrics
    print(f"critic: not trained: {why}; it scores every pair 0.5", flush=True)
    (out_dir / "model" / algorithm.UNTRAINED).write_text(why + "\n")
    (out_dir / "loss.json").write_text("[]\n")
    metrics.update(trained=False, untrained=why)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics


def run_critic(params: Params, pairs: Path, out_dir: Path, checkpoint_dir: Path | None = None) -> dict:
    """Writes out_dir/model (a sequence-classification model directory), out_dir/loss.json and
    out_dir/metrics.json. With checkpoint_dir, resumes a killed run (see the module's docstring).
    With critic.nproc_per_node > 1, relaunches itself on that many ranks.
    With no pair to train on, the critic is skipped: its model scores every pair alike, and
    model/UNTRAINED.txt and metrics.json say why (tasks/train/critic.py: untrained)."""
    t0 = time.time()
    c = params.critic
    if c.nproc_per_node > 1 and not torch.distributed.is_torchelastic_launched():
        return launch(params, pairs, out_dir, checkpoint_dir, c.nproc_per_node, stage="critic")
    main = rank() == 0
    if world_size() > 1 and checkpoint_dir is not None:
        if main:
            print(f"critic: resuming is single-process only; with {world_size()} ranks a killed run trains from the start", flush=True)
        checkpoint_dir = None
    store = None
    if checkpoint_dir is not None:
        store = checkpoint_store(checkpoint_dir, "critic", {
            "pairs": path_digest(str(pairs)), "base_model": path_digest(c.base_model), "critic": c.model_dump(mode="json"), "seed": params.seed,
        })
        if resume := latest_checkpoint(store / "trainer"):
            print(f"critic: resuming from its checkpoint at step {resume.name.rsplit('-', 1)[1]}", flush=True)
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
    selected = f"{len(rows)} of the buffer's {table.num_rows} pairs selected"
    if not train:
        # Skipped, not stopped: the critic is the base policy with a zero head, which scores every
        # pair 0.5, so the actor sees only ties and best-of-N plays the policy's first sample.
        why = f"no pair to train on ({selected}, {too_long} too long for the model's {context} positions, {len(held)} held out)"
        return _skipped(model, tokenizer, out_dir, why, main, {
            "inputs": inputs.write(out_dir) if main else {}, "base_model": c.base_model, "pairs_selected": len(rows), "pairs_too_long": too_long,
            "seconds": round(time.time() - t0, 1),
        })
    few = f"{len(train)} pairs to train on, fewer than one batch ({c.batch_size}): its scores say little" if len(train) < c.batch_size else None
    if main:
        print(f"critic: {len(train)} pairs to train on ({selected}), {len(held)} held out, {too_long} too long for the context", flush=True)
        if few:
            print(f"critic: {few}; the buffer's metrics.json says why it selected so few", flush=True)
    head = algorithm.fit_head(model, tokenizer, train) if c.head_init == "probe" else None
    if main and head:
        print(f"critic: head fit on the frozen policy, Eq. 1 {head['loss_zero_head']} -> {head['loss_fit_head']}", flush=True)
    kwargs = {k: getattr(c, k) for k in ("epochs", "batch_size", "learning_rate", "warmup_ratio", "weight_decay", "bf16")}
    snapshots = store / "epochs" if store else out_dir / ".epochs"
    if store is None:
        shutil.rmtree(snapshots, ignore_errors=True)
    callbacks = (EpochSnapshots(model, tokenizer, snapshots, main),) if c.select == "best_of_n_val" else ()
    curve = algorithm.train(
        model, tokenizer, train, params.seed, padding_free=c.padding_free, deepspeed=deepspeed_config(c.deepspeed),
        max_loss_ratio=c.max_loss_ratio, callbacks=callbacks, checkpoint_dir=store / "trainer" if store else None, **kwargs,
    )
    shares = partition(model)
    # Every rank scores the same pairs: under ZeRO-3 each forward gathers the layers from all ranks.
    scored = {name: algorithm.score(model, tokenizer, [e["input_ids"] for e in part]) for name, part in (("heldout", held), ("train", train))}
    save(model, tokenizer, out_dir / "model", main)
    metrics: dict = {"inputs": inputs.write(out_dir) if main else {}}
    if not main:
        return metrics
    (out_dir / "model" / algorithm.UNTRAINED).unlink(missing_ok=True)  # a skipped run's, in the same folder
    mean = sum(e["target"] for e in train) / len(train)
    if callbacks:
        metrics["selection"] = select_checkpoint(params, callbacks[0].saved, held, mean, out_dir / "model")
        model, tokenizer = algorithm.load_critic(str(out_dir / "model"))
        scored = {name: algorithm.score(model, tokenizer, [e["input_ids"] for e in part]) for name, part in (("heldout", held), ("train", train))}
    if world_size() > 1:
        metrics.update(world_size=world_size(), partition=shares)
    points = [{"step": e["step"], "loss": e["loss"]} for e in curve]
    (out_dir / "loss.json").write_text(json.dumps(points) + "\n")
    metrics.update({
        "base_model": c.base_model,
        "head_init": head or c.head_init,
        "pairs_selected": len(rows),
        "pairs_too_long": too_long,
        "trained": True,
        **({"few_pairs": few} if few else {}),
        "calibration": {name: calibration(scored[name], [e["target"] for e in part], mean) for name, part in (("heldout", held), ("train", train))},
        "final_loss": points[-1]["loss"] if points else None,
        "seconds": round(time.time() - t0, 1),
    })
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(store or snapshots, ignore_errors=True)
    return metrics
