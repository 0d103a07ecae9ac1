"""practice: StepAgent's inspection and practice (Eq. 4-5), with no environment step.

Inspection (Eq. 4): each successful expert trajectory of n actions is cut into its n prefixes, one
per expert action: the state s_i, every message before the expert's i-th action (the system
prompt, each observation and the expert's own earlier actions), and that action a_i. Algorithm 1
practises "each sampled" prefix and says no more: `practice.prefixes` of them are drawn by seed
from all (null: every one, Eq. 4's T_sample whole), so a small run still sees many tasks.

Practice (Eq. 5): the current policy (`practice.model`, pi_theta_i) samples `practice.k` actions at
each drawn state (the practice number; StepAgent's best is 3), all prefixes batched through the
policy role's backend, at `practice.sampling`. StepAgent decodes greedily, which would make the k
samples one and the same text, so practice samples (T = 1.0 by default: the policy's own
distribution). The action is never played: no observation, no reward, so no environment step.

One row per (prefix, sample) in out_dir/pairs.parquet: the state, the expert's action, the
agent's (as the chat would record it: Game.message, which in CarDealer's API phase is a tool
call), both parsed by the environment, whether they are `equal` (`practice.equal`: the same move
by the environment's own normalisation, Environment.same_action, or identical text) and
`identical`. Equal pairs stay in the table, flagged and counted; the stepagent stage leaves them
out of its loss. A sample the backend gave up on stays too, status failed, its action recorded as
`(empty reply)` as a rollout records one, and counted.

`expert_logp` and `agent_logp` are log pi_theta_i(a | s) at temperature 1, summed over the action's
tokens as the chat template encodes them (tasks/train/online_dpo.encode, DPO's own mask): one
forward pass per sequence in this process, a small share of the sampling's cost. At T = 1 and
top_p = 1 `agent_logp` is the behaviour log-probability PPO's ratio needs (StepAgent-Inverse); at
another sampling it is the untempered policy's.

An expert trajectory that failed is not practised: it is counted (and kept in the expert table).
One the table does not trust is quarantined with its reason: of another environment than env.name,
or (where the expert's action is a tool call, which only the game at that state can write for the
agent's text) one whose game cannot be restored at the prefix. Draws and samples are seeded from
the run's seed, so a rerun writes the same bytes.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs.base import EMPTY_REPLY, Environment, recorded_reply
from models.base import SamplingParams
from storage.parquet import write_table
from storage.schema import from_table, stored_message, to_table
from storage.validate import RAW_CHARS, StageInputs
from tasks.params import Params
from tasks.roles import generation_stats, policy_generator
from tasks.rollout import action_starts, derive_seed, episode_from_prefix
from tasks.train import online_dpo
from tasks.train.sft import MaskError


def prefixes(trajectory: dict) -> list[dict]:
    """Eq. 4: a trajectory of n actions as its n prefixes, in order: the state (every message
    before action i) and the expert's action i; `step` is i, 0-based."""
    messages = trajectory["messages"]
    return [
        {"trajectory_id": trajectory["trajectory_id"], "task_id": trajectory["task_id"], "split": trajectory["split"],
         "step": i, "prompt": messages[:at], "expert": messages[at]}
        for i, at in enumerate(action_starts(messages))
    ]


def drawn(candidates: list[dict], n: int | None, seed: int) -> list[dict]:
    """`n` prefixes drawn by seed (all of them for None), in the table's order. A prefix's draw
    depends on its own key alone, so a larger n keeps a smaller one's prefixes."""
    if n is not None and n < len(candidates):
        keep = {id(p) for p in sorted(candidates, key=lambda p: derive_seed(seed, "practice-prefix", p["trajectory_id"], p["step"]))[:n]}
        candidates = [p for p in candidates if id(p) in keep]
    return candidates


def parsed(env: Environment, text: str) -> str | None:
    """The move alone, as the environment parses it; None where the text does not parse."""
    try:
        return env.parse_action(text)[1]
    except ValueError:
        return None


def compare(env: Environment, expert: str, agent: str, by: str) -> tuple[bool, bool, str | None, str | None]:
    """(equal, identical, expert's move, agent's move). equal by `action`: the identical text, or
    two parsed moves the environment calls the same (same_action); by `text`: the identical text."""
    identical = expert == agent
    moves = parsed(env, expert), parsed(env, agent)
    same = by == "action" and None not in moves and env.same_action(*moves)
    return identical or same, identical, *moves


def pair_id(trajectory_id: str, step: int, sample: int) -> str:
    return hashlib.sha256(f"{trajectory_id}:{step}:{sample}".encode()).hexdigest()[:16]


def _usable(params: Params, inputs: StageInputs, path: Path) -> tuple[list[dict], dict[str, int], dict]:
    """The expert trajectories to practise on, each one's row in the file, and the counts of those
    left out. A failed one is skipped; one of another environment is quarantined (rows in = kept
    + quarantined)."""
    table = inputs.read(path, "trajectories")
    rows, numbers = from_table(table), inputs.file_rows(path, table)
    env_name = params.env.name
    counts = {"in": inputs.counts[str(path)]["rows_in"], "used": 0, "skipped_failed": 0, "success_unknown": 0, "quarantined": inputs.counts[str(path)]["quarantined"]}
    bad, used = [], []
    for row, number in zip(rows, numbers):
        if row["env"] != env_name:
            bad.append(_quarantine_row(path, number, row, "env", f"{row['env']!r}, but the run's environment is {env_name!r}: its actions are compared by that environment's rules"))
        elif row["success"] is False:
            counts["skipped_failed"] += 1
        else:
            counts["success_unknown"] += row["success"] is None  # an import that does not say: taken as the expert's
            used.append(row)
    _add(inputs, path, bad, counts)
    counts["used"] = len(used)
    return used, {r["trajectory_id"]: n for r, n in zip(rows, numbers)}, counts


def _quarantine_row(path: Path, number: int, row: dict, field: str, reason: str) -> dict:
    raw = json.dumps({k: row[k] for k in ("trajectory_id", "env", "task_id", "split", "num_turns")}, ensure_ascii=False)
    return {"source_file": str(path), "row": number, "field": field, "reason": reason, "raw": raw[:RAW_CHARS]}


def _add(inputs: StageInputs, path: Path, bad: list[dict], counts: dict) -> None:
    if bad:
        inputs.add(str(path), to_table(bad, "quarantine"))
        counts["quarantined"] += len(bad)


def _games(env: Environment, chosen: list[dict], by_id: dict[str, dict], numbers: dict[str, int], path: Path, seed: int) -> tuple[dict, dict[str, dict]]:
    """The restored game at each chosen prefix whose expert action is a tool call (only the game
    there writes the agent's text as the chat records it), by (trajectory, step); and by
    trajectory id, the quarantine rows of those whose game cannot be restored. Other prefixes
    need no game, and get none: restoring one may cost a simulator's replay."""
    games, bad = {}, {}
    for p in chosen:
        tid = p["trajectory_id"]
        if not p["expert"].get("tool_calls") or tid in bad:
            continue
        try:
            games[tid, p["step"]] = episode_from_prefix(env, by_id[tid], p["step"], derive_seed(seed, "practice-game", tid)).game
        except (KeyError, ValueError, NotImplementedError) as e:
            bad[tid] = _quarantine_row(path, numbers[tid], by_id[tid], "task_id", f"its game cannot be restored at step {p['step']} to write the agent's tool call: {e}")
    return games, bad


def _generate(generator, prompts: list[list[dict]], seeds: list[int], sampling: SamplingParams, chunk: int) -> list:
    """Every prompt's completion, `chunk` at a time under a progress bar counting them."""
    out = []
    with Progress(TextColumn("[bold]practice[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as progress:
        bar = progress.add_task("practice", total=len(prompts))
        for i in range(0, len(prompts), chunk):
            out += generator.generate(prompts[i : i + chunk], sampling, seeds[i : i + chunk])
            progress.update(bar, completed=len(out))
    return out


@torch.no_grad()
def log_probs(model_dir: str, pairs: list[tuple[list[dict], dict]]) -> list[float | None]:
    """log pi(action | state) of the model at model_dir for each (state, action message), summed
    over the action's tokens as DPO encodes them; None for an action longer than the context."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    context = model.config.max_position_embeddings
    encoded: list[dict | None] = []
    for state, action in pairs:
        try:
            encoded.append(online_dpo.encode(tokenizer, state, action, context)[0])
        except MaskError:
            encoded.append(None)
    # Shortest first: batches of like lengths pad little (states run from a turn to a whole game).
    order = sorted((i for i, e in enumerate(encoded) if e is not None), key=lambda i: (len(encoded[i]["input_ids"]), i))
    out: list[float | None] = [None] * len(encoded)
    for i, logp in zip(order, online_dpo.reference_logps(model, tokenizer, [encoded[i] for i in order]), strict=True):
        out[i] = logp
    return out


def run_practice(params: Params, expert: Path, out_dir: Path) -> dict:
    """Writes out_dir/pairs.parquet, out_dir/quarantine.parquet and out_dir/metrics.json."""
    if params.roles.policy.backend == "openai":
        raise ValueError("practice: the log-probabilities (and the stepagent stage after it) need the policy's weights, which an openai "
                         "endpoint does not serve: set roles.policy.backend to hf or vllm")
    t0 = time.time()
    p, env = params.practice, params.env.environment()
    inputs = StageInputs()
    trajectories, numbers, counts = _usable(params, inputs, expert)
    by_id = {t["trajectory_id"]: t for t in trajectories}
    every = [x for t in trajectories for x in prefixes(t)]
    chosen = drawn(every, p.prefixes, params.seed)
    games, bad = _games(env, chosen, by_id, numbers, expert, params.seed)
    _add(inputs, expert, list(bad.values()), counts)
    counts["used"] -= len(bad)
    chosen = [x for x in chosen if x["trajectory_id"] not in bad]
    if not chosen:
        raise ValueError(f"{expert}: no prefix to practise on ({counts['in']} expert trajectories: {counts['skipped_failed']} failed, {counts['quarantined']} quarantined)")
    if counts["skipped_failed"]:
        print(f"practice: {counts['skipped_failed']} of {counts['in']} expert trajectories failed and are skipped", flush=True)
    generator = policy_generator(params, p.model, p.batch_size)
    sampling = SamplingParams(**p.sampling.model_dump())
    prompts = [x["prompt"] for x in chosen for _ in range(p.k)]
    seeds = [derive_seed(params.seed, "practice", x["trajectory_id"], x["step"], j) for x in chosen for j in range(p.k)]
    print(f"practice: {len(chosen)} of {len(every)} prefixes (expert trajectories: {counts['used']}), {p.k} samples each", flush=True)
    t_gen = time.time()
    completions = _generate(generator, prompts, seeds, sampling, p.batch_size)
    t_gen = time.time() - t_gen
    rows = []
    for n, (x, c) in enumerate(zip((x for x in chosen for _ in range(p.k)), completions, strict=True)):
        j, expert_text = n % p.k, x["expert"]["content"]
        row = {
            "pair_id": pair_id(x["trajectory_id"], x["step"], j), "trajectory_id": x["trajectory_id"], "task_id": x["task_id"],
            "split": x["split"], "step": x["step"], "sample": j, "prompt": [stored_message(m) for m in x["prompt"]],
            "expert": stored_message(x["expert"]), "policy_id": generator.model_id, "seed": seeds[n],
        }
        if not c.ok:  # the backend gave up on this sample: kept as an empty reply (as a rollout records it), flagged, out of the loss
            rows.append({**row, "agent": {"role": "assistant", "content": EMPTY_REPLY}, "expert_action": parsed(env, expert_text),
                         "agent_action": None, "equal": False, "identical": False, "status": "failed", "reason": c.error})
            continue
        text = recorded_reply(c.text)
        game = games.get((x["trajectory_id"], x["step"]))
        equal, identical, expert_action, agent_action = compare(env, expert_text, text, p.equal)
        rows.append({**row, "agent": stored_message(game.message(text) if game else {"role": "assistant", "content": text}),
                     "expert_action": expert_action, "agent_action": agent_action, "equal": equal, "identical": identical,
                     "status": "ok", "reason": None})
    # Log-probabilities under the practising policy: the expert's once per prefix, and each
    # sample's but those identical to the expert's text (the same tokens: the expert's value).
    t_logp = time.time()
    states = {(x["trajectory_id"], x["step"]): x for x in chosen}
    own = [r for r in rows if r["status"] == "ok" and not r["identical"]]
    logps = log_probs(p.model, [(x["prompt"], x["expert"]) for x in states.values()] + [(states[r["trajectory_id"], r["step"]]["prompt"], r["agent"]) for r in own])
    expert_logp = dict(zip(states, logps[: len(states)]))
    for r, logp in zip(own, logps[len(states) :], strict=True):
        r["agent_logp"] = logp
    for r in rows:
        r["expert_logp"] = expert_logp[r["trajectory_id"], r["step"]]
        r.setdefault("agent_logp", r["expert_logp"] if r["identical"] else None)  # a failed sample has none
    t_logp = time.time() - t_logp
    write_table(to_table(rows, "practice"), out_dir / "pairs.parquet", "practice")
    ok = [r for r in rows if r["status"] == "ok"]
    equal = sum(r["equal"] for r in ok)
    metrics = {
        "inputs": inputs.write(out_dir),
        "model": p.model,
        "policy_id": generator.model_id,
        "expert_trajectories": counts,
        "prefixes": {"all": len(every), "drawn": len(chosen)},  # Eq. 4's, and the ones practised
        "k": p.k,
        "samples": len(rows),
        "failed": len(rows) - len(ok),
        "equal": equal,  # flagged, left out of the loss
        "identical": sum(r["identical"] for r in ok),
        "equal_share": round(equal / len(ok), 4) if ok else None,  # falls as the policy nears the expert (StepAgent 7.4)
        "pairs": len(ok) - equal,  # what the loss can learn from
        "logp_missing": sum(r["agent_logp"] is None for r in ok) + sum(v is None for v in expert_logp.values()),
        "sampling": p.sampling.model_dump(),
        **generation_stats(generator),
        "generation_seconds": round(t_gen, 1),
        "logp_seconds": round(t_logp, 1),
        "seconds": round(time.time() - t0, 1),
    }
    print(f"practice: {len(rows)} samples, {equal} equal to the expert's action ({metrics['equal_share']}), {metrics['failed']} failed", flush=True)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics
