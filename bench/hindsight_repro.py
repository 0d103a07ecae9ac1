"""The miniature reproductions: held-out success and return over seeds, arm against arm.

    python bench/hindsight_repro.py [--preset bench/presets/hope_20q.yaml] [--seeds 0 1 2]
                                    [--out bench/out/repro] [--set relabel.n=2 ...] [--stepagent | --qa | --nlac]

For each seed, runs every stage (bootstrap -> collect -> forward -> summarize -> relabel ->
regenerate -> label -> standardize -> HOPE's buffer, critic and actor, and again without
hindsight (PRM+RL) -> train -> evaluate) with params.yaml, the preset (a params file laid over
it, key by key; its train.methods, the arms, replaces params.yaml's) and the overrides, through
the same stage functions `retrosight run` calls. It prints, per policy (the base and every method of train.methods): success and mean return on each
evaluated split as mean ± standard error over seeds; and for each hindsight arm, its difference
from its logged-only arm (same algorithm, `data: logged`; Swift, which has none, against Refit's)
with a paired 95% interval over the same evaluation episodes of every seed, and every policy's
difference from the base on the held-out episodes the same way. --results writes that
table as JSON, the points of the plot of success by arm and seed, and the plot itself as SVG.
A seed whose evaluation is already on disk is read back rather than rerun (--fresh reruns it), and
a stopped seed resumes after its last finished stage. --results also keeps each finished seed's
params, metrics and episode outcomes (RESULTS/seeds/seedN.json), and a seed found there with the
same params, whose run directory is gone, is read back too: seeds run in different sessions, or
on different machines, add up to one table without the earlier seeds' run directories.
--upstream DIR reuses DIR/seedN's bootstrap, collect and summarize outputs, so a hindsight or training setting can be
varied without paying for the base policy and the logged data again; --reuse names other stages
to take from DIR (with `--reuse ... train --set "evaluate.splits=[train]"`, the same trained
policies play the train tasks their data came from). --base DIR gives every seed the same base
policy (a bootstrap stage's output, trained there first with seed 0's params when DIR has none
and a seed is to run; --base alone: bench/out/base/<preset's name>),
so seeds vary the logged data, hindsight, training and evaluation episodes around one base.
--no-actor-critic leaves HOPE's buffer, critic and actor out (HR's miniature,
bench/presets/hr_persuasion.yaml, compares training arms only). --stepagent runs StepAgent's
miniature instead of hindsight and HOPE's actor-critic: bootstrap -> collect -> label ->
standardize -> expert -> practice -> StepAgent-Implicit and -Inverse from the same practice pairs
-> train (the preset's arms: RFT, ETO) -> evaluate, StepAgent's variants measured against ETO. --qa runs Refit/Swift's
miniature on the QA teacher (bench/presets/refit_swift_qa.yaml): bootstrap -> collect (three
temperatures) -> label (the judge) -> standardize -> train (Refit, Swift and their baselines;
StepDPO rolls its branches out inside train) -> evaluate, each arm measured against the next in the
paper's order (QA_AGAINST), exact-match accuracy as success and the judge's score as return. --nlac runs NLAC's miniature: bootstrap, then each arm
(NLAC, and the preset's train.methods: its baselines RFT, GRPO and PPO) runs the preset's
nlac_iterations (their count; each collects with the arm's current policy, then trains NLAC's L1 and
L2 or the baseline's method on its games) from the same base into d/<arm>/iterationK, every arm at
nlac.steps optimizer steps an iteration (the baselines' gradient_steps are held to it), then evaluate;
every arm is measured against GRPO, and the table keeps each arm's iterations (steps, success on its
games, NLAC's L1, L2 and critic accuracy). With roles.forward.backend
learned, each seed's forward stage trains HR's forward models on its own logged dialogues and
regenerate uses them.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flows.report import ARM_SEED_TEMPLATE, arm_seed_spec  # noqa: E402
from tasks.evaluate import mean_se  # noqa: E402
from tasks.params import Params, lay_preset, read_preset  # noqa: E402

STAGES = ["bootstrap", "collect", "forward", "summarize", "relabel", "regenerate", "label", "standardize", "buffer", "critic", "actor", "buffer_prm",
          "critic_prm", "actor_prm", "expert", "practice", "stepagent", "stepagent_inverse", "train", "evaluate"]


def override(raw: dict, assignment: str) -> None:
    """key.path=value, the value parsed as YAML (so numbers, lists and null work)."""
    key, _, value = assignment.partition("=")
    *path, last = key.split(".")
    node = raw
    for part in path:
        node = node.setdefault(part, {})
    node[last] = yaml.safe_load(value)


UPSTREAM = ["bootstrap", "collect", "summarize"]
DEFAULT_BASE = Path("<default>")  # --base with no DIR: bench/out/base/<preset's name>
ACTOR_CRITIC = ("buffer", "critic", "actor", "buffer_prm", "critic_prm", "actor_prm")
STEPAGENT = ("expert", "practice", "stepagent", "stepagent_inverse")
# StepAgent's miniature needs no hindsight: RFT and ETO learn from the logged games as collected
HINDSIGHT = ("forward", "summarize", "relabel", "regenerate")
# Refit/Swift's QA miniature: each arm against the one after it in the paper's order (its twelve
# reasoning experiments: Swift 0.660 >= Refit 0.638 > STaR-GATE 0.607 > STaR-GATE-D 0.570, DPO and
# StepDPO 0.525 > base 0.316); STaR-GATE-D against the policy it distils. Every arm is also against
# the base (versus_base).
QA_AGAINST = {"swift": "refit", "refit": "star_gate", "star_gate": "dpo", "star_gate_d": "star_gate", "dpo": "bootstrap", "step_dpo": "bootstrap"}


def run_seed(params: Params, d: Path, upstream: Path | None = None, reuse: list[str] = UPSTREAM, base: Path | None = None,
             skip: tuple[str, ...] = STEPAGENT) -> dict:
    from tasks.actor import run_actor
    from tasks.bootstrap import run_bootstrap
    from tasks.buffer import run_buffer
    from tasks.collect import run_collect
    from tasks.critic import run_critic
    from tasks.evaluate import run_evaluate
    from tasks.expert import run_expert
    from tasks.forward import run_forward
    from tasks.label import run_label
    from tasks.practice import run_practice
    from tasks.regenerate import run_regenerate
    from tasks.relabel import run_relabel
    from tasks.standardize import run_standardize
    from tasks.stepagent import run_stepagent
    from tasks.summarize import run_summarize
    from tasks.train import run_train

    trajectories = [d / "collect/trajectories.parquet", *([] if "regenerate" in skip else [d / "regenerate/trajectories.parquet"])]
    inverse = params.model_copy(update={"stepagent": params.stepagent.model_copy(update={"variant": "inverse"})})
    prm = params.model_copy(update={
        "buffer": params.buffer.model_copy(update={"alpha": 0.0}),
        "actor": params.actor.model_copy(update={"critic": str(d / "critic_prm/model")}),
    })
    steps = {
        "bootstrap": lambda: run_bootstrap(params, d / "bootstrap"),
        "collect": lambda: run_collect(params, d / "bootstrap/model", d / "collect"),
        "forward": lambda: run_forward(params, trajectories[0], d / "forward"),  # a note only, unless roles.forward is learned
        "summarize": lambda: run_summarize(params, trajectories[0], d / "summarize"),
        "relabel": lambda: run_relabel(params, trajectories[0], d / "summarize/summaries.parquet", d / "relabel"),
        "regenerate": lambda: run_regenerate(params, trajectories[0], d / "relabel/relabels.parquet", d / "bootstrap/model", d / "regenerate"),
        "label": lambda: run_label(params, trajectories, d / "label"),
        "standardize": lambda: run_standardize(params, trajectories, d / "label/labels.parquet", d / "standardize"),
        "buffer": lambda: run_buffer(params, trajectories, d / "buffer"),
        "critic": lambda: run_critic(params, d / "buffer/pairs.parquet", d / "critic", d / "critic_checkpoints"),  # resumes mid-training
        "actor": lambda: run_actor(params, d / "buffer/pairs.parquet", trajectories, d / "summarize/summaries.parquet", d / "actor"),
        # PRM+RL (HOPE's baseline): the same critic and actor on a buffer without hindsight (alpha 0)
        "buffer_prm": lambda: run_buffer(prm, trajectories, d / "buffer_prm"),
        "critic_prm": lambda: run_critic(prm, d / "buffer_prm/pairs.parquet", d / "critic_prm", d / "critic_prm_checkpoints"),
        "actor_prm": lambda: run_actor(prm, d / "buffer_prm/pairs.parquet", trajectories, d / "summarize/summaries.parquet", d / "actor_prm"),
        # StepAgent: the expert's trajectories, practice at their prefixes, Implicit and Inverse from the same pairs
        "expert": lambda: run_expert(params, d / "expert"),
        "practice": lambda: run_practice(params, d / "expert/trajectories.parquet", d / "practice"),
        "stepagent": lambda: run_stepagent(params, d / "practice/pairs.parquet", d / "stepagent"),
        "stepagent_inverse": lambda: run_stepagent(inverse, d / "practice/pairs.parquet", d / "stepagent_inverse"),
        # with checkpoints, a seed stopped mid-train resumes each method where it stopped (the longest stage)
        "train": lambda: run_train(params, d / "standardize/train.parquet", d / "train", d / "train_checkpoints",
                                   relabels=d / "relabel/relabels.parquet", trajectories=trajectories[0],
                                   expert=d / "expert/trajectories.parquet" if "expert" not in skip else None),
        "evaluate": lambda: run_evaluate(params, d / "train", d / "evaluate", d / "evaluate_checkpoints"),  # resumes policy by policy
    }
    return run_stages(params.seed, d, [s for s in STAGES if s not in skip], steps, upstream, reuse, base)


def run_stages(seed: int, d: Path, order: list[str], steps: dict, upstream: Path | None, reuse: list[str], base: Path | None) -> dict:
    """Runs the stages in order, each into d/<stage> (a stage may be a path, d/<arm>/iterationK),
    skipping those finished earlier; returns evaluate's metrics."""
    for stage in order:
        if stage == "bootstrap" and base is not None:
            shutil.copytree(base, d / stage, dirs_exist_ok=True)
            continue
        if upstream is not None and stage in reuse:
            shutil.copytree(upstream / stage, d / stage, dirs_exist_ok=True)
            continue
        done = d / stage / ".finished"  # a stopped run resumes after its last finished stage
        if done.exists():
            print(f"[seed {seed}] {stage} finished earlier, kept", flush=True)
            continue
        t0 = time.time()
        steps[stage]()
        done.parent.mkdir(parents=True, exist_ok=True)
        done.write_text(f"{time.time() - t0:.0f} s\n")
        print(f"[seed {seed}] {stage} done in {time.time() - t0:.0f}s", flush=True)
    return json.loads((d / "evaluate/metrics.json").read_text())


def nlac_arms(params: Params) -> dict[str, str]:
    """NLAC's miniature's arms, each by its nlac.algorithm: nlac, then train.methods, NLAC's
    baselines (RFT, GRPO, PPO: rft, grpo, ppo_returns), in params order."""
    from tasks.params import NLAC_BASELINES

    by_method = {method: name for name, method in NLAC_BASELINES.items()}
    wrong = {name: m.algorithm for name, m in params.train.methods.items() if m.algorithm not in by_method}
    if wrong or "nlac" in params.train.methods:
        sys.exit(f"--nlac: train.methods are NLAC's baselines ({', '.join(by_method)}; none named nlac), got {wrong or 'nlac'}")
    return {"nlac": "nlac", **{name: by_method[m.algorithm] for name, m in params.train.methods.items()}}


def run_nlac_seed(params: Params, d: Path, iterations: int, base: Path | None = None) -> dict:
    """NLAC's miniature for one seed: bootstrap, then every arm's `iterations` NLAC iterations from
    the seed's base (d/<arm>/iterationK/nlac, its games in nlac_collect; a baseline arm trains its
    method on each iteration's games instead of L1 and L2), then evaluate plays the base and every
    arm's last policy."""
    from tasks.bootstrap import run_bootstrap
    from tasks.evaluate import run_evaluate
    from tasks.nlac import run_nlac_iteration
    from tasks.params import NlacParams

    arms = nlac_arms(params)
    first = d / "bootstrap/model"

    def iteration(arm: str, k: int) -> None:
        method = None if arm == "nlac" else params.train.methods[arm].model_dump()
        nlac = NlacParams.model_validate({**params.nlac.model_dump(), "algorithm": arms[arm], "method": method})
        previous = d / arm / f"iteration{k - 1}/nlac" if k > 1 else None
        run_nlac_iteration(params.model_copy(update={"nlac": nlac}), k, d / arm / f"iteration{k}/nlac", d / arm / f"iteration{k}/nlac_collect",
                           policy=previous / "model" if previous else first, previous=previous, base=first)

    def evaluate() -> None:
        # evaluate plays train.methods from <train_dir>/models/<name>: each baseline arm's last policy, linked there
        models = d / "arms/models"
        models.mkdir(parents=True, exist_ok=True)
        for arm in params.train.methods:
            link = models / arm
            link.unlink(missing_ok=True)
            link.symlink_to(os.path.relpath(d / arm / f"iteration{iterations}/nlac/model", models))
        run_evaluate(params, d / "arms", d / "evaluate", d / "evaluate_checkpoints")

    steps = {"bootstrap": lambda: run_bootstrap(params, d / "bootstrap"), "evaluate": evaluate}
    order = ["bootstrap"]
    for arm in arms:
        for k in range(1, iterations + 1):
            steps[f"{arm}/iteration{k}"] = lambda arm=arm, k=k: iteration(arm, k)
            order.append(f"{arm}/iteration{k}")
    return run_stages(params.seed, d, [*order, "evaluate"], steps, None, [], base)


def nlac_training(d: Path, arms: list[str], iterations: int) -> dict:
    """Each arm's iterations as their metrics.json tell them: the games they collected, the
    optimizer steps they took, and NLAC's losses, critique shares and critic accuracy."""
    keep = ("success_on_collect", "seconds", "first_l1", "final_l1", "first_l2", "final_l2", "optimality_no_share",
            "target_optimality_no_share", "refined_changed_share", "critic_accuracy")
    out = {}
    for arm in arms:
        out[arm] = []
        for k in range(1, iterations + 1):
            m = json.loads((d / arm / f"iteration{k}/nlac/metrics.json").read_text())
            # an NLAC step is Algorithm 1's lines 8-10 on a drawn batch (its L1 and its L2 update)
            out[arm].append({"steps": m["steps"] if arm == "nlac" else m["optimizer_steps"], **{key: m[key] for key in keep if key in m}})
    return out


def make_base(base: Path, raw: dict) -> None:
    """--base DIR: one base policy for every seed, trained there with seed 0's params when DIR has
    none (so a run of any seeds, in any session, starts from the same base)."""
    from tasks.bootstrap import run_bootstrap

    written = base / "params.yaml"
    if written.exists() and not _same(yaml.safe_load(written.read_text()), raw):
        sys.exit(f"--base {base} was trained with other params ({written}); pass another --base")
    if (base / "model").exists():
        return
    base.mkdir(parents=True, exist_ok=True)
    written.write_text(yaml.safe_dump(raw, sort_keys=False))
    t0 = time.time()
    run_bootstrap(Params.model_validate(raw), base)
    print(f"[base] bootstrap done in {time.time() - t0:.0f}s: {base}", flush=True)


def logged_arm(name: str, methods: dict) -> str | None:
    """The logged-only arm a hindsight arm is compared with: the same algorithm on `data: logged`,
    else Refit's (Swift has no logged-only arm of its own)."""
    if methods[name].get("data", "all") == "logged":
        return None
    for algorithm in (methods[name]["algorithm"], "refit"):
        match = [m for m, c in methods.items() if c["algorithm"] == algorithm and c.get("data", "all") == "logged"]
        if match:
            return match[0]
    return None


def episodes_of(d: Path, metrics: dict) -> dict[str, dict[tuple, tuple[float, float]]]:
    """Per policy: (split, task, episode seed) -> (success, return), from evaluate's episodes."""
    import polars as pl

    table = pl.read_parquet(d / "evaluate/episodes.parquet", columns=["policy_id", "split", "task_id", "seed", "success", "return"])
    by_id: dict[str, dict] = {}
    for pid, split, task, seed, success, ret in table.iter_rows():
        by_id.setdefault(pid, {})[(split, task, seed)] = (float(success), float(ret))
    return {name: by_id[p["policy_id"]] for name, p in metrics["policies"].items()}


def paired(a: dict, b: dict) -> dict:
    """a - b over the episodes both played: mean, paired 95% interval, n (success and return)."""
    keys = sorted(set(a) & set(b))
    out = {"episodes": len(keys)}
    for i, what in enumerate(("success", "return")):
        d = [a[k][i] - b[k][i] for k in keys]
        m, se = mean_se(d)
        out[what] = {"diff": round(m, 4), "ci95": [round(m - 1.96 * se, 4), round(m + 1.96 * se, 4)], "se": round(se, 4)}
    return out


def _same(a: dict | None, b: dict | None) -> bool:
    """Two params read as the stages read them: a knob added since, at its default, is no change,
    and neither is `runtime` (threads, how they wait), which no result depends on, nor quick_look
    (what it sets, when limit_tasks is, is in the stages' keys compared)."""
    def read(raw: dict) -> dict:
        return Params.model_validate(raw).model_dump(exclude={"runtime", "quick_look"})
    return (a is None) == (b is None) and (a is None or read(a) == read(b))


def save_seed(results_dir: Path, seed: int, raw: dict, base: dict | None, metrics: dict, episodes: dict) -> None:
    """RESULTS/seeds/seedN.json: what the table needs of a finished seed (its params, the shared
    base's if any, evaluate's metrics, every evaluation episode's outcome), small enough to keep
    beside the table, so a later run adds seeds to it without the earlier seeds' run directories."""
    rows = [[name, *k, *v] for name, eps in episodes.items() for k, v in sorted(eps.items())]
    path = results_dir / "seeds" / f"seed{seed}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"params": raw, "base": base, "metrics": metrics, "episodes": rows}) + "\n")


def load_seed(results_dir: Path, seed: int, raw: dict, base: dict | None) -> tuple[dict, dict] | None:
    """A seed saved by save_seed with the same params: (metrics, episodes); None when there is none.
    Saved with other params, it is an error: the table would mix two experiments."""
    path = results_dir / "seeds" / f"seed{seed}.json"
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    if not (_same(saved["params"], raw) and _same(saved["base"], base)):
        sys.exit(f"{path} holds seed {seed} run with other params or another base; pass --fresh to rerun it, or another --results")
    episodes: dict = {}
    for name, split, task, ep_seed, success, ret in saved["episodes"]:
        episodes.setdefault(name, {})[(split, task, ep_seed)] = (success, ret)
    return saved["metrics"], episodes


# Student-t 0.975 quantiles by degrees of freedom (seeds - 1): 3 seeds give mean ± 4.30 SE.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def compare(results: dict[int, dict], episodes: dict[int, dict], methods: dict, chain: dict[str, str] | None = None,
            versus: str | None = None) -> dict:
    """The table over seeds. chain: arm -> the arm it is measured against, over the defaults (a
    hindsight arm's logged-only arm; HOPE's, PRM+RL's; StepAgent's, ETO); versus (NLAC's miniature:
    GRPO's arm) pairs every other arm against it."""
    seeds = list(results)
    first = results[seeds[0]]
    splits = [*first["splits"], "heldout"]
    table: dict = {"seeds": seeds, "splits": splits, "episodes_per_task": first["episodes_per_task"],
                   "sampling": first["sampling"], "policies": {}, "paired": {}}
    for name in first["policies"]:
        row = {}
        for split in splits:
            for key in ("success_rate", "mean_return"):
                m, se = mean_se([results[s]["policies"][name][split][key] for s in seeds])
                row.setdefault(split, {})[key] = {"mean": round(m, 4), "se": round(se, 4),
                                                  "by_seed": [results[s]["policies"][name][split][key] for s in seeds]}
        table["policies"][name] = row
    against = {name: logged_arm(name, methods) for name in methods}
    # HOPE against PRM+RL: the critic (and the actor it trains) with hindsight against without
    for name in first["policies"]:
        against[name] = "actor_prm" if name == "actor" else f"{name}[prm]" if "+best_of_" in name and not name.endswith("]") else against.get(name)
    for name in ("stepagent", "stepagent_inverse"):  # StepAgent's variants against ETO, as its Table 2
        against[name] = "eto"
    against.update(chain or {})
    if versus is not None:
        against = {name: versus for name in first["policies"] if name not in ("bootstrap", versus)}
    def over_seeds(name: str, base: str) -> dict:
        a = {(s, *k): v for s in seeds for k, v in episodes[s][name].items()}
        b = {(s, *k): v for s in seeds for k, v in episodes[s][base].items()}
        return {split: paired({k: v for k, v in a.items() if split == "heldout" or k[1] == split}, b) for split in splits}

    def seed_by_seed(name: str, base: str) -> dict:
        """Held-out success difference per seed, and a Student-t 95% interval over the seeds:
        training runs vary more between seeds than episodes within one (DESIGN.md)."""
        per_seed = [paired(episodes[s][name], episodes[s][base]) for s in seeds]
        t = T975.get(len(seeds) - 1)
        out = {}
        for what in ("success", "return"):
            diffs = [p[what]["diff"] for p in per_seed]
            m, se = mean_se(diffs)
            out[what] = {"by_seed": diffs, "diff": round(m, 4), "se": round(se, 4),
                         "ci95": [round(m - t * se, 4), round(m + t * se, 4)] if t else None}
        return out

    for name, base in against.items():
        if base is None or base not in first["policies"]:
            continue
        table["paired"][name] = {"against": base, **over_seeds(name, base), "seeds": seed_by_seed(name, base)}
    if "training" in first:  # NLAC's miniature: each arm's iterations, seed by seed
        table["training"] = {str(s): results[s]["training"] for s in seeds}
    # and every policy against the base it started from: does anything beat it?
    table["versus_base"] = {name: {**over_seeds(name, "bootstrap"), "seeds": seed_by_seed(name, "bootstrap")}
                            for name in first["policies"] if name != "bootstrap"}
    return table


def show(table: dict, sets: list[str], preset: Path | None) -> None:
    splits, seeds = table["splits"], table["seeds"]
    print(f"\nSuccess and mean return over seeds {seeds} (mean ± standard error over seeds; {table['episodes_per_task']} "
          f"episodes per task, T={table['sampling']['temperature']}); preset: {preset or 'none'}; overrides: {sets or 'none'}")
    w = max(20, *(len(n) + 2 for n in table["policies"]))
    print(f"{'policy':<{w}}" + "".join(f"{s + ' success':>18}{s + ' return':>20}" for s in splits) + "  held-out success by seed")
    for name, row in table["policies"].items():
        cells = "".join(f"{row[s]['success_rate']['mean']:>10.3f} ± {row[s]['success_rate']['se']:.3f}"
                        f"{row[s]['mean_return']['mean']:>12.2f} ± {row[s]['mean_return']['se']:.2f}" for s in splits)
        print(f"{name:<{w}}{cells}  " + " ".join(f"{x:.3f}" for x in row["heldout"]["success_rate"]["by_seed"]))
    if table["paired"]:
        print("\nEach arm minus the one it is measured against (a hindsight arm: its logged-only arm; HOPE's critic and actor: PRM+RL's; "
              "StepAgent's: ETO; Refit/Swift's QA arms: the next in the paper's order; NLAC's miniature: GRPO), paired over the same episodes (95% interval):")
        for name, p in table["paired"].items():
            cells = "; ".join(
                f"{s} success {p[s]['success']['diff']:+.3f} [{p[s]['success']['ci95'][0]:+.3f}, {p[s]['success']['ci95'][1]:+.3f}], "
                f"return {p[s]['return']['diff']:+.2f} [{p[s]['return']['ci95'][0]:+.2f}, {p[s]['return']['ci95'][1]:+.2f}]"
                for s in splits)
            print(f"  {name} - {p['against']} (n = {p['heldout']['episodes']}): {cells}; {_by_seed(p['seeds'])}")
    print("\nEach policy minus the base, paired over the same held-out episodes (95% interval):")
    for name, p in table["versus_base"].items():
        h = p["heldout"]
        print(f"  {name} - bootstrap (n = {h['episodes']}): success {h['success']['diff']:+.3f} [{h['success']['ci95'][0]:+.3f}, "
              f"{h['success']['ci95'][1]:+.3f}], return {h['return']['diff']:+.2f} [{h['return']['ci95'][0]:+.2f}, {h['return']['ci95'][1]:+.2f}]; "
              f"{_by_seed(p['seeds'])}")


def show_training(training: dict) -> None:
    """NLAC's miniature: each arm's iterations, seed by seed: steps, success on its games, and NLAC's
    L1, L2 and critic against the oracle."""
    print("\nTraining, by seed and iteration (steps; success on the iteration's games; NLAC: L1 and L2 first -> final, "
          "the trained critic's Optimality against the oracle's on undrawn transitions):")
    for seed, arms in training.items():
        for arm, its in arms.items():
            cells = []
            for k, it in enumerate(its, start=1):
                cell = f"it{k}: {it['steps']} steps, train success {it['success_on_collect'].get('train', float('nan')):.3f}"
                if "first_l1" in it:
                    acc = it.get("critic_accuracy") or {}
                    cell += (f", L1 {_num(it['first_l1'])} -> {_num(it['final_l1'])}, L2 {_num(it['first_l2'])} -> {_num(it['final_l2'])}, "
                             f"critic accuracy {_num(acc.get('accuracy'))} on {acc.get('parsed')}/{acc.get('transitions')} parsed "
                             f"(majority {_num(acc.get('majority'))})")
                cells.append(cell)
            print(f"  seed {seed} {arm}: " + "; ".join(cells))


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _by_seed(seeds: dict) -> str:
    """Held-out success and return differences seed by seed, with the Student-t interval over seeds."""
    def one(s: dict, f: str) -> str:
        interval = f" [{s['ci95'][0]:+{f}}, {s['ci95'][1]:+{f}}]" if s["ci95"] else ""
        return f"{', '.join(f'{d:+{f}}' for d in s['by_seed'])}: {s['diff']:+{f}} ± {s['se']:{f}}{interval}"
    return f"by seed, success {one(seeds['success'], '.3f')}, return {one(seeds['return'], '.3f')} (t interval over seeds)"


def write_results(table: dict, out: Path) -> None:
    """table.json, success.json (the plot's points: arm, seed, split, success) and success.svg."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.json").write_text(json.dumps(table, indent=1) + "\n")
    points = [{"arm": name, "seed": seed, "split": split, "success_rate": rate}
              for name, row in table["policies"].items() for split in table["splits"]
              for seed, rate in zip(table["seeds"], row[split]["success_rate"]["by_seed"])]
    (out / "success.json").write_text(json.dumps(points, indent=1) + "\n")
    import vl_convert

    (out / "success.svg").write_text(vl_convert.vegalite_to_svg(arm_seed_spec(points, ROOT / ARM_SEED_TEMPLATE)))


def equal_steps(raw: dict) -> None:
    """NLAC's miniature gives every arm the same optimizer steps an iteration, as the paper gives
    every method the same count: each baseline of train.methods is held to nlac.steps (its
    gradient_steps, set here when left out); one set to another count is refused."""
    if not raw.get("nlac_iterations"):
        sys.exit("--nlac: the preset gives no nlac_iterations (their count is every arm's iterations)")
    steps = raw["nlac"]["steps"]
    for name, method in raw["train"]["methods"].items():
        algorithm = method["algorithm"]
        if algorithm in ("grpo", "ppo_returns"):  # their trainers' own key
            method[algorithm] = holder = method.get(algorithm) or {}
        else:
            holder = method
        if holder.get("gradient_steps") not in (None, steps):
            sys.exit(f"--nlac: train.methods.{name} takes {holder['gradient_steps']} gradient steps, nlac.steps {steps}: every arm takes the same")
        holder["gradient_steps"] = steps


# glibc keeps what a stage frees for reuse: the critic's batches of every length grew a seed's
# process to 12 GB resident, 8 to 9 GB of it kept for the stages after. Handing large blocks back
# to the system at once held the same stage under 2 GB (measured side by side, one seed each).
MALLOC = "glibc.malloc.trim_threshold=131072:glibc.malloc.mmap_threshold=131072:glibc.malloc.arena_max=2"


def main() -> None:
    if "GLIBC_TUNABLES" not in os.environ:  # read at start-up only: run again with it set
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "GLIBC_TUNABLES": MALLOC})
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", type=Path, help="a params file laid over params.yaml (bench/presets/)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=ROOT / "bench/out/repro")
    ap.add_argument("--results", type=Path, help="write table.json, success.json and success.svg here")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a params override, key.path=value")
    ap.add_argument("--fresh", action="store_true", help="rerun seeds whose results are on disk (under --out or --results)")
    ap.add_argument("--upstream", type=Path, help="reuse bootstrap/collect/summarize from DIR/seedN")
    ap.add_argument("--reuse", nargs="+", choices=STAGES[:-1], default=UPSTREAM, help="the stages --upstream provides")
    ap.add_argument("--base", type=Path, nargs="?", const=DEFAULT_BASE,
                    help="one bootstrap output (DIR/model, ...) every seed starts from, instead of its own; trained there with seed 0's "
                         "params when missing (default DIR: bench/out/base/<preset's name>)")
    ap.add_argument("--no-actor-critic", action="store_true", help="leave out HOPE's buffer, critic and actor, with and without hindsight (HR's miniature)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--stepagent", action="store_true",
                      help="StepAgent's miniature: expert, practice, Implicit and Inverse beside the train methods (RFT, ETO), "
                           "without hindsight or HOPE's actor-critic")
    mode.add_argument("--qa", action="store_true",
                      help="Refit/Swift's QA teacher miniature: the train methods alone (Refit, Swift and their baselines), "
                           "each against the next in the paper's order, without hindsight, HOPE's actor-critic or StepAgent")
    mode.add_argument("--nlac", action="store_true",
                      help="NLAC's miniature: every arm (nlac and train.methods, its baselines) runs the preset's nlac_iterations from the "
                           "same base at nlac.steps optimizer steps an iteration, without hindsight, HOPE's actor-critic or the train stage")
    args = ap.parse_args()
    if args.nlac and (args.no_actor_critic or args.upstream):
        ap.error("--nlac runs its own stages: not with --no-actor-critic or --upstream")
    if args.base == DEFAULT_BASE:
        args.base = ROOT / "bench/out/base" / (args.preset.stem if args.preset else "params")

    def seed_params(seed: int) -> dict:
        """params.yaml, the preset, the overrides and the seed: a seed's params before its paths."""
        raw = yaml.safe_load((ROOT / "params.yaml").read_text())
        if args.preset:
            lay_preset(raw, read_preset(args.preset))
        # outside --stepagent, StepAgent's policy is not played (as a seed saved before it reads)
        for s in [*([] if args.stepagent else ["evaluate.stepagent=null"]), *args.sets, f"seed={seed}"]:
            override(raw, s)
        if args.nlac:
            equal_steps(raw)
        return raw

    base_raw = seed_params(0) if args.base is not None else None
    skip = (ACTOR_CRITIC + HINDSIGHT if args.stepagent else ACTOR_CRITIC + HINDSIGHT + STEPAGENT if args.qa
            else ACTOR_CRITIC + STEPAGENT if args.no_actor_critic else STEPAGENT)
    plain_arms = args.no_actor_critic or args.stepagent or args.qa or args.nlac  # no actor, critic or best-of-N played
    results, episodes, t_all = {}, {}, time.time()
    for seed in args.seeds:
        raw = seed_params(seed)
        plain = copy.deepcopy(raw)
        d = args.out / f"seed{seed}"
        override(raw, f"train.base_model={d / 'bootstrap/model'}")
        if plain_arms:
            for s in ("evaluate.actor=null", "evaluate.extra={}", "evaluate.best_of_n.policies=[]"):
                override(raw, s)
        if args.nlac:  # evaluate plays the NLAC arm's last policy beside the baselines' (run_nlac_seed)
            last = d / "nlac" / f"iteration{len(raw['nlac_iterations'])}/nlac/model"
            override(raw, f"evaluate.extra={{nlac: {last}}}")
        if args.stepagent:  # the seed's base practises and starts both variants; evaluate plays Implicit's and Inverse's
            override(raw, f"practice.model={d / 'bootstrap/model'}")
            override(raw, f"stepagent.base_model={d / 'bootstrap/model'}")
            override(raw, f"evaluate.stepagent={d / 'stepagent/model'}")
            override(raw, f"evaluate.extra={{stepagent_inverse: {d / 'stepagent_inverse/model'}}}")
        if not plain_arms:
            override(raw, f"critic.base_model={d / 'bootstrap/model'}")
            override(raw, f"evaluate.best_of_n.critic={d / 'critic/model'}")  # the seed's critic picks for best-of-N
            override(raw, f"actor.base_model={d / 'bootstrap/model'}")
            override(raw, f"actor.critic={d / 'critic/model'}")
            override(raw, f"evaluate.actor={d / 'actor/model'}")  # the seed's actor is played
            override(raw, f"evaluate.extra={{actor_prm: {d / 'actor_prm/model'}}}")  # and PRM+RL's, beside it
            override(raw, f"evaluate.best_of_n.critics={{prm: {d / 'critic_prm/model'}}}")
        if raw["roles"]["forward"].get("backend") == "learned":  # HR's forward models, trained on this seed's logged dialogues
            override(raw, f"forward.base_model={d / 'bootstrap/model'}")
            override(raw, f"roles.forward.model={d / 'forward/models/model'}")
            override(raw, f"roles.forward.hard_model={d / 'forward/models/hard_model'}")
        params = Params.model_validate(raw)
        done = d / "evaluate/metrics.json"
        if args.fresh and d.exists():
            shutil.rmtree(d)
        saved = None if args.fresh or args.results is None or d.exists() else load_seed(args.results, seed, plain, base_raw)
        if saved is not None:
            print(f"[seed {seed}] read back from {args.results}/seeds/seed{seed}.json", flush=True)
            results[seed], episodes[seed] = saved
            continue
        up = args.upstream / f"seed{seed}" if args.upstream else None
        written, wanted = d / "params.yaml", yaml.safe_dump(raw, sort_keys=False)
        if written.exists() and not _same(yaml.safe_load(written.read_text()), raw):
            sys.exit(f"{d} holds a run with other params ({written}); pass --fresh to rerun it, or another --out")
        d.mkdir(parents=True, exist_ok=True)
        written.write_text(wanted)
        if args.base is not None and not done.exists():  # only a seed that runs needs the base: saved seeds read back without it
            make_base(args.base, base_raw)
        if args.nlac:
            iterations = len(params.nlac_iterations)
            results[seed] = json.loads(done.read_text()) if done.exists() else run_nlac_seed(params, d, iterations, args.base)
            results[seed]["training"] = nlac_training(d, list(nlac_arms(params)), iterations)
        else:
            results[seed] = json.loads(done.read_text()) if done.exists() else run_seed(params, d, up, args.reuse, args.base, skip)
        episodes[seed] = episodes_of(d, results[seed])
        if args.results is not None:
            save_seed(args.results, seed, plain, base_raw, results[seed], episodes[seed])

    methods = {name: m.model_dump() for name, m in params.train.methods.items()}
    # NLAC's miniature: every arm against GRPO, NLAC's strongest 20Q baseline (NLAC > GRPO > RFT)
    versus = next((name for name, m in methods.items() if m["algorithm"] == "grpo"), None) if args.nlac else None
    table = compare(results, episodes, methods, QA_AGAINST if args.qa else None, versus)
    show(table, args.sets, args.preset)
    if "training" in table:
        show_training(table["training"])
    if args.results:
        write_results(table, args.results)
        print(f"\nwrote {args.results}/table.json, success.json, success.svg")
    out = args.out.absolute().relative_to(Path.cwd()) if args.out.absolute().is_relative_to(Path.cwd()) else args.out
    print(f"\n({time.time() - t_all:.0f}s; per-seed outputs under {out})")


if __name__ == "__main__":
    main()
