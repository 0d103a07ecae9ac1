"""nlac_iteration: one iteration of NLAC's Algorithm 1 (notes/nlac.md; the loss in tasks/train/nlac.py).

1. Collect (lines 3-6): the iteration's policy (nlac_iterations.K.policy: the base at 1, iteration
   K-1's after) plays `nlac.m` episodes of every task of `nlac.splits` (grpo: `nlac.group`), with
   collect's own code, into data/iterationK/nlac_collect.
2. Add to the buffer: each episode's transitions (s_t, a_t, r_t, s_t+1) join iteration K-1's
   buffer, new ones at the buffer's largest priority (PER's rule: each is drawn soon), the oldest
   dropped past `nlac.buffer_size`. The buffer is Parquet (buffer.parquet), carried to K+1 with
   its priorities and draw counts.
3. Train (lines 7-11): `nlac.steps` steps, each on `nlac.batch_size` transitions drawn by PER:
   - L1's target, the backup's critique of (s_t, a_t) given r_t and s_t+1 (roles.backup);
   - a_t for L2: fresh from the current policy at s_t (nlac.action: fresh, Eq. 6) or the stored one;
     its critique Q_L(s_t, a_t) (roles.language_critic) and the refined action (roles.refiner);
   - a step on L1, then one on L2 (nlac.update: separate, Algorithm 1's; joint: one step on
     L1 + L2), then the EMA step of theta-bar, then the drawn priorities <- L1.
   theta starts from the iteration's policy, theta-bar from iteration K-1's target (at 1: the base,
   theta-bar = theta_0). Both are written: model (the next iteration's policy) and target.

Roles: `policy` runs the role on the model in training (theta for the critic and the refiner,
theta-bar for the backup), the paper's form; `oracle` is the environment's (TwentyQuestions: its
knowledge base and secret, envs/twenty_questions/critic.py; the oracle refiner is the hindsight
proposer given the action, which keeps an action nothing beats); hf, vllm and openai serve a fixed
LLM. The CPU default is the oracle for all three: a tiny model trained from scratch writes no
critique zero-shot, and learns to from the oracle's by L1.

With `nlac.algorithm` a baseline (rft, grpo, ppo), step 2 and 3 are that method's trainer on the
iteration's episodes instead (tasks/train: rft.py, grpo.py, ppo_returns.py; train's trainer keys,
nlac.method's own), starting from the iteration's policy, GRPO's and PPO's KL to iteration 1's
policy (the run's base). The buffer is carried on unchanged and the target is not trained.

Metrics (metrics.json): success on the collected splits, the share of critiques saying
`Optimality: No`, the share of refined actions that are another move than the action, every
role's requests by outcome (parse failures with their commonest reasons), L1 and L2 first and
final, the priorities' histogram, the buffer's size, and the trained critic against the oracle
(critic_accuracy: theta, whatever backend plays the critic role, on transitions never drawn).
samples.parquet keeps every trained sample.

The DVC stage reads iteration K's policy, K-1's outputs and the run's base from params
(nlac_iterations, data/iterationK/nlac); the miniature's bench passes its own folders instead.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import polars as pl
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

from envs.base import Environment, recorded_reply
from models.base import SamplingParams
from models.hf import HFGenerator, native_bf16
from storage.parquet import write_table
from storage.schema import chat_message, from_table, stored_message, to_table
from storage.validate import StageInputs
from tasks.collect import run_collect
from tasks.params import NLAC_BASELINES, Params, nlac_dir
from tasks.roles import Outcome, account, call_parsed, check_failure_rate, make_generator, role_sampling
from tasks.rollout import action_starts, derive_seed
from tasks.train import nlac as algorithm
from tasks.train.distributed import deepspeed_config

ROLES = ("language_critic", "backup", "refiner")


# ---- the replay buffer ----


def transitions(trajectories: list[dict], iteration: int) -> list[dict]:
    """The episodes' transitions in order, one per action; priority set when they join the buffer."""
    rows = []
    for traj in trajectories:
        messages, starts = traj["messages"], action_starts(traj["messages"])
        for t, at in enumerate(starts):
            end = starts[t + 1] if t + 1 < len(starts) else len(messages)
            rows.append({
                "transition_id": hashlib.sha256(f"{traj['trajectory_id']}:{t}".encode()).hexdigest()[:16],
                "trajectory_id": traj["trajectory_id"], "task_id": traj["task_id"], "split": traj["split"], "step": t,
                "state": messages[:at], "action": messages[at], "observation": messages[at + 1 : end], "turns": traj["turns"][: t + 1],
                "reward": float(traj["turns"][t]["reward"] or 0.0), "terminal": t == len(starts) - 1, "return": float(traj["return"]),
                "priority": 0.0, "added": iteration, "trained": 0, "policy_id": traj["policy_id"],
            })
    return rows


def merged(previous: list[dict], new: list[dict], size: int | None) -> list[dict]:
    """The buffer after adding `new`, each at the largest priority already there (1 in an empty
    buffer), the oldest dropped past `size`."""
    top = max((r["priority"] for r in previous), default=1.0)
    rows = [*previous, *({**r, "priority": top} for r in new)]
    return rows[-size:] if size else rows


def buffer_rows(table) -> list[dict]:
    rows = table.to_pylist()
    for r in rows:
        r["state"], r["observation"] = [chat_message(m) for m in r["state"]], [chat_message(m) for m in r["observation"]]
        r["action"] = chat_message(r["action"])
    return rows


def buffer_table(rows: list[dict]):
    return to_table([{**r, "state": [stored_message(m) for m in r["state"]], "action": stored_message(r["action"]),
                      "observation": [stored_message(m) for m in r["observation"]]} for r in rows], "nlac_buffer")


# ---- the roles ----


def _oracle(value, text: str) -> Outcome:
    return Outcome("ok", value, text, 1, None)


def _failed(reason: str) -> Outcome:
    return Outcome("failed", None, "", 0, reason)


def move(env: Environment, text: str) -> str:
    """The move a text plays, as the environment parses it; the text itself when it does not parse."""
    try:
        return env.parse_action(text)[1]
    except ValueError:
        return text.strip()


class Roles:
    """The three roles and the policy's fresh actions for one iteration, each request accounted."""

    def __init__(self, params: Params, env: Environment, model, target, tokenizer, iteration: int):
        self.params, self.env, self.k = params, env, iteration
        batch = params.nlac.generation_batch_size
        # One generator over each in-process model, made once: theta's reads its weights as they stand at each call.
        theta, theta_bar = HFGenerator.in_memory(model, tokenizer, "nlac-theta", batch), HFGenerator.in_memory(target, tokenizer, "nlac-theta-bar", batch)
        self.actor = theta
        self.gens = {}
        for name in ROLES:
            role = getattr(params.roles, name)
            if role.backend == "policy":
                self.gens[name] = theta_bar if name == "backup" else theta
            elif role.backend != "oracle":
                self.gens[name] = make_generator(role, params.cache.path)
        self.outcomes: dict[str, list[Outcome]] = {name: [] for name in (*ROLES, "future")}
        self.unparsed_actions = 0

    def _call(self, name: str, requests: list, seeds: list[int]) -> list[Outcome]:
        role = getattr(self.params.roles, name)
        return call_parsed(self.gens[name], [r.messages for r in requests], seeds, [r.parse for r in requests], role_sampling(role), role.parse_attempts)

    def targets(self, rows: list[dict], seeds: list[int]) -> tuple[list[Outcome], list[str | None]]:
        """L1's targets (B_L: the backup's critique of each stored transition) and the bootstrapped futures d_t+1."""
        env = self.env
        if "backup" not in self.gens:
            out = [_oracle(c, c.text) for c in (env.oracle_backup(env.task(r["task_id"]), r["turns"][:-1], r["turns"][-1], r["terminal"], r["return"]) for r in rows)]
            self.outcomes["backup"] += out
            return out, [None] * len(rows)
        live = [j for j, r in enumerate(rows) if not r["terminal"]]
        futures: list[Outcome | None] = [None] * len(rows)
        asked = self._call("backup", [env.future_request(rows[j]["state"], rows[j]["action"], rows[j]["observation"]) for j in live],
                           [derive_seed(seeds[j], "future") for j in live])
        for j, o in zip(live, asked):
            futures[j] = o
        self.outcomes["future"] += asked
        ready = [j for j, r in enumerate(rows) if r["terminal"] or futures[j].status == "ok"]
        requests = [env.target_request(rows[j]["state"], rows[j]["action"], rows[j]["observation"], futures[j].value if futures[j] else None,
                                       rows[j]["return"] if rows[j]["terminal"] else rows[j]["reward"], rows[j]["terminal"]) for j in ready]
        done = dict(zip(ready, self._call("backup", requests, [seeds[j] for j in ready])))
        out = [done.get(j) or _failed(f"no bootstrapped future: {futures[j].reason}") for j in range(len(rows))]
        self.outcomes["backup"] += out
        return out, [f.value if f is not None and f.status == "ok" else None for f in futures]

    def actions(self, rows: list[dict], seeds: list[int]) -> list[dict]:
        """a_t for L2: fresh from the current policy at s_t, or the stored one."""
        if self.params.nlac.action == "stored":
            return [r["action"] for r in rows]
        done = self.actor.generate([r["state"] for r in rows], SamplingParams(**self.params.nlac.sampling.model_dump()), seeds)
        texts = [recorded_reply(c.text) for c in done]
        self.unparsed_actions += sum(not _parses(self.env, t) for t in texts)
        return [{"role": "assistant", "content": t} for t in texts]

    def critiques(self, rows: list[dict], actions: list[dict], seeds: list[int]) -> list[Outcome]:
        env = self.env
        if "language_critic" not in self.gens:
            out = [_oracle(c, c.text) for c in (env.oracle_critique(env.task(r["task_id"]), r["turns"][:-1], a["content"]) for r, a in zip(rows, actions))]
        else:
            out = self._call("language_critic", [env.critic_request(r["state"], a) for r, a in zip(rows, actions)], seeds)
        self.outcomes["language_critic"] += out
        return out

    def refinements(self, rows: list[dict], actions: list[dict], critiques: list[Outcome], seeds: list[int]) -> list[Outcome]:
        env = self.env
        if "refiner" not in self.gens:
            out = []
            for r, a in zip(rows, actions):
                better = env.propose(env.task(r["task_id"]), r["turns"][:-1], 1, move(env, a["content"]))
                out.append(_oracle(better[0].text, better[0].text) if better else _oracle(a["content"], a["content"]))  # nothing better: the action stays
        else:
            ready = [j for j, c in enumerate(critiques) if c.status == "ok"]
            done = dict(zip(ready, self._call("refiner", [env.refine_request(rows[j]["state"], actions[j], critiques[j].text) for j in ready], [seeds[j] for j in ready])))
            out = [done.get(j) or _failed(f"no critique to refine by: {critiques[j].reason}") for j in range(len(rows))]
        self.outcomes["refiner"] += out
        return out

    def examples(self, buffer: list[dict], drawn: np.ndarray, step: int) -> list[algorithm.Example]:
        rows = [buffer[i] for i in drawn]
        seeds = [derive_seed(self.params.seed, "nlac", self.k, step, j, r["transition_id"]) for j, r in enumerate(rows)]
        targets, futures = self.targets(rows, [derive_seed(s, "backup") for s in seeds])
        actions = self.actions(rows, [derive_seed(s, "action") for s in seeds])
        critiques = self.critiques(rows, actions, [derive_seed(s, "critic") for s in seeds])
        refined = self.refinements(rows, actions, critiques, [derive_seed(s, "refiner") for s in seeds])
        out = []
        for r, t, f, a, c, x in zip(rows, targets, futures, actions, critiques, refined, strict=True):
            record = {
                "transition_id": r["transition_id"], "target": t.text or None, "target_status": t.status, "future": f,
                "action": a["content"], "action_source": self.params.nlac.action, "critique": c.text or None, "critique_status": c.status,
                "optimal": c.value.optimal if c.status == "ok" else None, "refined": x.value if x.status == "ok" else None, "refined_status": x.status,
                "changed": not self.env.same_action(move(self.env, a["content"]), move(self.env, x.value)) if x.status == "ok" else None,
            }
            out.append(algorithm.Example(self.env.critic_request(r["state"], r["action"]).messages, t.text if t.status == "ok" else None,
                                         r["state"], record["refined"], record))
        return out


def _parses(env: Environment, text: str) -> bool:
    try:
        env.parse_action(text)
        return True
    except ValueError:
        return False


# ---- the trained critic against the oracle ----


def critic_accuracy(params: Params, env: Environment, theta, buffer: list[dict]) -> dict:
    """theta (an in-process generator over the trained weights) as the language critic, at the
    critic's prompt and greedy, on up to nlac.critic_eval transitions of the buffer never drawn for
    training (drawn by seed): does it say the oracle's Optimality on the stored action? accuracy
    is over the critiques that parse, agreement over all of them (an unparsed one disagrees);
    majority is what always saying the oracle's commoner verdict would score."""
    unseen = [r for r in buffer if r["trained"] == 0]
    n = min(params.nlac.critic_eval, len(unseen))
    if n == 0:
        return {"transitions": 0, "on": "buffer transitions never drawn for training"}
    rng = np.random.default_rng(derive_seed(params.seed, "critic-eval"))
    rows = [unseen[i] for i in sorted(rng.choice(len(unseen), size=n, replace=False))]
    requests = [env.critic_request(r["state"], r["action"]) for r in rows]
    greedy = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=params.roles.language_critic.sampling.max_new_tokens)
    said = call_parsed(theta, [q.messages for q in requests], [derive_seed(params.seed, "critic-eval", r["transition_id"]) for r in rows],
                       [q.parse for q in requests], greedy, 1)
    oracle = [env.oracle_critique(env.task(r["task_id"]), r["turns"][:-1], r["action"]["content"]).optimal for r in rows]
    parsed = [(o.value.optimal, truth) for o, truth in zip(said, oracle) if o.status == "ok"]
    right = sum(a == b for a, b in parsed)
    no = sum(not t for t in oracle) / n
    return {
        "transitions": n, "on": "buffer transitions never drawn for training", "parsed": len(parsed), "parse_rate": round(len(parsed) / n, 4),
        "accuracy": round(right / len(parsed), 4) if parsed else None, "agreement": round(right / n, 4),
        "oracle_no_share": round(no, 4), "majority": round(max(no, 1 - no), 4),
        "said_no_share": _share([not a for a, _ in parsed]), "top_reasons": account(said).get("top_reasons", []),
    }


# ---- the stage ----


def _share(values: list[bool]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def _histogram(priorities: np.ndarray, bins: int = 10) -> dict:
    counts, edges = np.histogram(priorities, bins=bins)
    return {"edges": [round(float(e), 6) for e in edges], "counts": counts.tolist()}


def run_nlac_iteration(params: Params, iteration: int, out_dir: Path, collect_dir: Path, policy: Path | None = None,
                       previous: Path | None = None, base: Path | None = None) -> dict:
    """Writes collect_dir (the iteration's episodes), out_dir/model, out_dir/target, out_dir/buffer.parquet,
    out_dir/samples.parquet, out_dir/loss.json and out_dir/metrics.json. `policy` (the one that
    collects), `previous` (iteration K-1's out_dir: its target and buffer) and `base` (the run's
    first policy: a baseline's KL reference) default to params' nlac_iterations and nlac_dir."""
    t0 = time.time()
    n, env = params.nlac, params.env.environment()
    policy = str(policy or params.nlac_iterations[iteration].policy)
    if previous is None and iteration > 1:
        previous = Path(nlac_dir(iteration - 1))
    collect = params.collect.model_copy(update={"splits": n.splits, "m": n.episodes_per_task(), "sampling": n.sampling,
                                                "batch_size": n.generation_batch_size, "limit_tasks": n.limit_tasks or params.limit_tasks})
    p = params.model_copy(update={"collect": collect, "seed": derive_seed(params.seed, "nlac-iteration", iteration)})
    print(f"nlac iteration {iteration}: collect with {policy}", flush=True)
    collected = run_collect(p, Path(policy), collect_dir)
    inputs = StageInputs()
    episodes = inputs.read_polars(collect_dir / "trajectories.parquet", "trajectories")
    carried: list[dict] = []
    if previous is not None:
        carried = buffer_rows(inputs.read(previous / "buffer.parquet", "nlac_buffer"))
    set_seed(p.seed)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    metrics = {"iteration": iteration, "algorithm": n.algorithm, "policy": policy, "seed": p.seed, "collect": collected,
               "success_on_collect": {split: s["success_rate"] for split, s in collected.items() if isinstance(s, dict) and "success_rate" in s}}
    if n.algorithm != "nlac":
        metrics.update(_baseline(p, env, model, tokenizer, episodes, out_dir, base or Path(params.nlac_iterations[1].policy)))
        buffer = carried
    else:
        new = transitions(from_table(episodes), iteration)
        buffer = merged(carried, new, n.buffer_size)
        target = AutoModelForCausalLM.from_pretrained(policy if previous is None else previous / "target", dtype=torch.float32)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model.to(device), target.to(device)
        roles = Roles(p, env, model, target, tokenizer, iteration)
        print(f"nlac iteration {iteration}: {len(new)} transitions added, {len(buffer)} in the buffer; {n.steps} steps of {n.batch_size}", flush=True)
        result = algorithm.train(
            model, target, tokenizer, np.array([r["priority"] for r in buffer]), lambda drawn, step: roles.examples(buffer, drawn, step),
            steps=n.steps, batch_size=n.batch_size, learning_rate=n.learning_rate, weight_decay=n.weight_decay, max_grad_norm=n.max_grad_norm,
            tau=n.tau, alpha=n.per_alpha, beta=n.per_beta, epsilon=n.per_epsilon, token_mean=n.nll == "token_mean",
            bf16=native_bf16() if n.bf16 == "auto" else n.bf16, seed=p.seed, update=n.update, learning_rate_l2=n.learning_rate_l2,
        )
        for r, priority, draws in zip(buffer, result["priorities"], result["draws"]):
            r["priority"], r["trained"] = float(priority), r["trained"] + int(draws)
        _save(target, tokenizer, out_dir / "target")
        write_table(to_table(result["samples"], "nlac_samples"), out_dir / "samples.parquet", "nlac_samples")
        (out_dir / "loss.json").write_text(json.dumps(result["curve"]) + "\n")
        metrics.update(_nlac_metrics(p, roles, result, buffer, len(new), iteration))
        model.eval()
        metrics["critic_accuracy"] = critic_accuracy(p, env, roles.actor, buffer)
    _save(model, tokenizer, out_dir / "model")
    write_table(buffer_table(buffer), out_dir / "buffer.parquet", "nlac_buffer")
    metrics["inputs"] = inputs.write(out_dir)
    metrics["seconds"] = round(time.time() - t0, 1)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    if n.algorithm == "nlac":
        for name in ROLES:
            if name in roles.gens:
                check_failure_rate(f"nlac_iteration@{iteration}", name, getattr(params.roles, name), metrics["roles"][name],
                                   f"SELECT step, transition_id, target_status, critique_status, refined_status FROM iteration{iteration}_nlac.samples")
    return metrics


def _save(model, tokenizer, folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _nlac_metrics(params: Params, roles: Roles, result: dict, buffer: list[dict], added: int, iteration: int) -> dict:
    samples, curve = result["samples"], result["curve"]
    first, last = curve[0], curve[-1]
    calls = {name: account(roles.outcomes[name]) for name in ROLES}
    if roles.outcomes["future"]:
        calls["backup"]["bootstrap_futures"] = account(roles.outcomes["future"])
    targets = [o.value for o in roles.outcomes["backup"] if o.status == "ok"]
    return {
        "roles": calls,
        "backends": {name: getattr(params.roles, name).backend for name in ROLES},
        "action": params.nlac.action,
        "fresh_actions_unparsed": roles.unparsed_actions,
        "optimality_no_share": _share([s["optimal"] is False for s in samples if s["optimal"] is not None]),  # the critic's, on the actions refined
        "target_optimality_no_share": _share([not c.optimal for c in targets]),  # the backup's, on the stored actions
        "refined_changed_share": _share([s["changed"] for s in samples if s["changed"] is not None]),
        "first_l1": first["l1"], "final_l1": last["l1"], "first_l2": first["l2"], "final_l2": last["l2"],
        "steps": len(curve), "samples": len(samples),
        "buffer": {"size": len(buffer), "added": added, "from_earlier_iterations": sum(r["added"] < iteration for r in buffer),
                   "never_drawn": sum(r["trained"] == 0 for r in buffer)},
        "priority_histogram": _histogram(result["priorities"]),
    }


def _baseline(params: Params, env: Environment, model, tokenizer, episodes: pl.DataFrame, out_dir: Path, base: Path) -> dict:
    """A baseline's update on the iteration's episodes (tasks/train), from the iteration's policy;
    GRPO's and PPO's KL to `base`."""
    import importlib

    method = params.nlac.baseline()
    name = NLAC_BASELINES[params.nlac.algorithm]
    cfg = params.train.config_for(method)
    cfg = cfg.model_copy(update={"deepspeed": deepspeed_config(cfg.deepspeed)})
    low, high = env.reward_range
    # The trainers read a labelled table's reward and weight: here the return, and it scaled to [0, 1] (Refit's return_range)
    table = episodes.with_columns(pl.col("return").alias("reward"), ((pl.col("return") - low) / (high - low)).alias("weight"))
    if name == "rft":
        extra = {"won": env.won}
    else:  # the KL's reference: the run's base, iteration 1's policy
        extra = {"reference": AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()}
    print(f"nlac iteration: {params.nlac.algorithm} ({name}) on {table.height} episodes", flush=True)
    result = getattr(importlib.import_module(f"tasks.train.{name}"), "train")(model, tokenizer, table, cfg, params.seed, **extra)
    curve = result.pop("curve")
    result.pop("model", None)
    (out_dir / "loss.json").parent.mkdir(parents=True, exist_ok=True)
    (out_dir / "loss.json").write_text(json.dumps([{"step": e["step"], "loss": e["loss"]} for e in curve]) + "\n")
    write_table(to_table([], "nlac_samples"), out_dir / "samples.parquet", "nlac_samples")
    (out_dir / "target").mkdir(parents=True, exist_ok=True)
    (out_dir / "target" / "NONE.txt").write_text(f"nlac.algorithm {params.nlac.algorithm} trains no target network (nlac does)\n")
    # the optimizer steps taken, the budget every arm of the miniature shares (none for RFT without
    # a won game, or GRPO without a group whose rewards differ)
    steps = result.get("steps", cfg.gradient_steps if result.get("rows") else 0)
    return {"method": method.model_dump(exclude_none=True), "trained": result, "optimizer_steps": steps}
