"""actor: HOPE's online DPO (Eq. 2; the update in tasks/train/online_dpo.py).

The actor starts from the base policy's weights (HOPE: pi_0), which also stay frozen as DPO's
reference. Its prompts are the states of the buffer's selected pairs, each state once, drawn in
a seeded order; `prompts` of them are cut into `rounds`, and every round is online:

1. the actor as it stands plays each state twice through the policy role's backend (hf or vLLM;
   the weights are written out and served afresh each round), at `sampling` (HOPE: 0.7). With
   probability `explore_prob` (HOPE's beta: 0 in its main runs, 0.5 in the ablation) a state's
   two candidates come from the hindsight proposer instead, given the summary of the trajectory
   the state came from (HOPE's code: both candidates, one draw per state); a state without a
   summary, or where the proposer gives fewer than two distinct actions, is played by the
   policy, and counted;
2. the critic scores both (the same Q(s, a) best-of-N uses): the higher is chosen, the lower
   rejected. A pair whose two actions are the same text, or score the same, teaches nothing
   and is counted, not trained on;
3. one pass of sigmoid DPO over the round's pairs against the reference (kl_beta; HOPE 0.03).

With select: val the actor after every round plays the val games (evaluate's sampling) and the
round with the highest success is the stage's model (HOPE's choice of checkpoint); with last, the
actor after the last round.

Every pair trained on is in out_dir/preferences.parquet (the state, chosen and rejected with
their critic scores, the round, who made them), each round's counts (states, explored, ties,
pairs, the critic's mean score of chosen and rejected) in metrics.json, its DPO loss, implicit-reward margin and accuracy in loss.json, and
the actor after the last round is out_dir/model. A failed generation leaves its state out of the
round, counted. With a critic the critic stage left untrained (no pair to train on: its
UNTRAINED.txt), every candidate would tie, so no round runs: the actor is the base model, and
metrics.json says why.

With nproc_per_node > 1 the stage runs on that many ranks under torchrun (tasks/train/distributed.py),
as train and critic do: rank 0 alone generates, asks the critic and the reference, and sends the
round's pairs to every rank; every rank then runs the round's DPO update under DeepSpeed
(`deepspeed`, ZeRO-3 by default), each taking its share of every global batch of
nproc_per_node x batch_size pairs; the updated model is gathered, and rank 0 serves it to the
next round's generation and writes every output.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

from models.base import SamplingParams
from storage.parquet import write_table
from storage.schema import from_table, stored_message, to_table
from storage.validate import StageInputs
from tasks.buffer import LOGGED_SOURCES, digest
from tasks.params import Params
from tasks.roles import account, call_requests, make_generator, policy_generator
from tasks.rollout import Episode, LMAgent, derive_seed, episode_from_prefix, new_episode, play
from tasks.simulator import make_simulator
from tasks.train import critic as critic_model
from tasks.train import online_dpo
from tasks.train.distributed import deepspeed_config, from_rank0, launch, partition, rank, save, world_size
from tasks.train.sft import MaskError

def state_key(prompt: list[dict]) -> str:
    return digest(prompt)


def states(pairs: list[dict], trajectories: dict[str, dict], summaries: dict[str, str], seed: int, size: int) -> tuple[list[dict], int]:
    """The selected pairs' distinct states in a seeded order, the first `size`: each with the
    trajectory it is read from (a logged one with a summary first, else the first by id) and the
    turn. Returns the states and how many were found in no trajectory table."""
    found: dict[str, dict] = {}
    missing = 0
    for p in pairs:
        key = state_key([stored_message(m) for m in p["prompt"]])
        if key in found:
            continue
        known = sorted(t for t in p["trajectory_ids"] if t in trajectories)
        if not known:
            missing += 1
            continue
        logged = [t for t in known if trajectories[t]["source"] in LOGGED_SOURCES and t in summaries]
        found[key] = {"key": key, "trajectory_id": (logged or known)[0], "turn": p["turn"]}
    order = sorted(found.values(), key=lambda s: derive_seed(seed, "actor-state", s["key"]))
    return order[:size], missing


def val_success(params: Params, model_dir: Path, label: str) -> float:
    """The policy at `model_dir` on the val games, one episode each at evaluate's sampling."""
    env = params.env.environment()
    episodes = [new_episode(env, task, derive_seed(params.seed, "actor-select", task.id)) for task in env.tasks("val")[: params.limit_tasks]]
    generator = policy_generator(params, model_dir, params.evaluate.batch_size)
    play(episodes, LMAgent(generator, SamplingParams(**params.evaluate.sampling.model_dump())), derive_seed(params.seed, "actor-select"), label, make_simulator(params))
    return round(sum(e.game.success for e in episodes) / len(episodes), 4)


def _model_dir(model, tokenizer, folder: Path) -> Path:
    save(model, tokenizer, folder, main=True)  # rank 0 alone, on a model no rank has partitioned (see _unpartitioned)
    return folder


def _unpartitioned(model, tokenizer, folder: Path, main: bool):
    """After an update on ranks: the whole model, gathered from every rank (ZeRO-3), written to
    `folder` and loaded back as a plain model on every rank, so rank 0 can serve it to the policy
    backend alone and the next round hands DeepSpeed a fresh model. The optimizer starts afresh
    every round in one process too, so the rounds are the same updates."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    save(model, tokenizer, folder, main)
    torch.distributed.barrier()
    unset_hf_deepspeed_config()  # else from_pretrained would partition the model again, across ranks
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.distributed.barrier()  # every rank has read it before rank 0 may remove it
    return model


def _round_pairs(params: Params, chunk: list[dict], i: int, trajs: dict, summary_of: dict, model, tokenizer, score, proposer, tmp: str) -> dict:
    """Rank 0's part of round i: the candidates at each state of `chunk` (the actor as it stands,
    or the hindsight proposer), ranked by the critic into encoded (chosen, rejected) pairs, with
    the preferences rows, the counts and the proposer's calls."""
    a, env = params.actor, params.env.environment()
    context = model.config.max_position_embeddings
    sampling = SamplingParams(**a.sampling.model_dump())
    proposer_role = params.roles.proposer
    calls = []
    episodes = [episode_from_prefix(env, trajs[s["trajectory_id"]], s["turn"], derive_seed(params.seed, "actor", s["key"])) for s in chunk]
    explore = [
        a.explore_prob > 0 and s["trajectory_id"] in summary_of and random.Random(derive_seed(params.seed, "actor-explore", s["key"])).random() < a.explore_prob
        for s in chunk
    ]
    texts: list[list[str] | None] = [None] * len(chunk)
    source = ["policy"] * len(chunk)
    counts = {"states": len(chunk), "explored": 0, "explore_fell_back": 0, "generation_failed": 0, "ties": 0}
    # Exploring states: two distinct actions from the hindsight proposer, given the summary.
    asked = [j for j, e in enumerate(explore) if e]
    if asked and proposer is None:  # the oracle, which reads the secret from the environment
        for j in asked:
            ep = episodes[j]
            texts[j] = [p.text for p in env.propose(ep.task, ep.turns, a.candidates)]
    elif asked:
        requests = [env.proposer_request(episodes[j].task, episodes[j].turns, a.candidates, summary_of[chunk[j]["trajectory_id"]]) for j in asked]
        outcomes = call_requests(proposer, requests, [derive_seed(proposer_role.seed, "actor", chunk[j]["key"]) for j in asked], proposer_role)
        calls += outcomes
        for j, o in zip(asked, outcomes):
            texts[j] = [p.text for p in o.value] if o.status == "ok" else []
    for j in asked:
        distinct = list(dict.fromkeys(texts[j]))[: a.candidates]
        if len(distinct) < 2:
            texts[j] = None
            counts["explore_fell_back"] += 1
        else:
            texts[j], source[j], counts["explored"] = distinct, "proposer", counts["explored"] + 1
    # Every other state: the actor as it stands, through the policy role's backend.
    play = [j for j, t in enumerate(texts) if t is None]
    if play:
        generator = policy_generator(params, _model_dir(model, tokenizer, Path(tmp) / f"round-{i}"), params.collect.batch_size)
        prompts = [episodes[j].messages for j in play for _ in range(a.candidates)]
        seeds = [derive_seed(params.seed, "actor", chunk[j]["key"], c) for j in play for c in range(a.candidates)]
        completions = generator.generate(prompts, sampling, seeds)
        for n, j in enumerate(play):
            got = completions[n * a.candidates : (n + 1) * a.candidates]
            texts[j] = [c.text for c in got if c.ok]
            if len(texts[j]) < 2:
                counts["generation_failed"] += 1
                texts[j] = []
    # The critic ranks each state's candidates in one call.
    scoring = [(j, t) for j, ts in enumerate(texts) for t in ts]
    scores = score([(episodes[j].messages, episodes[j].game.message(t)) for j, t in scoring]) if scoring else []
    by_state: dict[int, list[tuple[float, str]]] = {}
    for (j, t), q in zip(scoring, scores):
        by_state.setdefault(j, []).append((q, t))
    examples, table, q_chosen, q_rejected = [], [], [], []
    cut = 0
    for j, ranked in sorted(by_state.items()):
        best = max(ranked, key=lambda x: x[0])
        worst = min(ranked, key=lambda x: x[0])
        if best[1] == worst[1] or best[0] == worst[0]:
            counts["ties"] += 1
            continue
        ep: Episode = episodes[j]
        try:
            enc_c, cut_c = online_dpo.encode(tokenizer, ep.messages, ep.game.message(best[1]), context)
            enc_r, cut_r = online_dpo.encode(tokenizer, ep.messages, ep.game.message(worst[1]), context)
        except MaskError as e:
            raise MaskError(f"actor: state of trajectory {chunk[j]['trajectory_id']} turn {chunk[j]['turn']}: {e}") from None
        cut += cut_c or cut_r
        examples.append((enc_c, enc_r))
        table.append({
            "key": chunk[j]["key"], "round": i, "trajectory_id": chunk[j]["trajectory_id"], "turn": chunk[j]["turn"],
            "prompt": [stored_message(m) for m in ep.messages], "chosen": stored_message(ep.game.message(best[1])),
            "rejected": stored_message(ep.game.message(worst[1])), "chosen_score": best[0], "rejected_score": worst[0],
            "source": source[j],
        })
        q_chosen.append(best[0])
        q_rejected.append(worst[0])
    return {"examples": examples, "table": table, "counts": counts, "q_chosen": q_chosen, "q_rejected": q_rejected, "cut": cut, "calls": calls}


def run_actor(params: Params, pairs: Path, trajectory_files: list[Path], summaries: Path, out_dir: Path) -> dict:
    """Writes out_dir/model, out_dir/loss.json and out_dir/metrics.json. With
    actor.nproc_per_node > 1, relaunches itself on that many ranks (tasks/train/distributed.py): rank 0
    makes each round's pairs (generation, the critic, the reference's log-probabilities) and
    writes everything; every rank runs the round's DPO update under DeepSpeed."""
    if params.roles.policy.backend == "openai":
        raise ValueError("actor: the candidates come from the actor's own weights, which an openai endpoint does not serve: set roles.policy.backend to hf or vllm")
    t0 = time.time()
    a = params.actor
    if a.nproc_per_node > 1 and not torch.distributed.is_torchelastic_launched():
        return launch(params, pairs, out_dir, None, a.nproc_per_node, stage="actor", inputs={"trajectories": list(trajectory_files), "summaries": summaries})
    main, ranks = rank() == 0, world_size()
    if ranks > 1 and not torch.distributed.is_initialized():
        import deepspeed

        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # The other ranks wait while rank 0 generates and scores a round: allow it hours, not the default 30 minutes.
        deepspeed.init_distributed(timeout=datetime.timedelta(hours=6))
    inputs = StageInputs()
    selected = [r for r in inputs.read(pairs, "pairs").to_pylist() if r["selected"]]
    trajs = {t["trajectory_id"]: t for path in trajectory_files for t in from_table(inputs.read(path, "trajectories"))}
    summary_of = {s["trajectory_id"]: s["summary"] for s in inputs.read(summaries, "summaries").to_pylist() if s["status"] == "ok"}
    chosen_states, missing = states(selected, trajs, summary_of, params.seed, a.prompts)
    # An untrained critic scores every candidate alike: each round would generate ties only.
    critic_untrained = critic_model.untrained(a.critic)
    if not chosen_states and not critic_untrained:
        raise ValueError(f"{pairs}: no selected pair's state to train the actor on ({len(selected)} selected, {missing} from trajectories not in {', '.join(map(str, trajectory_files))})")
    set_seed(params.seed)
    torch.use_deterministic_algorithms(True)
    model = AutoModelForCausalLM.from_pretrained(a.base_model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(a.base_model)
    # Only rank 0 generates, scores and computes the reference's log-probabilities.
    plays = main and not critic_untrained
    reference = AutoModelForCausalLM.from_pretrained(a.base_model, dtype=torch.float32) if plays else None
    score = critic_model.scorer(a.critic) if plays else None
    proposer_role = params.roles.proposer
    proposer = make_generator(proposer_role, params.cache.path) if plays and a.explore_prob > 0 and proposer_role.backend != "oracle" else None
    kwargs = {k: getattr(a, k) for k in ("epochs", "batch_size", "learning_rate", "warmup_ratio", "weight_decay", "bf16", "padding_free")}
    zero = deepspeed_config(a.deepspeed)
    rounds, curve, all_calls, table, kept = [], [], [], [], []
    shares = None  # the parameter elements each rank holds (ZeRO-3)
    if plays:
        print(f"actor: {len(chosen_states)} states in {a.rounds} rounds" + (f" on {ranks} ranks" if ranks > 1 else ""), flush=True)
    with tempfile.TemporaryDirectory(prefix="retrosight-actor-") if main else contextlib.nullcontext() as tmp:
        if ranks > 1:
            tmp = from_rank0(tmp)  # one folder for the gathered weights, on this node
        for i in range(0 if critic_untrained else a.rounds):
            chunk = chosen_states[i :: a.rounds]
            if not chunk:
                continue
            r0 = time.time()
            made = _round_pairs(params, chunk, i, trajs, summary_of, model, tokenizer, score, proposer, tmp) if main else None
            rows = online_dpo.pair_rows(reference, tokenizer, made["examples"]) if main and made["examples"] else []
            if ranks > 1:
                rows = from_rank0(rows)
            points = []
            if rows:
                points = online_dpo.fit(
                    model, tokenizer, rows, seed=derive_seed(params.seed, "actor-round", i), beta=a.kl_beta,
                    max_loss_ratio=a.max_loss_ratio, deepspeed=zero, **kwargs,
                )
                if ranks > 1:
                    shares = partition(model)
                    model = _unpartitioned(model, tokenizer, Path(tmp) / f"trained-{i}", main)
            if not main:
                continue
            counts, all_calls, table = made["counts"], all_calls + made["calls"], table + made["table"]
            q_chosen, q_rejected = made["q_chosen"], made["q_rejected"]
            step0 = curve[-1]["step"] if curve else 0
            curve += [{"round": i, "step": step0 + e["step"], **{k: e[k] for k in ("loss", "margin", "accuracy") if k in e}} for e in points]
            rounds.append({
                **counts, "pairs": len(rows), "pairs_cut_to_context": made["cut"],
                "critic_chosen_mean": round(sum(q_chosen) / len(q_chosen), 4) if q_chosen else None,
                "critic_rejected_mean": round(sum(q_rejected) / len(q_rejected), 4) if q_rejected else None,
                "seconds": round(time.time() - r0, 1),
            })
            print(f"actor: round {i + 1}/{a.rounds}: {len(rows)} pairs, {counts['ties']} ties, {counts['explored']} explored ({rounds[-1]['seconds']} s)", flush=True)
            if a.select == "val":
                kept.append(_model_dir(model, tokenizer, Path(tmp) / f"after-round-{i}"))
                rounds[-1]["val_success"] = val_success(params, kept[-1], f"actor after round {i + 1}: val")
        if not main:
            return {}
        chosen = None
        if kept:  # HOPE: the checkpoint with the highest val success; ties go to the later round
            chosen = max(range(len(kept)), key=lambda j: (rounds[j]["val_success"], j))
            shutil.rmtree(out_dir / "model", ignore_errors=True)
            shutil.copytree(kept[chosen], out_dir / "model")
    untrained = None
    if critic_untrained:
        untrained = f"the critic at {a.critic} was not trained ({critic_untrained}), so it ranks no candidate; the actor is the base model"
        print(f"actor: {untrained}", flush=True)
    elif not any(r["pairs"] for r in rounds):
        # As train does for a method left without rows: the base is kept, and the metrics say why.
        untrained = f"no pair to train on in {len(rounds)} rounds over {len(chosen_states)} states: every state's candidates tied or failed; the actor is the base model"
        print(f"actor: {untrained}", flush=True)
    if chosen is None:
        _model_dir(model, tokenizer, out_dir / "model")
    write_table(to_table(table, "preferences"), out_dir / "preferences.parquet", "preferences")
    (out_dir / "loss.json").write_text(json.dumps(curve) + "\n")
    metrics = {
        "inputs": inputs.write(out_dir),
        "base_model": a.base_model,
        "critic": a.critic,
        "states": len(chosen_states),
        "states_without_trajectory": missing,
        "rounds": rounds,
        "pairs": sum(r["pairs"] for r in rounds),
        **({"untrained": untrained} if untrained else {}),
        **({"chosen_round": chosen} if chosen is not None else {}),
        **({"world_size": ranks, "partition": shares} if ranks > 1 else {}),
        "final_loss": curve[-1]["loss"] if curve else None,
        "seconds": round(time.time() - t0, 1),
    }
    if all_calls:
        metrics["proposer_calls"] = account(all_calls, proposer)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics
