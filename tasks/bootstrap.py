"""bootstrap: build the embedded default policy from nothing.

Scripted behaviour policies play the train tasks (bootstrap.demo_splits); a BPE tokenizer and a
small Llama are trained by SFT (loss on agent turns only) on their demonstrations and on the
environment's fact sheets about every task of every split, which stand in for what a pretrained
LLM knows: val and test games stay unseen, their objects do not. The trained policy then plays
beside the scripted ones so its success rate can be read next to theirs.

A base trained this way can be shipped in the repository (models/base/<env>, packed by
bench/base_checkpoint.py with its provenance): with `bootstrap.checkpoint: auto` the stage starts
from it when it was trained with the run's env and bootstrap keys, instead of an hour of SFT.
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers import TrainerCallback, set_seed

from envs.base import Mixture
from models.base import SamplingParams
from models.checkpoint import PROVENANCE, verify
from models.hf import HFGenerator
from models.tiny import copy_drills, make_model, train_tokenizer
from storage.parquet import write_table
from storage.schema import to_table
from tasks.params import Params
from tasks.rollout import LMAgent, ScriptedAgent, derive_seed, episode_stats, new_episode, play, stats_by_split
from tasks.train.sft import tokenize_chats, train_sft


def behaviour(params: Params) -> Mixture:
    """The per-episode mixture of the environment's scripted policies (bootstrap.behaviour_mix),
    which may name any policy the environment offers (persuasion's pushy too); a name it does
    not offer is an error naming it and the ones it does."""
    env = params.env.environment()
    policies = env.policies(params.bootstrap.noisy.model_dump())
    if unknown := sorted(set(params.bootstrap.behaviour_mix) - set(policies)):
        raise ValueError(
            f"bootstrap.behaviour_mix: {', '.join(map(repr, unknown))} is not a scripted policy of environment {env.name} "
            f"(it offers {', '.join(sorted(policies))})"
        )
    return Mixture(dict(params.bootstrap.behaviour_mix), policies)


def demonstrations(params: Params) -> list:
    env, b = params.env.environment(), params.bootstrap
    episodes = [
        new_episode(env, task, derive_seed(params.seed, "demo", task.id, k))
        for split in b.demo_splits
        for task in env.tasks(split)[: b.limit_tasks]
        for k in range(b.demos_per_task)
    ]
    return play(episodes, ScriptedAgent(behaviour(params).for_episode), params.seed, "demonstrations")


def longest_action_tokens(tokenizer, demos: list) -> int:
    """The longest scripted action in tokens, end-of-turn token included: the least max_new_tokens
    that lets the policy say everything it was taught (a guess lists what the answers established)."""
    actions = [m["content"] for e in demos for m in e.messages if m["role"] == "assistant"]
    return 1 + max(len(ids) for ids in tokenizer(actions, add_special_tokens=False)["input_ids"])


def _eval_episodes(params: Params, splits: list[str], who: str) -> list:
    env = params.env.environment()
    return [
        new_episode(env, t, derive_seed(params.seed, "eval", who, t.id))
        for split in splits
        for t in env.tasks(split)[: params.bootstrap.limit_tasks]
    ]


def scripted_baselines(params: Params, splits: list[str]) -> dict:
    """Success of each scripted policy, one episode per task, on the same tasks as the model."""
    policies = params.env.environment().policies(params.bootstrap.noisy.model_dump())
    factories = {name: (lambda rng, p=p: p) for name, p in policies.items()} | {"mixture": behaviour(params).for_episode}
    return {
        name: stats_by_split(play(_eval_episodes(params, splits, name), ScriptedAgent(factory), params.seed, name))
        for name, factory in factories.items()
    }


def evaluate_model(params: Params, model_dir: Path, splits: list[str]) -> dict:
    """Success of the trained policy on every eval split, all episodes batched together."""
    # In the precision collect will use, so this first look matches the logged data.
    gen = HFGenerator(model_dir, batch_size=params.bootstrap.eval_batch_size, dtype=params.roles.policy.dtype)
    agent = LMAgent(gen, SamplingParams(**params.bootstrap.eval_sampling.model_dump()))
    episodes = play(_eval_episodes(params, splits, "model"), agent, derive_seed(params.seed, "eval-model"), "model")
    return stats_by_split(episodes)


@torch.no_grad()
def copy_accuracy(model, examples: list[dict]) -> float:
    """Teacher-forced share of the supervised tokens the model puts first (held-out copy drills)."""
    model.eval()
    hits = total = 0
    for e in examples:
        predicted = model(torch.tensor([e["input_ids"]])).logits[0, :-1].argmax(-1).tolist()
        for p, label in zip(predicted, e["labels"][1:]):
            if label >= 0:
                hits, total = hits + (p == label), total + 1
    model.train()
    return round(hits / total, 4)


class _Snapshots(TrainerCallback):
    """Saves the model every `every` epochs (the learning curve's points)."""

    def __init__(self, every: int, folder: Path, tokenizer) -> None:
        self.every, self.folder, self.tokenizer, self.saved = every, folder, tokenizer, []

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        epoch = round(state.epoch)
        if epoch % self.every == 0 and epoch < args.num_train_epochs:
            path = self.folder / f"epoch-{epoch}"
            model.save_pretrained(path)
            self.tokenizer.save_pretrained(path)
            self.saved.append((epoch, path))


def _success(stats: dict) -> dict:
    return {split: s["success_rate"] for split, s in stats.items()}


ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "models" / "base"  # models/base/<env.name>: the environment's shipped base
# What a base's weights do not depend on: where it is used and how its first look is taken.
NOT_TRAINING = {"checkpoint", "limit_tasks", "eval_splits", "eval_sampling", "eval_batch_size", "curve_every"}


def training_keys(params: Params) -> dict:
    """The keys a base's weights depend on: the environment's options (defaults filled in) and
    bootstrap's training keys. A shipped base records them; a run starts from it only if its own
    are the same. The seed is recorded but not compared: like the bench's --base, one base serves
    every seed of a comparison."""
    env = params.env.environment()
    return {"env": {"name": env.name, **env.options.model_dump(mode="json")},
            "bootstrap": params.bootstrap.model_dump(mode="json", exclude=NOT_TRAINING)}


def _differences(recorded, current, at: str = "") -> list[str]:
    if isinstance(recorded, dict) and isinstance(current, dict):
        return [d for k in sorted(set(recorded) | set(current)) for d in _differences(recorded.get(k), current.get(k), f"{at}.{k}" if at else k)]
    return [] if recorded == current else [f"{at}: {current!r} here, {recorded!r} in the checkpoint"]


def shipped_base(params: Params) -> tuple[Path | None, dict | None, str]:
    """(checkpoint dir, its provenance, why) for bootstrap.checkpoint: auto takes the environment's
    shipped base when its training keys are the run's, else trains; a path must match or it is an
    error; null trains. A checkpoint whose files fail their checksums is always an error."""
    chosen = params.bootstrap.checkpoint
    if chosen is None:
        return None, None, "bootstrap.checkpoint is null: training a base"
    path = SHIPPED / params.env.name if chosen == "auto" else Path(chosen)
    shown = _shown(path)
    if chosen == "auto" and not (path / PROVENANCE).exists():
        return None, None, f"no shipped base for {params.env.name} ({shown}): training a base"
    provenance = verify(path)
    differ = _differences(training_keys(_with_recorded(params, provenance)), training_keys(params))
    if differ and chosen == "auto":
        return None, None, f"the shipped base {shown} was trained with other keys ({'; '.join(differ[:3])}): training a base"
    if differ:
        raise ValueError(f"bootstrap.checkpoint {chosen} was trained with other keys: {'; '.join(differ)}. "
                         "Set them as it records (its provenance.json), or bootstrap.checkpoint: null to train a base")
    return path, provenance, f"starting from the shipped base {shown} (trained by `{provenance['command']}`)"


def _shown(path: Path) -> Path:
    """A path as a user reads it: relative to the workspace where it is inside it."""
    path = path.absolute()
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path


def _with_recorded(params: Params, provenance: dict) -> Params:
    """The run's params with the checkpoint's recorded training keys laid in, validated as the
    stage reads them: a knob added since, at its default, is no difference."""
    recorded = provenance["params"]["training"]
    raw = params.model_dump(mode="json")
    raw["env"] = recorded["env"]
    raw["bootstrap"] = {**raw["bootstrap"], **recorded["bootstrap"]}
    return Params.model_validate(raw)


def load_base(params: Params, source: Path, provenance: dict, out_dir: Path) -> dict:
    """bootstrap from a shipped base: its model and training curve, the demonstrations it was
    taught on (written as training writes them), and the first look recorded when it was trained."""
    t0 = time.time()
    # every demonstration the base was taught on, whatever limit_tasks a quick look plays
    demos = demonstrations(params.model_copy(update={"bootstrap": params.bootstrap.model_copy(update={"limit_tasks": None})}))
    write_table(to_table(sorted((e.to_row() for e in demos), key=lambda r: r["trajectory_id"]), "trajectories"),
                out_dir / "demos.parquet", "trajectories")
    if (out_dir / "model").exists():
        shutil.rmtree(out_dir / "model")
    shutil.copytree(source / "model", out_dir / "model")
    shutil.copy2(source / "loss.json", out_dir / "loss.json")
    shown = _shown(source)
    trained = provenance["metrics"]
    metrics = {**trained, "seconds": round(time.time() - t0, 1), "checkpoint": {
        "path": str(shown), "command": provenance["command"], "seed": provenance["params"]["seed"],
        "sha256": provenance["files"]["model/model.safetensors"], "trained_seconds": trained.get("seconds")}}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics


def run_bootstrap(params: Params, out_dir: Path) -> dict:
    """Writes out_dir/model (HF model directory), demos.parquet and metrics.json: from the shipped
    base when bootstrap.checkpoint picks one, else trained here."""
    source, provenance, why = shipped_base(params)
    print(f"bootstrap: {why}", flush=True)
    if source is not None:
        return load_base(params, source, provenance, out_dir)
    t0 = time.time()
    set_seed(params.seed)
    torch.use_deterministic_algorithms(True)
    b, env = params.bootstrap, params.env.environment()

    demos = demonstrations(params)
    facts = env.fact_sheets(derive_seed(params.seed, "facts"))
    demo_seconds = time.time() - t0
    rows = [e.to_row() for e in demos]
    write_table(to_table(sorted(rows, key=lambda r: r["trajectory_id"]), "trajectories"), out_dir / "demos.parquet", "trajectories")

    conversations = [e.messages for e in demos] + facts
    # The tokenizer also sees every task's names and prompts, so held-out tasks encode as
    # compactly as training ones.
    corpus = [m["content"] for c in conversations for m in c] + env.tokenizer_corpus()
    tokenizer = train_tokenizer(corpus, b.tokenizer.vocab_size, b.tokenizer.split_digits)

    longest = longest_action_tokens(tokenizer, demos)
    if b.eval_sampling.max_new_tokens < longest:
        raise ValueError(
            f"bootstrap.eval_sampling.max_new_tokens is {b.eval_sampling.max_new_tokens}, but the longest scripted action is "
            f"{longest} tokens with its end-of-turn token: the policy's guesses would be cut off and fail to parse. "
            f"Raise it, and the other policy samplings' max_new_tokens (collect, regenerate, evaluate), to at least {longest}"
        )

    m = b.model
    model = make_model(tokenizer, m.hidden_size, m.num_layers, m.num_heads, m.head_dim, m.intermediate_size, m.max_length)
    tokenized = tokenize_chats(tokenizer, conversations, m.max_length)
    t_drill = time.time()
    drill = {}
    if b.drill.sequences:
        d = b.drill
        held_out = copy_drills(tokenizer, 200, d.length, derive_seed(params.seed, "drill", "held-out"))
        drills = copy_drills(tokenizer, d.sequences, d.length, derive_seed(params.seed, "drill"))
        # one pass, at the drills' batch and rate; the rest as the demonstrations train
        keys = b.train.model_dump() | {"epochs": 1, "batch_size": d.batch_size, "learning_rate": d.learning_rate}
        curve = train_sft(model, tokenizer, drills, seed=params.seed, **keys)
        drill = {"sequences": d.sequences, "final_loss": curve[-1]["loss"], "copy_accuracy": copy_accuracy(model, held_out)}
        print(f"copy drills: {d.sequences} sequences, final loss {drill['final_loss']:.3f}, held-out copy accuracy {drill['copy_accuracy']}", flush=True)
    drill_seconds = time.time() - t_drill
    t_train = time.time()
    with tempfile.TemporaryDirectory(prefix="retrosight-bootstrap-") as snapshots_dir:
        snapshots = _Snapshots(b.curve_every, Path(snapshots_dir), tokenizer) if b.curve_every else None
        curve = train_sft(model, tokenizer, tokenized.examples, seed=params.seed, callbacks=(snapshots,) if snapshots else (), **b.train.model_dump())
        train_seconds = time.time() - t_train
        if drill:  # what the demonstrations left of the copying
            drill["copy_accuracy_after_demonstrations"] = copy_accuracy(model, held_out)

        model_dir = out_dir / "model"
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)

        t_eval = time.time()
        model_success = evaluate_model(params, model_dir, b.eval_splits)
        learning_curve = [{"epoch": epoch, **_success(evaluate_model(params, path, b.eval_splits))} for epoch, path in snapshots.saved] + [
            {"epoch": b.train.epochs, **_success(model_success)}
        ] if snapshots else []
    eval_seconds = time.time() - t_eval
    metrics = {
        "demonstrations": {
            "episodes": len(demos),
            **episode_stats(demos),
            "tokens": sum(len(x["input_ids"]) for x in tokenized.examples),
            "supervised_tokens": sum(sum(1 for t in x["labels"] if t >= 0) for x in tokenized.examples),
            "truncated": tokenized.truncated,
            "longest_action_tokens": longest,
            "seconds": round(demo_seconds, 1),
        },
        "fact_sheets": len(facts),  # about every task; the token counts above include them
        **({"drill": {**drill, "seconds": round(drill_seconds, 1)}} if drill else {}),
        "model": {
            "parameters": sum(p.numel() for p in model.parameters()),
            "final_loss": curve[-1]["loss"] if curve else None,
            "train_seconds": round(train_seconds, 1),
            "success": model_success,
            "eval_seconds": round(eval_seconds, 1),
            # success on eval_splits at eval_sampling after every curve_every epochs
            **({"learning_curve": learning_curve} if learning_curve else {}),
        },
        "scripted": scripted_baselines(params, b.eval_splits),
        "seconds": round(time.time() - t0, 1),
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    (out_dir / "loss.json").write_text(json.dumps(curve, indent=1) + "\n")
    return metrics
