"""stepagent_select: the StepAgent iteration whose policy plays the validation split best.

StepAgent does not say how its iteration is chosen (notes/stepagent.md 2.5: Implicit peaks after
3 iterations on WebShop, Inverse at 7, and both degrade after); as ETO, whose setup it follows,
the seen variations (the val split) choose. Each iteration's policy (1: the stepagent stage's,
K: data/iterationK/stepagent's) plays the val split with evaluate's sampling, episodes per task
and task limit, on the same episodes; the highest success rate wins, ties going to the higher
mean return, then to the earlier iteration (fewer updates away from the expert-taught base). The
winner is copied to out_dir/model, the policy evaluate plays as "stepagent". With one iteration
there is nothing to choose: it is copied without a game played, and metrics.json says so.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from storage.parquet import write_table
from storage.schema import to_table
from tasks.evaluate import Play, play_policy
from tasks.params import Params, stepagent_policy


def iteration_policies(params: Params) -> dict[int, Path]:
    """Every StepAgent iteration's policy, by iteration number."""
    return {k: Path(stepagent_policy(k)) for k in (1, *params.stepagent_iterations)}


def run_stepagent_select(params: Params, models: dict[int, Path], out_dir: Path) -> dict:
    """Writes out_dir/model (the chosen iteration's policy), out_dir/episodes.parquet (every
    iteration's val games) and out_dir/metrics.json."""
    t0 = time.time()
    if missing := [str(m) for m in models.values() if not (m / "config.json").exists()]:
        raise FileNotFoundError(f"stepagent_select: no policy at {', '.join(missing)}: run the stepagent stage and every stepagent_iteration first")
    figures: dict[str, dict] = {}
    rows: list[dict] = []
    if len(models) == 1:
        chosen, why = next(iter(models)), "one iteration: nothing to choose, no game played"
    else:
        val = params.model_copy(update={"evaluate": params.evaluate.model_copy(update={"splits": ["val"]})})
        for k, model in models.items():
            played = play_policy(val, Play(f"stepagent_iteration{k}", model))
            figures[str(k)] = {"model": str(model), **played.result["val"]}
            rows += [ep.to_row() for ep in played.episodes]
        chosen = max(models, key=lambda k: (figures[str(k)]["success_rate"], figures[str(k)]["mean_return"], -k))
        why = "the highest val success rate (ties: mean return, then the earlier iteration)"
    rows.sort(key=lambda r: (r["policy_id"], r["split"], r["task_id"], r["seed"]))
    out_dir.mkdir(parents=True, exist_ok=True)
    write_table(to_table(rows, "trajectories"), out_dir / "episodes.parquet", "trajectories")
    shutil.rmtree(out_dir / "model", ignore_errors=True)
    shutil.copytree(models[chosen], out_dir / "model")
    metrics = {"iterations": figures or {str(chosen): {"model": str(models[chosen])}}, "chosen": chosen, "model": str(models[chosen]),
               "why": why, "seconds": round(time.time() - t0, 1)}
    print(f"stepagent_select: iteration {chosen} ({models[chosen]}): {why}", flush=True)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics
