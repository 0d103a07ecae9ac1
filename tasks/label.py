"""label (reward labeling): one reward per original and regenerated trajectory.

The environment's logged return and the labelled reward are separate columns, so an LLM labeler
can be measured against the ground truth wherever one exists (calibration in the metrics). The
oracle labeler replays the actions; an LLM labeler follows HR's recipe: the task's description,
`few_shot` labelled games sampled uniformly from the original trajectories, then the game to
label (the environment's labeler prompt); or Refit's rubric judge (its judge prompt: criteria
scored 0-10 and an Overall score, the reward being Overall / 10, as Refit rescales it). A
rubric's scores, the LLM judge's or an oracle judge's (the QA teacher's), go into the `scores`
column; Overall is read, not recomputed, and metrics.json's `rubric_check` says how far it
departs from the mean of the other criteria. A trajectory that cannot be labelled keeps a null
reward with its status and reason.

Where the environment's few-shot labeler has HR's two steps (`finished_request`: persuasion), they
are two calls: step 1 asks whether the dialogue is finished, and only a finished one is asked
step 2, its amount (`amount_request`). One judged unfinished gets status "unfinished" and no
reward, without being asked again: HR discards such dialogues (standardize leaves them out as
no_reward). Environments without step 1 keep the one call (`labeler_request`).
"""
from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from envs.base import Environment
from storage.parquet import write_table
from storage.schema import from_table, to_table
from storage.validate import StageInputs
from tasks.params import Params
from tasks.plots import histogram, write_plot
from tasks.roles import Outcome, account, call_requests, check_failure_rate, make_generator
from tasks.rollout import derive_seed


def _oracle_labels(env: Environment, trajs: list[dict]) -> list[tuple[float | None, str, str | None, str | None]]:
    out = []
    for t in trajs:
        label = env.label(t["task_id"], t["turns"])
        reason = label.reason
        if label.reward is not None and t["return"] is not None and t["return"] != label.reward:
            reason += f" (the logged return was {t['return']:g})"
        out.append((label.reward, "ok" if label.reward is not None else "failed", reason, json.dumps(dict(label.scores)) if label.scores else None))
    return out


def _llm_labels(params: Params, env: Environment, trajs: list[dict], gen) -> tuple[list[tuple[float | None, str, str | None, str | None]], dict]:
    role = params.roles.labeler
    if role.mode == "rubric":
        # Refit's judge: criteria scored 0-10, then Overall; the reward is Overall / 10.
        requests = [env.judge_request(t["task_id"], t["turns"]) for t in trajs]
        seeds = [derive_seed(role.seed, "judge", t["trajectory_id"]) for t in trajs]
        outcomes = call_requests(gen, requests, seeds, role)
        labels = [(o.value["Overall"] / 10, o.status, o.reason, json.dumps(o.value)) if o.status == "ok" else (None, o.status, o.reason, None) for o in outcomes]
        return labels, account(outcomes, gen)
    # HR's few-shot labeler; the examples come from the original (logged) trajectories.
    pool = [t for t in trajs if t["source"] != "regeneration" and t["return"] is not None]
    shots_of, seeds = [], []
    for t in trajs:
        rng = random.Random(derive_seed(role.seed, "label-shots", t["trajectory_id"]))
        others = [p for p in pool if p["trajectory_id"] != t["trajectory_id"]]
        shots = rng.sample(others, min(role.few_shot, len(others)))
        shots_of.append([(s["turns"], s["return"]) for s in shots])
        seeds.append(derive_seed(role.seed, "label", t["trajectory_id"]))
    step1 = [env.finished_request(t["turns"], shots) for t, shots in zip(trajs, shots_of)]
    if any(r is None for r in step1):  # one call: the environment's labeler has no step 1
        outcomes = call_requests(gen, [env.labeler_request(t["turns"], shots) for t, shots in zip(trajs, shots_of)], seeds, role)
        return [(o.value, o.status, o.reason, None) for o in outcomes], account(outcomes, gen)
    return _two_step_labels(role, env, trajs, shots_of, seeds, step1, gen)


def _two_step_labels(role, env: Environment, trajs: list[dict], shots_of: list, seeds: list[int], step1: list, gen) -> tuple[list, dict]:
    """HR's donation labeler: step 1 (finished?) for every trajectory, step 2 (the amount) only
    for those found finished. A trajectory's outcome is its last step's: step 1's when it did not
    say finished (unfinished, invalid or failed), else step 2's."""
    first = call_requests(gen, step1, [derive_seed(s, "finished") for s in seeds], role)
    finished = [i for i, o in enumerate(first) if o.status == "ok" and o.value]
    second = call_requests(gen, [env.amount_request(trajs[i]["turns"], shots_of[i]) for i in finished], [seeds[i] for i in finished], role)
    final = list(first)
    for i, o in zip(finished, second):
        final[i] = replace(o, attempts=first[i].attempts + o.attempts)
    for i, o in enumerate(first):
        if o.status == "ok" and not o.value:
            final[i] = Outcome("unfinished", None, o.text, o.attempts, "the labeler judged the dialogue unfinished (step 1: no donation decision)")
    calls = {**account(final, gen), "steps": {"finished": account(first), "amount": account(second)}}
    return [(o.value, o.status, o.reason, None) for o in final], calls


def rubric_check(rows: list[dict]) -> dict | None:
    """A rubric judge's Overall against the mean of its other criteria, over the rows it scored:
    Overall is parsed, never recomputed (Refit's judge departs from the mean), and this says how
    far it departs. None when no row has rubric scores."""
    scored = [json.loads(r["scores"]) for r in rows if r["scores"]]
    if not scored:
        return None
    gaps = [s["Overall"] - sum(v for k, v in s.items() if k != "Overall") / (len(s) - 1) for s in scored]
    return {
        "scored": len(gaps),
        "mean_overall_minus_mean_of_criteria": round(sum(gaps) / len(gaps), 4),
        "mean_abs_gap": round(sum(abs(g) for g in gaps) / len(gaps), 4),
        "overall_is_the_mean": round(sum(abs(g) < 0.05 for g in gaps) / len(gaps), 4),  # to the judge's one decimal
    }


@dataclass(frozen=True)
class Scale:
    """What a labelled reward is measured on: a rubric judge's [0, 1], or the environment's returns."""

    low: float
    high: float
    bin: float  # histogram bin width
    won: Callable[[float], bool]  # whether a reward alone reads as a win
    rubric: bool = False


RUBRIC = Scale(0.0, 1.0, 0.1, lambda r: r >= 0.5, rubric=True)


def return_scale(env: Environment) -> Scale:
    return Scale(*env.reward_range, env.reward_bin, env.won)


def calibration(rows: list[dict], scale: Scale) -> dict:
    """Labelled reward against the environment's, where both exist: Pearson correlation, mean
    absolute error (when both are on the environment's scale) and agreement on success."""
    pairs = [(r["env_reward"], r["reward"], r["env_success"]) for r in rows if r["reward"] is not None and r["env_reward"] is not None]
    if not pairs:
        return {"pairs": 0}
    env, lab = [p[0] for p in pairs], [p[1] for p in pairs]
    n, me, ml = len(pairs), sum(env) / len(env), sum(lab) / len(lab)
    cov = sum((a - me) * (b - ml) for a, b in zip(env, lab))
    se, sl = math.sqrt(sum((a - me) ** 2 for a in env)), math.sqrt(sum((b - ml) ** 2 for b in lab))
    return {
        "pairs": n,
        "pearson": round(cov / (se * sl), 4) if se > 0 and sl > 0 else None,  # undefined when either side is constant
        "mae": round(sum(abs(a - b) for a, b in zip(env, lab)) / n, 4) if not scale.rubric else None,
        "success_agreement": round(sum(scale.won(b) == bool(s) for _, b, s in pairs) / n, 4),
    }


def reward_histograms(rows: list[dict], scale: Scale) -> dict[str, list[dict]]:
    """The labelled reward before and after hindsight, over the same bins: the logged
    trajectories alone (`reward_logged`) and with the regenerations (`reward_with_hindsight`),
    across the scale's range (TwentyQuestions' returns: unit bins on [-max_turns, 0]; a rubric
    reward: bins of 0.1 on [0, 1]). Null rewards are left out (metrics.json counts them by status)."""
    every = [r["reward"] for r in rows]
    finite = [v for v in every if v is not None and math.isfinite(v)]
    lo, hi = min([scale.low, *finite]), max([scale.high, *finite])  # both histograms get the same bins
    logged = [r["reward"] for r in rows if r["source"] != "regeneration"]
    return {
        "reward_logged": histogram(logged, "reward", scale.bin, lo, hi),
        "reward_with_hindsight": histogram(every, "reward", scale.bin, lo, hi),
    }


def label_trajectories(params: Params, env: Environment, trajs: list[dict]) -> tuple[list[tuple], dict | None, str, str]:
    """Each trajectory's (reward, status, reason, scores) by roles.labeler, the LLM calls' account
    (None for the oracle), and the labeler's model and prompt hash. StepDPO's branches are judged
    here too, by the same judge as the logged trajectories (tasks/train/step_dpo.py)."""
    role = params.roles.labeler
    if role.backend == "oracle":
        version = env.oracle_version("labeler")
        return _oracle_labels(env, trajs), None, version, version
    gen = make_generator(role, params.cache.path)
    labels, calls = _llm_labels(params, env, trajs, gen)
    return labels, calls, gen.model_id, env.prompt_hash("judge" if role.mode == "rubric" else "labeler")


def run_label(params: Params, trajectory_files: list[Path], out_dir: Path) -> dict:
    """Labels every row of every trajectories table given; writes labels.parquet, metrics.json and
    the reward histograms plots/reward_logged.json and plots/reward_with_hindsight.json."""
    t0 = time.time()
    role = params.roles.labeler
    inputs = StageInputs()
    trajs = [t for path in trajectory_files for t in from_table(inputs.read(path, "trajectories"))]
    ids = Counter(t["trajectory_id"] for t in trajs)
    dup = next((i for i, c in ids.items() if c > 1), None)
    if dup:
        raise ValueError(f"trajectory {dup} appears in more than one input table; labels are keyed by trajectory_id")
    env = params.env.environment()
    labels, calls, model, prompt_hash = label_trajectories(params, env, trajs)
    rows = [
        {
            "trajectory_id": t["trajectory_id"],
            "task_id": t["task_id"],
            "source": t["source"],
            "env_reward": t["return"],
            "env_success": t["success"],
            "reward": reward,
            "labeler": role.backend,
            "model": model,
            "prompt_hash": prompt_hash,
            "scores": scores,
            "status": status,
            "reason": reason or "",
        }
        for t, (reward, status, reason, scores) in zip(trajs, labels)
    ]
    rows.sort(key=lambda r: r["trajectory_id"])
    write_table(to_table(rows, "labels"), out_dir / "labels.parquet", "labels")
    by_source = Counter(r["source"] for r in rows)
    ok = [r for r in rows if r["status"] == "ok"]
    scale = RUBRIC if role.backend != "oracle" and role.mode == "rubric" else return_scale(env)
    for name, hist in reward_histograms(rows, scale).items():
        write_plot(hist, out_dir / "plots" / f"{name}.json")
    metrics = {
        "inputs": inputs.write(out_dir),
        "labels": len(rows),
        "by_source": dict(sorted(by_source.items())),
        "status": dict(sorted(Counter(r["status"] for r in rows).items())),
        "logged_return_mismatches": sum(r["reward"] is not None and r["env_reward"] is not None and r["reward"] != r["env_reward"] for r in rows),
        "mean_reward": {s: _mean([r["reward"] for r in ok if r["source"] == s]) for s in sorted(by_source)},
        "success_rate": {s: round(sum(scale.won(r["reward"]) for r in ok if r["source"] == s) / by_source[s], 4) for s in sorted(by_source)},
        "calibration": calibration(rows, scale),
        **({"rubric_check": check} if (check := rubric_check(rows)) else {}),
        **({"calls": calls} if calls else {}),
        "seconds": round(time.time() - t0, 1),
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    if calls:
        check_failure_rate("label", "labeler", role, calls)
    return metrics


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None
