"""forward: Hindsight Regenerations' learned forward models, fine-tuned on the logged dialogues.

HR fine-tunes an LLM to complete a dialogue from any prefix, both parties, and a second one only
on the bottom 25% of dialogues by reward (the "hard" users, less receptive; without it the
regenerations drift toward the average user). Here both are the base model fine-tuned by SFT:

- An example is a logged train dialogue cut after `k` turns (1 <= k < its turns; a prefix of
  none would leave the game unstarted, a prefix of all would leave nothing to write): the
  environment's forward-model request at that point (`env.forward_request`, the prompt an LLM
  forward model gets) answered by the rest of the logged dialogue in the format its parser reads
  (`env.forward_reply`: persuasion's "AI:" / "H:" lines with the "Decision:" line). So the same
  request and parser serve the trained model in regenerate as serve a hosted LLM. Loss on the
  reply only. `cuts_per_dialogue` prefixes per dialogue, drawn by seed (null: every one, HR's).
- A reply the request's parser does not read back as the logged turns (a turn the donor never
  heard has no line to write) is left out and counted, as is an example longer than the model's
  context: the model would learn what its role then refuses, or lose its reply.
- The hard model learns from the `hard_fraction` of the training dialogues with the lowest
  logged return (ties broken by a hash of the trajectory), from the same base weights.
- `dialogues` samples that many train dialogues (HR: 100 per dataset); null: every one.
- With no example left for a model, it is the base model, and metrics say why (as train keeps
  the base model for a method with no rows).
- Nothing is trained when no role serves the models (roles.forward.backend is not `learned`; the
  default, `policy`, is HOPE's regeneration): the logged dialogues are still read and checked,
  `models/` holds only NOT_TRAINED.txt saying why (no model directory a reader could load), and
  metrics.json says `trained: false` with the reason. Setting the backend to `learned` changes
  this stage's params, so DVC runs it again and it trains.

Fidelity. A `heldout_share` of the logged train dialogues (by a hash of seed and trajectory)
stays out of both training sets. Each is cut once (seeded) and completed by each model, served as
`roles.forward: {backend: learned}` serves it (an hf generator at the forward role's sampling and
parse_attempts). A completion is read by the environment's oracle labeler (`env.label` on the
completed turns). Against it: the oracle environment on the same prefix, the logged dialogue's
return (`logged`: the environment's donor answering the logging policy), and the oracle donor
answering the completion's own persuader lines (`replayed`: the same words, the environment's
replies; a completion whose lines run out before the oracle decides has no replayed reward and is
counted). For each: mean absolute difference and Pearson correlation, over the prefixes both
have a reward for. Completions that did not finish are counted, as regenerate drops them.
"""
from __future__ import annotations

import json
import math
import random
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

from envs.base import Environment
from storage.schema import from_table
from storage.validate import StageInputs
from tasks.params import Params
from tasks.regenerate import share_hash
from tasks.roles import REASON_CHARS, TOP_REASONS, account, call_requests, make_generator
from tasks.rollout import derive_seed, episode_from_prefix
from tasks.train.distributed import save
from tasks.train.sft import tokenize_chats, train_sft


def cuts(row: dict, n: int | None, seed: int) -> list[int]:
    """The prefix lengths k (1 <= k < turns) a logged dialogue is cut at: `n` drawn by seed, or all."""
    every = list(range(1, row["num_turns"]))
    if n is None or n >= len(every):
        return every
    return sorted(random.Random(derive_seed(seed, "forward-cuts", row["trajectory_id"])).sample(every, n))


def example(env: Environment, row: dict, k: int) -> tuple[list[dict] | None, str | None]:
    """The forward model's chat for `row` cut after k turns, answered by the logged rest, or
    None and why the request's parser does not read that rest back."""
    ep = episode_from_prefix(env, row, k, 0)
    request = env.forward_request(ep.game)
    try:
        reply = env.forward_reply(ep.game, row["turns"][k:])
        pairs = request.parse(reply)
    except ValueError as e:
        return None, str(e)
    if len(pairs) != row["num_turns"] - k:
        return None, f"the reply reads back as {len(pairs)} turns, not the logged {row['num_turns'] - k}"
    return [*request.messages, {"role": "assistant", "content": reply}], None


def hard_dialogues(rows: list[dict], fraction: float, seed: int) -> list[dict]:
    """The `fraction` of `rows` with the lowest logged return (HR's bottom 25%), at least one."""
    ranked = sorted(rows, key=lambda r: (r["return"], share_hash(seed, "forward-hard-tie", r["trajectory_id"])))
    return ranked[: max(1, round(fraction * len(rows)))] if rows else []


NOT_TRAINED = "NOT_TRAINED.txt"  # what models/ holds when no role serves the forward models


def skip_reason(params: Params) -> str | None:
    """Why the forward models are not trained (no role serves them), or None: they are."""
    backend = params.roles.forward.backend
    if backend == "learned":
        return None
    return f"roles.forward.backend is {backend}, not learned: no role serves the forward models, so none was trained"


def run_forward(params: Params, trajectories: Path, out_dir: Path) -> dict:
    """Writes out_dir/models/model and out_dir/models/hard_model (causal LM directories with their
    tokenizer), out_dir/loss.json, out_dir/metrics.json and out_dir/quarantine.parquet. When no
    role serves them (skip_reason), out_dir/models holds only NOT_TRAINED.txt, and metrics say so."""
    t0 = time.time()
    f, env = params.forward, params.env.environment()
    inputs = StageInputs()
    logged = [t for t in from_table(inputs.read(trajectories, "trajectories")) if t["split"] == "train" and t["source"] != "regeneration"]
    logged.sort(key=lambda t: t["trajectory_id"])
    models = out_dir / "models"
    if models.exists():
        shutil.rmtree(models)  # a rerun never leaves a model of an earlier run beside the note, or the note beside models
    if (why := skip_reason(params)) is not None:
        print(f"forward: {why}", flush=True)
        models.mkdir(parents=True)
        (models / NOT_TRAINED).write_text(f"{why}.\nSet roles.forward to {{backend: learned, model: data/forward/models/model, ...}} to train them.\n")
        (out_dir / "loss.json").write_text("[]\n")
        metrics = {"inputs": inputs.write(out_dir), "trained": False, "skipped": why, "dialogues": {"logged_train": len(logged)},
                   "seconds": round(time.time() - t0, 1)}
        (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
        return metrics
    if f.dialogues is not None and f.dialogues < len(logged):  # HR: 100 randomly sampled dialogues
        logged = sorted(logged, key=lambda t: share_hash(params.seed, "forward-sample", t["trajectory_id"]))[: f.dialogues]
    held = [t for t in logged if share_hash(params.seed, "forward-heldout", t["trajectory_id"]) < f.heldout_share]
    train = [t for t in logged if t not in held]
    hard = hard_dialogues(train, f.hard_fraction, params.seed)

    set_seed(params.seed)
    torch.use_deterministic_algorithms(True)
    tokenizer = AutoTokenizer.from_pretrained(f.base_model)
    context = AutoModelForCausalLM.from_pretrained(f.base_model).config.max_position_embeddings
    counts, refused = Counter(), Counter()
    encoded: dict[str, list[dict]] = {}
    for t in train:
        mine = []
        for k in cuts(t, f.cuts_per_dialogue, params.seed):
            chat, why = example(env, t, k)
            if chat is None:
                refused[why[:REASON_CHARS]] += 1
                continue
            tokens = tokenize_chats(tokenizer, [chat], sys.maxsize).examples[0]
            if len(tokens["input_ids"]) > context:
                counts["examples_too_long"] += 1
                continue
            mine.append(tokens)
        counts["dialogues_too_short"] += t["num_turns"] < 2
        encoded[t["trajectory_id"]] = mine
    sets = {"model": [e for t in train for e in encoded[t["trajectory_id"]]], "hard_model": [e for t in hard for e in encoded[t["trajectory_id"]]]}
    why_none = (
        f"{len(train)} train dialogues, {len(hard)} hard; {counts['examples_too_long']} examples longer than the model's "
        f"{context} positions, {sum(refused.values())} whose logged rest the forward parser refuses, "
        f"{counts['dialogues_too_short']} dialogues of one turn"
    )
    print(f"forward: {len(sets['model'])} examples from {len(train)} dialogues, {len(sets['hard_model'])} from the {len(hard)} hardest; "
          f"{len(held)} dialogues held out", flush=True)

    kwargs = {k: getattr(f, k) for k in ("batch_size", "warmup_ratio", "weight_decay", "bf16", "max_loss_ratio")}
    curve: list[dict] = []
    trained = {}
    for name, epochs in (("model", f.epochs), ("hard_model", f.hard_epochs)):
        set_seed(params.seed)
        model = AutoModelForCausalLM.from_pretrained(f.base_model, dtype=torch.float32)  # both from the same base weights
        models.mkdir(parents=True, exist_ok=True)
        if not sets[name]:  # as train does for a method with no rows: the base model, and the reason
            print(f"forward: no example for the {name} ({why_none}); it is the base model", flush=True)
            save(model, tokenizer, models / name, True)
            trained[name] = {"examples": 0, "skipped": f"no example ({why_none}): the base model"}
            continue
        print(f"forward: {name}, {epochs:g} epochs at lr {f.learning_rate:g} on {len(sets[name])} examples", flush=True)
        points = train_sft(model, tokenizer, sets[name], epochs=epochs, learning_rate=f.learning_rate, seed=params.seed, **kwargs)
        curve.extend({"model": name, "step": p["step"], "loss": p["loss"]} for p in points)
        save(model, tokenizer, models / name, True)
        trained[name] = {"examples": len(sets[name]), "epochs": epochs, "final_loss": points[-1]["loss"] if points else None}
        del model
    (out_dir / "loss.json").write_text(json.dumps(curve) + "\n")

    returns = [t["return"] for t in hard]
    metrics = {
        "inputs": inputs.write(out_dir),
        "base_model": f.base_model,
        "dialogues": {"logged_train": len(logged), "train": len(train), "heldout": len(held), "hard": len(hard),
                      "hard_return_cutoff": max(returns) if returns else None},
        "examples_refused": sum(refused.values()),
        **({"refused_reasons": [[n, why] for why, n in refused.most_common(TOP_REASONS)]} if refused else {}),
        **{k: counts[k] for k in ("examples_too_long", "dialogues_too_short")},
        "trained": True,
        "models": trained,
        "fidelity": {name: fidelity(params, env, held, models / name) for name in ("model", "hard_model")},
        "seconds": round(time.time() - t0, 1),
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics


def _agreement(pairs: list[tuple[float, float]]) -> dict:
    """Mean absolute difference and Pearson correlation of (model, reference) rewards."""
    if not pairs:
        return {"prefixes": 0}
    a, b = [p[0] for p in pairs], [p[1] for p in pairs]
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    sa, sb = math.sqrt(sum((x - ma) ** 2 for x in a)), math.sqrt(sum((y - mb) ** 2 for y in b))
    cov = sum((x - ma) * (y - mb) for x, y in pairs)
    return {
        "prefixes": len(pairs),
        "mean_abs_diff": round(sum(abs(x - y) for x, y in pairs) / len(pairs), 4),
        "pearson": round(cov / (sa * sb), 4) if sa > 0 and sb > 0 else None,  # undefined when either side is constant
        "mean_model": round(ma, 4),
        "mean_reference": round(mb, 4),
    }


def fidelity(params: Params, env: Environment, held: list[dict], model_dir: Path) -> dict:
    """The forward model at `model_dir` on one seeded prefix of every held-out dialogue: its
    completions' rewards (the oracle labeler reading them) against the logged return from the same
    prefix and against the oracle donor answering the completion's own persuader lines."""
    held = [t for t in held if t["num_turns"] >= 2]
    if not held:
        return {"prefixes": 0}
    print(f"forward: fidelity of {model_dir.name} on {len(held)} held-out prefixes", flush=True)
    role = params.roles.forward.model_copy(update={"backend": "hf", "model": str(model_dir)})
    gen = make_generator(role, None)  # uncached: a new model is measured, not a stored answer
    cut_at = [cuts(t, 1, derive_seed(params.seed, "forward-fidelity"))[0] for t in held]
    episodes = [episode_from_prefix(env, t, k, 0) for t, k in zip(held, cut_at)]
    outcomes = call_requests(gen, [env.forward_request(ep.game) for ep in episodes],
                             [derive_seed(role.seed, "forward-fidelity", t["trajectory_id"]) for t in held], role)
    logged, replayed, counts = [], [], Counter()
    for t, k, ep, o in zip(held, cut_at, episodes, outcomes):
        if o.status != "ok":
            continue
        for text, answer in o.value:
            ep.apply(text, answer)
        label = env.label(t["task_id"], ep.turns)
        if label.reward is None:
            counts["unlabelled"] += 1
            continue
        logged.append((label.reward, t["return"]))
        oracle = episode_from_prefix(env, t, k, 0)  # the same persuader lines, the environment's replies
        for text, _ in o.value:
            if oracle.done:
                break
            oracle.apply(text)
        if oracle.done:
            replayed.append((label.reward, sum(x["reward"] for x in oracle.turns)))
        else:
            counts["replay_unfinished"] += 1
    calls = account(outcomes, gen)
    return {
        "prefixes": len(held),
        "completed": calls["ok"],
        "unfinished": calls.get("unfinished", 0),
        "finish_rate": round(calls["ok"] / len(held), 4),
        "unlabelled": counts["unlabelled"],
        "logged": _agreement(logged),
        "replayed": {**_agreement(replayed), "unfinished": counts["replay_unfinished"]},
        "calls": calls,
    }
