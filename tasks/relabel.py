"""relabel (hindsight relabeling): counterfactual actions at chosen turns of logged trajectories.

Two schemes, as the papers run them:
- hope: per task pick k trajectories; per trajectory t timesteps inside [a*T, b*T) of its T
  turns; per timestep n distinct counterfactuals proposed from (prefix, summary). Too early and
  the policy has not yet narrowed anything; too late and the proposer could just name the secret.
- hr: one suggestion per dialogue: the controller names the top few turns to improve and one of
  them is chosen at random (HR App. B.1).
A counterfactual equal to the original action (after normalisation) is dropped and counted.
An LLM proposer's or controller's output that guesses the secret where the answers do not
justify that guess (proposer.unjustified_guess) is refused and sampled again, like any output
it cannot use: the action enters the trajectory as the player's move.
"""
from __future__ import annotations

import hashlib
import json
import random
import time
from collections import defaultdict
from pathlib import Path

from envs.twenty_questions.format import Action, render_action
from envs.twenty_questions.kb import Entity, KnowledgeBase, load_kb
from envs.twenty_questions.llm_roles import chat, dialogue, parse_controller, parse_proposals, template_hash
from envs.twenty_questions.policies import PlayerView
from envs.twenty_questions.proposer import VERSION, OracleProposer, Proposal, same_action, unjustified_guess
from storage.parquet import write_table
from storage.schema import to_table
from storage.validate import StageInputs
from tasks.params import Params
from tasks.roles import account, call_parsed, check_failure_rate, make_generator, role_sampling
from tasks.rollout import derive_seed, history


def window(num_turns: int, a: float, b: float) -> list[int]:
    """The 0-based turns j with a*T <= j < b*T."""
    return [j for j in range(num_turns) if a * num_turns <= j < b * num_turns]


def proposals_parser(kb: KnowledgeBase, secret: Entity, view: PlayerView, n: int):
    """parse_proposals, refusing a question that guesses the secret with hindsight."""

    def parse(text: str):
        proposals = parse_proposals(text, n, secret.name, secret.category)
        for i, p in enumerate(proposals):
            if (why := unjustified_guess(kb, secret, view, p.question)) is not None:
                raise ValueError(f"proposal {i}: the question {why}")
        return proposals

    return parse


def controller_parser(kb: KnowledgeBase, secret: Entity, traj: dict, candidates: list[Entity], max_turns: int, top: int):
    """parse_controller, refusing a replacement that guesses the secret with hindsight at its place."""
    played = history(traj)

    def parse(text: str):
        places = parse_controller(text, [t["action"] for t in traj["turns"]], top)
        for i, place in enumerate(places):
            view = PlayerView(candidates, played[: place.turn], place.turn, max_turns)
            if (why := unjustified_guess(kb, secret, view, place.replacement)) is not None:
                raise ValueError(f"place {i + 1}: the replacement {why}")
        return places

    return parse


def run_relabel(params: Params, trajectories: Path, summaries: Path, out_dir: Path) -> dict:
    """Writes out_dir/relabels.parquet and out_dir/metrics.json."""
    t0 = time.time()
    r, kb, role = params.relabel, load_kb(), params.roles.proposer
    llm = role.backend != "oracle"
    proposer = OracleProposer(kb)
    inputs = StageInputs()
    summary_of = {s["trajectory_id"]: s["summary"] for s in inputs.read(summaries, "summaries").to_pylist() if s["status"] == "ok"}
    trajs = [t for t in inputs.read(trajectories, "trajectories").to_pylist() if t["split"] in r.splits]
    keys = ("trajectories_relabelled", "skipped_no_summary", "empty_window", "no_place_to_improve", "timesteps", "proposed", "dropped_equal", "dropped_duplicate")
    counts = defaultdict(int, trajectories_in=len(trajs), **dict.fromkeys(keys, 0))
    by_task: dict[str, list[dict]] = defaultdict(list)
    for t in sorted(trajs, key=lambda t: t["trajectory_id"]):
        # The proposer works from (prefix, summary); a trajectory whose summary failed is
        # skipped and counted. The oracle reads the secret from the environment itself.
        if t["trajectory_id"] not in summary_of:
            counts["skipped_no_summary"] += 1
            continue
        by_task[t["task_id"]].append(t)

    template = "controller.j2" if r.mode == "hr" else "proposer.j2"
    version = f"{role.backend}:{template_hash(template)}" if llm else VERSION
    prompt_hash = hashlib.sha256(version.encode()).hexdigest()[:12]
    proposer_id = role.backend
    rows: list[dict] = []

    def emit(traj: dict, turn: int | None, rank: int, proposal: Proposal | None, status: str = "ok", reason: str | None = None) -> None:
        # turn is None for a dialogue whose controller named no usable place (HR, failed)
        original = traj["turns"][turn]["action"] if turn is not None else None
        if proposal is not None and same_action(kb, original, proposal.action.question):
            counts["dropped_equal"] += 1
            return
        text = render_action(proposal.action.reason, proposal.action.question) if proposal else None
        key = json.dumps([traj["trajectory_id"], turn, text if proposal else f"{status}:{rank}", r.mode, version])
        rows.append(
            {
                "relabel_id": hashlib.sha256(key.encode()).hexdigest()[:16],
                "trajectory_id": traj["trajectory_id"],
                "task_id": traj["task_id"],
                "split": traj["split"],
                "mode": r.mode,
                "branch_turn": turn,
                "rank": rank,
                "original_text": traj["messages"][2 + 2 * turn]["content"] if turn is not None else None,
                "original_action": original,
                "counterfactual_text": text,
                "counterfactual_action": proposal.action.question if proposal else None,
                "player_reason": proposal.action.reason if proposal else None,
                "rationale": proposal.rationale if proposal else None,
                "status": status,
                "reason": reason,
                "proposer": proposer_id,
                "prompt_hash": prompt_hash,
            }
        )

    sites: list[tuple[dict, int, PlayerView]] = []  # hope: (trajectory, turn, what the player saw)
    dialogues: list[tuple[dict, random.Random, list[Entity]]] = []  # hr with an LLM controller: (trajectory, its rng, candidates)
    for task_id, group in sorted(by_task.items()):
        rng = random.Random(derive_seed(params.seed, "relabel", r.mode, task_id))
        secret = kb.get(task_id)
        chosen = rng.sample(group, min(r.k, len(group))) if r.mode == "hope" else group
        for traj in chosen:
            counts["trajectories_relabelled"] += 1
            played = history(traj)
            candidates = kb.split(traj["split"]) if params.env.show_candidates else list(kb.entities)
            if r.mode == "hr" and llm:
                dialogues.append((traj, random.Random(rng.getrandbits(32)), candidates))
                continue
            if r.mode == "hr":
                places = proposer.critique(secret, candidates, played, params.env.max_turns, r.hr_top)
                if not places:
                    counts["no_place_to_improve"] += 1
                    continue
                turn, proposal, _ = rng.choice(places)
                counts["proposed"] += 1
                emit(traj, turn, 0, proposal)
                continue
            turns = window(traj["num_turns"], *r.window)
            if not turns:
                counts["empty_window"] += 1
                continue
            for turn in sorted(rng.sample(turns, min(r.t, len(turns)))):
                counts["timesteps"] += 1
                sites.append((traj, turn, PlayerView(candidates, played[:turn], turn, params.env.max_turns)))

    metrics: dict = {}
    if llm and r.mode == "hr":
        gen = make_generator(role, params.cache.path)
        proposer_id = f"{role.backend}:{gen.model_id}"
        prompts = [chat("controller.j2", secret=t["task_id"], dialogue=dialogue(history(t)), top=r.hr_top) for t, _, _ in dialogues]
        parsers = [controller_parser(kb, kb.get(t["task_id"]), t, cands, params.env.max_turns, r.hr_top) for t, _, cands in dialogues]
        seeds = [derive_seed(role.seed, "controller", t["trajectory_id"]) for t, _, _ in dialogues]
        outcomes = call_parsed(gen, prompts, seeds, parsers, role_sampling(role), role.parse_attempts)
        for (traj, rng, _), outcome in zip(dialogues, outcomes):
            if outcome.status != "ok":
                emit(traj, None, 0, None, outcome.status, outcome.reason)
                continue
            place = rng.choice(outcome.value)  # HR: one of the named places, at random
            counts["proposed"] += 1
            # The critique uses hindsight and stays out of the action; HR's replacement is the
            # utterance alone, so the spliced action has an empty reason.
            emit(traj, place.turn, 0, Proposal(Action("", place.replacement), place.critique))
        metrics["calls"] = account(outcomes, gen)
    elif not llm:
        for traj, turn, view in sites:
            proposals = proposer.propose(kb.get(traj["task_id"]), view, r.n)
            counts["proposed"] += len(proposals)
            for rank, proposal in enumerate(proposals):
                emit(traj, turn, rank, proposal)
    else:
        gen = make_generator(role, params.cache.path)
        proposer_id = f"{role.backend}:{gen.model_id}"
        prompts, parsers, seeds = [], [], []  # each site's parser knows its secret and view, to catch leaks
        for traj, turn, view in sites:
            secret = kb.get(traj["task_id"])
            names = [e.name for e in view.candidates] if params.env.show_candidates else None
            prompts.append(chat("proposer.j2", n=r.n, summary=summary_of[traj["trajectory_id"]], history=dialogue(view.history), turn=turn, max_turns=params.env.max_turns, candidates=names))
            parsers.append(proposals_parser(kb, secret, view, r.n))
            seeds.append(derive_seed(role.seed, "relabel", traj["trajectory_id"], turn))
        outcomes = call_parsed(gen, prompts, seeds, parsers, role_sampling(role), role.parse_attempts) if sites else []
        for (traj, turn, _), outcome in zip(sites, outcomes):
            if outcome.status != "ok":
                emit(traj, turn, 0, None, outcome.status, outcome.reason)
                continue
            counts["proposed"] += len(outcome.value)
            seen: set[str] = set()
            for rank, p in enumerate(outcome.value):
                if p.question.lower() in seen:
                    counts["dropped_duplicate"] += 1  # the n proposals must be distinct
                    continue
                seen.add(p.question.lower())
                emit(traj, turn, rank, Proposal(Action(p.player_reason, p.question), p.teacher_reason))
        metrics["calls"] = account(outcomes, gen)

    rows.sort(key=lambda row: (row["trajectory_id"], row["branch_turn"] if row["branch_turn"] is not None else -1, row["rank"]))
    write_table(to_table(rows, "relabels"), out_dir / "relabels.parquet", "relabels")
    ok = sum(row["status"] == "ok" for row in rows)
    metrics = {"inputs": inputs.write(out_dir), "mode": r.mode, "relabels": ok, "not_proposed": len(rows) - ok, **dict(sorted(counts.items())), **metrics, "seconds": round(time.time() - t0, 1)}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    if "calls" in metrics:
        check_failure_rate("relabel", "proposer", role, metrics["calls"])
    return metrics

