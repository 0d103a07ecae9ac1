"""buffer: HOPE's replay buffer G(s, a) and the critic's Monte Carlo targets (HOPE Eq. 3).

Every (state, action) pair of the logged trajectories and their hindsight regenerations is keyed
by the exact serialised state (the chat messages before the action) and action (the agent's
message). A regeneration copies its parent's messages up to the branch, so the pairs before the
branch are the parent's own pairs and gather both trajectories' returns, as HOPE's G(s, a) does.

- target_raw: Eq. 3, the mean over the trajectories through the pair of the discounted
  return-to-go sum_{k>=t} gamma^(k-t) r_k of the environment's per-turn rewards (turns[].reward).
- target: the value the critic learns, in [0, 1] (`buffer.target`; HOPE leaves the map open):
  - outcome: the reference code's, per trajectory 0.5 * (1 + gamma^(T-1-t) * o) with o = +1 for
    a won game and -1 for a lost one, T its number of turns; averaged over the pair's trajectories.
    A pair on a winning path scores at least 0.5 and one on a losing path below 0.5.
  - return_range: target_raw mapped from the environment's reward range [lo, hi] onto [0, 1].
  The environment's rewards are the targets' source: a labeler's reward (label stage) does not
  enter them.
- source: on-policy when a logged trajectory (collected or imported) passes through the pair,
  hindsight when only regenerations do (the counterfactual action and what follows it).
- selected: the pairs the critic trains on (HOPE 2.6): `size` of them, a `low_share` of the
  size with target < 0.5 and the rest >= 0.5. The low half takes on-policy pairs first and
  hindsight pairs only to fill it; `alpha` of the high half comes from hindsight pairs (HOPE:
  0.4 for 20Q) and the rest from on-policy ones, a short source filled from the other (alpha
  null: the high half drawn from both alike). alpha = 0 is PRM+RL's buffer: regenerations are
  left out before any pair is built, so no hindsight return enters a target either. When one half has fewer pairs
  than its share, the other half is cut to keep the share: the balance is what keeps a critic
  from predicting the majority value. When one half is empty (every game lost, or every one
  won), `size` pairs are drawn without balance and metrics.json says `unbalanced`. Draws are
  seeded; metrics say what each half had.
"""
from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path

from storage.parquet import write_table
from storage.schema import from_table, stored_message, to_table
from storage.validate import StageInputs
from tasks.params import Params
from tasks.rollout import action_starts, derive_seed

LOGGED_SOURCES = ("policy", "import")


def digest(value: object) -> str:
    """sha256 of a value serialised as canonical JSON."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()


def pair_key(prompt: list[dict], action: dict) -> str:
    """The pair's identity: sha256 of the serialised state and action (as HOPE's code keys it)."""
    return digest({"state": prompt, "action": action})


def returns_to_go(rewards: list[float], gamma: float) -> list[float]:
    """sum_{k>=t} gamma^(k-t) r_k for every t."""
    out, g = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        g = rewards[t] + gamma * g
        out[t] = g
    return out


def build_pairs(trajectories: list[dict], gamma: float, target: str, reward_range: tuple[float, float]) -> list[dict]:
    """One row per distinct (state, action) pair, sorted by key, with Eq. 3's target and the
    normalised one; `selected` is left to select()."""
    lo, hi = reward_range
    pairs: dict[str, dict] = {}
    for traj in sorted(trajectories, key=lambda t: t["trajectory_id"]):
        messages, turns = traj["messages"], traj["turns"]
        rewards = [t["reward"] for t in turns]
        if any(r is None for r in rewards):
            raise ValueError(f"trajectory {traj['trajectory_id']}: a turn without a reward; the buffer's targets need the environment's per-turn rewards")
        starts = action_starts(messages)
        if len(starts) != len(turns):
            raise ValueError(f"trajectory {traj['trajectory_id']}: {len(turns)} turns but {len(starts)} agent messages")
        rtg = returns_to_go(rewards, gamma)
        big_t = len(turns)
        outcome = 1.0 if traj["success"] else -1.0
        logged = traj["source"] in LOGGED_SOURCES
        for t, start in enumerate(starts):
            prompt = [stored_message(m) for m in messages[:start]]
            action = stored_message(messages[start])
            key = pair_key(prompt, action)
            p = pairs.get(key)
            if p is None:
                p = pairs[key] = {"key": key, "prompt": prompt, "action": action, "turn": turns[t]["turn"], "returns": [], "values": [], "trajectory_ids": [], "logged": False}
            p["returns"].append(rtg[t])
            p["values"].append(0.5 * (1.0 + gamma ** (big_t - 1 - t) * outcome))
            p["trajectory_ids"].append(traj["trajectory_id"])
            p["logged"] |= logged
    rows = []
    for key in sorted(pairs):
        p = pairs[key]
        raw = sum(p["returns"]) / len(p["returns"])
        if target == "outcome":
            value = sum(p["values"]) / len(p["values"])
        else:
            if not lo - 1e-9 <= raw <= hi + 1e-9:
                raise ValueError(f"pair {key} (trajectories {', '.join(p['trajectory_ids'])}): return-to-go {raw} outside the environment's reward range [{lo}, {hi}]; use buffer.target: outcome")
            value = min(1.0, max(0.0, (raw - lo) / (hi - lo)))
        rows.append({
            "key": key, "prompt": p["prompt"], "action": p["action"], "turn": p["turn"], "target_raw": raw, "target": value,
            "count": len(p["trajectory_ids"]), "source": "on-policy" if p["logged"] else "hindsight",
            "trajectory_ids": p["trajectory_ids"], "selected": False,
        })
    return rows


def _draw(pool: list[dict], n: int, rng: random.Random) -> list[dict]:
    return rng.sample(pool, min(n, len(pool)))


def select(rows: list[dict], size: int, low_share: float | None, alpha: float | None, seed: int) -> dict:
    """Marks the critic's pairs (`selected`) as the module docstring says; returns the counts."""
    rng = random.Random(seed)
    if low_share is None:
        chosen = _draw(rows, size, rng)
        for r in chosen:
            r["selected"] = True
        return {"available": len(rows), "selected": len(chosen)}
    by = {(half, src): [r for r in rows if (r["target"] < 0.5) == (half == "low") and r["source"] == src] for half in ("low", "high") for src in ("on-policy", "hindsight")}
    have = {half: len(by[half, "on-policy"]) + len(by[half, "hindsight"]) for half in ("low", "high")}
    want_low, want_high = round(size * low_share), size - round(size * low_share)
    if not have["low"] or not have["high"]:
        # One side is empty (every game lost, or every one won): no share can hold, and cutting
        # would leave nothing. The pairs there are drawn unbalanced and the metrics say so.
        chosen = _draw(rows, size, rng)
        for r in chosen:
            r["selected"] = True
        empty = "low" if not have["low"] else "high"
        return {"available": {f"{h}_{s}": len(v) for (h, s), v in by.items()}, "selected": len(chosen), "unbalanced": f"no pair in the {empty} half"}
    # The share holds: a short half cuts the other.
    scale = min(1.0, have["low"] / want_low if want_low else 1.0, have["high"] / want_high if want_high else 1.0)
    n_low, n_high = int(want_low * scale), int(want_high * scale)
    low = _draw(by["low", "on-policy"], n_low, rng)
    low += _draw(by["low", "hindsight"], n_low - len(low), rng)
    if alpha is None:  # no share: the high half drawn from both sources alike
        high = _draw(by["high", "on-policy"] + by["high", "hindsight"], n_high, rng)
    else:
        n_hind = min(round(n_high * alpha), len(by["high", "hindsight"]))
        high = _draw(by["high", "on-policy"], n_high - n_hind, rng)
        high += _draw(by["high", "hindsight"], n_high - len(high), rng)  # on-policy short: hindsight fills
    for r in low + high:
        r["selected"] = True
    return {
        "available": {f"{half}_{src}": len(by[half, src]) for half, src in by},
        "selected": {"low": len(low), "high": len(high), "high_hindsight": sum(r["source"] == "hindsight" for r in high)},
        "cut_to_keep_share": scale < 1.0,
    }


def balance_note(counts: dict, pairs: int, low_share: float | None) -> str | None:
    """What the balance did to the selection, when it left out pairs a user would expect in it."""
    if "unbalanced" in counts:
        return f"{counts['selected']} of {pairs} pairs selected without balance: {counts['unbalanced']}"
    if not counts.get("cut_to_keep_share"):
        return None
    have = {h: counts["available"][f"{h}_on-policy"] + counts["available"][f"{h}_hindsight"] for h in ("low", "high")}
    short = min(have, key=lambda h: have[h] / (low_share if h == "low" else 1 - low_share))
    n = counts["selected"]["low"] + counts["selected"]["high"]
    return (f"{n} of {pairs} pairs selected: the {short} half (target {'<' if short == 'low' else '>='} 0.5) has {have[short]}, "
            f"so the other half was cut to keep low_share = {low_share:g}")


def run_buffer(params: Params, trajectory_files: list[Path], out_dir: Path) -> dict:
    """Writes out_dir/pairs.parquet, out_dir/quarantine.parquet and out_dir/metrics.json."""
    t0 = time.time()
    b, env = params.buffer, params.env.environment()
    inputs = StageInputs()
    trajs = [t for path in trajectory_files for t in from_table(inputs.read(path, "trajectories")) if t["split"] in b.splits]
    if b.alpha == 0:
        trajs = [t for t in trajs if t["source"] in LOGGED_SOURCES]
    rows = build_pairs(trajs, b.gamma, b.target, env.reward_range)
    counts = select(rows, b.size, b.low_share, b.alpha, derive_seed(params.seed, "buffer"))
    if note := balance_note(counts, len(rows), b.low_share):
        print(f"buffer: {note}", flush=True)
    write_table(to_table(rows, "pairs"), out_dir / "pairs.parquet", "pairs")
    chosen = [r for r in rows if r["selected"]]
    metrics = {
        "inputs": inputs.write(out_dir),
        "trajectories": {"on-policy": sum(t["source"] in LOGGED_SOURCES for t in trajs), "hindsight": sum(t["source"] not in LOGGED_SOURCES for t in trajs)},
        "pairs": len(rows),
        "pairs_by_source": {s: sum(r["source"] == s for r in rows) for s in ("on-policy", "hindsight")},
        "shared_pairs": sum(r["count"] > 1 for r in rows),
        "selection": counts,
        "selected_target_mean": round(sum(r["target"] for r in chosen) / len(chosen), 4) if chosen else None,
        "gamma": b.gamma,
        "target": b.target,
        "seconds": round(time.time() - t0, 1),
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics
