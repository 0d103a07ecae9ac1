"""proposer: HOPE's distilled hindsight proposer (HOPE 2.8): relabel's counterfactuals as SFT data.

A site is one relabelled turn of a logged trajectory (trajectory_id, branch_turn). Its example is
the proposer's own request there (env.proposer_request: the parent's turns before the branch,
the parent's summary, n = the site's counterfactuals) answered by those counterfactuals in rank
order, written as the request's parser reads them (env.proposer_reply). The trained model is
then served as `roles.proposer` (backend hf or vllm, model out_dir/model) by the path relabel
and the actor already take, with no oracle and no hosted model.

- Phase 1: `epochs` at `learning_rate` on every site (HOPE: 2 at 3e-5).
- Phase 2: `success_epochs` at `success_learning_rate` (HOPE: 1 at 3e-6) on the sites where a
  counterfactual's regeneration succeeded, each with only those counterfactuals (n = how many).
  HOPE keeps "only the counterfactuals whose hindsight trajectories ended in success"; every
  counterfactual has its own regeneration, so the filter can be per counterfactual, and a whole
  site would also teach its failed proposals again. With no such site, phase 2 is skipped and
  metrics say so.

A counterfactual whose reply the request's parser refuses is left out of its site and counted
with the reason: the model would learn replies its role then refuses. (In the question games the
parser refuses a player reason that names the secret or its category, which the oracle's
justified guesses do: "... only Basketball fits".) A site longer than the model's context is
left out and counted: cut, it would lose its reply.

A `heldout_share` of the sites (by a hash of seed and site) stays out of training. On them the
trained model is served through the role's path (tasks.roles.call_requests on an hf generator at
roles.proposer's sampling and parse_attempts) and measured: the share of replies that parse, and
of sites whose first proposal is the teacher's first (env.same_action; the teacher is relabel's
proposer, named in metrics, the oracle by default).
"""
from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

from envs.base import Counterfactual, Environment
from storage.schema import from_table
from storage.validate import StageInputs
from tasks.params import Params
from tasks.regenerate import ok_relabels
from tasks.roles import REASON_CHARS, TOP_REASONS, account, call_requests, make_generator
from tasks.rollout import derive_seed
from tasks.train.distributed import save
from tasks.train.sft import tokenize_chats, train_sft


def heldout(key: str, seed: int, share: float) -> bool:
    return derive_seed(seed, "proposer-heldout", key) / 0x7FFFFFFF < share


def counterfactual(row: dict) -> Counterfactual:
    """A relabels row's counterfactual."""
    return Counterfactual(row["counterfactual_text"], row["counterfactual_action"], row["player_reason"] or "", row["rationale"] or "")


def conversation(env: Environment, task, prefix: list[dict], summary: str, proposals: list[Counterfactual]) -> list[dict]:
    """The proposer's request at a site for len(proposals) proposals, answered by `proposals`."""
    request = env.proposer_request(task, prefix, len(proposals), summary)
    return [*request.messages, {"role": "assistant", "content": env.proposer_reply(proposals)}]


def refusal(env: Environment, task, prefix: list[dict], summary: str, proposal: Counterfactual) -> str | None:
    """Why the request's parser does not read `proposal`'s reply back as `proposal`, or None.
    The parsers judge each proposal alone, so one is checked in a reply of its own."""
    try:
        back = env.proposer_request(task, prefix, 1, summary).parse(env.proposer_reply([proposal]))
    except ValueError as e:
        return str(e)
    return None if back == [proposal] else f"the reply reads back as {back[0].text[:80]!r}, not the counterfactual"


def run_proposer(params: Params, relabels: Path, trajectory_files: list[Path], summaries: Path, out_dir: Path) -> dict:
    """Writes out_dir/model (the proposer: a causal LM directory with its tokenizer),
    out_dir/loss.json, out_dir/metrics.json and out_dir/quarantine.parquet."""
    t0 = time.time()
    p, env = params.proposer, params.env.environment()
    inputs = StageInputs()
    summary_of = {s["trajectory_id"]: s["summary"] for s in inputs.read(summaries, "summaries").to_pylist() if s["status"] == "ok"}
    trajectories = {t["trajectory_id"]: t for f in trajectory_files for t in from_table(inputs.read(f, "trajectories"))}
    succeeded = {t["relabel_id"] for t in trajectories.values() if t["source"] == "regeneration" and t["success"]}
    rows = ok_relabels(inputs, relabels, trajectories, ", ".join(map(str, trajectory_files)))
    by_site: dict[tuple[str, int], list[dict]] = {}
    for r in sorted(rows, key=lambda r: (r["trajectory_id"], r["branch_turn"], r["rank"])):
        by_site.setdefault((r["trajectory_id"], r["branch_turn"]), []).append(r)

    set_seed(params.seed)
    torch.use_deterministic_algorithms(True)
    tokenizer = AutoTokenizer.from_pretrained(p.base_model)
    model = AutoModelForCausalLM.from_pretrained(p.base_model, dtype=torch.float32)
    context = model.config.max_position_embeddings

    def encode(site: dict, proposals: list[Counterfactual]) -> dict | None:
        """The site's tokenized example for these proposals (loss on the reply alone), or None
        when it does not fit the model's context."""
        chat = conversation(env, site["task"], site["prefix"], site["summary"], proposals)
        example = tokenize_chats(tokenizer, [chat], sys.maxsize).examples[0]
        return example if len(example["input_ids"]) <= context else None

    counts, refused = Counter(), Counter()
    train: list[dict] = []
    held: list[dict] = []
    for (trajectory_id, turn), site_rows in by_site.items():
        if trajectory_id not in summary_of:
            counts["sites_without_summary"] += 1
            continue
        parent = trajectories[trajectory_id]
        site = {"key": f"{trajectory_id}:{turn}", "task": env.task(parent["task_id"]), "prefix": parent["turns"][:turn], "summary": summary_of[trajectory_id]}
        kept = []
        for r in site_rows:
            why = refusal(env, site["task"], site["prefix"], site["summary"], counterfactual(r))
            if why is None:
                kept.append(r)
            else:
                refused[why[:REASON_CHARS]] += 1
        if not kept:
            counts["sites_all_refused"] += 1
            continue
        site["proposals"] = [counterfactual(r) for r in kept]
        site["successful"] = [counterfactual(r) for r in kept if r["relabel_id"] in succeeded]
        site["teacher"] = kept[0]["proposer"]
        site["example"] = encode(site, site["proposals"])
        if site["example"] is None:
            counts["sites_too_long"] += 1
            continue
        (held if heldout(site["key"], params.seed, p.heldout_share) else train).append(site)
    untrained = None
    if not train:
        # As the actor without pairs: the stage keeps the base model and says why, so a pipeline
        # whose dialogues outgrow the model's context (CarDealer on the tiny default) runs on.
        untrained = (
            f"{relabels}: no relabel site to train the proposer on ({len(rows)} ok counterfactuals at {len(by_site)} sites; "
            f"{len(held)} held out, {counts['sites_too_long']} longer than the model's {context} positions, "
            f"{counts['sites_all_refused']} whose every counterfactual the proposer's parser refuses, "
            f"{counts['sites_without_summary']} whose trajectory has no summary in {summaries}): the proposer is the base model"
        )
        print(f"proposer: {untrained}", flush=True)
    phase2 = []  # (site, example) with the site's successful counterfactuals alone
    for site in (s for s in train if s["successful"]):
        example = encode(site, site["successful"])
        if example is None:  # fewer proposals than phase 1's reply, so only a prompt at the limit gets here
            counts["success_sites_too_long"] += 1
        else:
            phase2.append((site, example))
    print(f"proposer: {len(train)} sites to train on ({len(phase2)} with a successful regeneration), {len(held)} held out, "
          f"{sum(refused.values())} counterfactuals refused by the parser, {counts['sites_too_long']} sites too long", flush=True)

    kwargs = {k: getattr(p, k) for k in ("batch_size", "warmup_ratio", "weight_decay", "bf16", "max_loss_ratio")}

    def phase(number: int, sites: list[tuple[dict, dict]], epochs: float, lr: float, key: str) -> dict:
        print(f"proposer: phase {number}, {epochs:g} epochs at lr {lr:g} on {len(sites)} sites", flush=True)
        points = train_sft(model, tokenizer, [e for _, e in sites], epochs=epochs, learning_rate=lr, seed=params.seed, **kwargs)
        curve.extend({"phase": number, "step": e["step"], "loss": e["loss"]} for e in points)
        return {"sites": len(sites), "counterfactuals": sum(len(s[key]) for s, _ in sites), "epochs": epochs, "learning_rate": lr,
                "final_loss": points[-1]["loss"] if points else None}

    curve: list[dict] = []
    phases = {"1": phase(1, [(s, s["example"]) for s in train], p.epochs, p.learning_rate, "proposals")} if train else {"1": {"sites": 0, "skipped": "no site"}}
    if not train:
        phases["2"] = {"sites": 0, "skipped": "no site"}
    elif phase2 and p.success_epochs > 0:
        phases["2"] = phase(2, phase2, p.success_epochs, p.success_learning_rate, "successful")
    else:
        why = "success_epochs is 0" if phase2 else "no training site has a counterfactual whose regeneration succeeded"
        print(f"proposer: phase 2 skipped: {why}", flush=True)
        phases["2"] = {"sites": 0, "skipped": why}
    out_dir.mkdir(parents=True, exist_ok=True)
    save(model, tokenizer, out_dir / "model", True)
    (out_dir / "loss.json").write_text(json.dumps(curve) + "\n")

    metrics = {
        "inputs": inputs.write(out_dir),
        "base_model": p.base_model,
        "teacher": sorted({s["teacher"] for s in train + held}),
        "counterfactuals": len(rows),
        "sites": len(by_site),
        "counterfactuals_refused": sum(refused.values()),
        **({"refused_reasons": [[n, why] for why, n in refused.most_common(TOP_REASONS)]} if refused else {}),
        **{k: counts[k] for k in ("sites_without_summary", "sites_all_refused", "sites_too_long", "success_sites_too_long")},
        "phases": phases,
        **({"untrained": untrained} if untrained else {}),
        "heldout": evaluate(params, env, held, out_dir / "model"),
        "seconds": round(time.time() - t0, 1),
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics


def evaluate(params: Params, env: Environment, sites: list[dict], model_dir: Path) -> dict:
    """The proposer at `model_dir` on held-out sites, served as roles.proposer would serve it
    (backend hf): how many replies parse, and how many sites' first proposal is the teacher's."""
    if not sites:
        return {"sites": 0}
    print(f"proposer: held-out, {len(sites)} sites", flush=True)
    role = params.roles.proposer.model_copy(update={"backend": "hf", "model": str(model_dir)})
    gen = make_generator(role, None)  # uncached: a new model is measured, not a stored answer
    requests = [env.proposer_request(s["task"], s["prefix"], len(s["proposals"]), s["summary"]) for s in sites]
    outcomes = call_requests(gen, requests, [derive_seed(role.seed, "proposer-heldout", s["key"]) for s in sites], role)
    agree = sum(o.status == "ok" and env.same_action(o.value[0].action, s["proposals"][0].action) for s, o in zip(sites, outcomes))
    calls = account(outcomes, gen)
    return {"sites": len(sites), "parse_rate": round(calls["ok"] / len(sites), 4), "agrees_with_teacher": round(agree / len(sites), 4), "calls": calls}
