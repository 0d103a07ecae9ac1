"""train: fine-tune the base policy with each configured method, one file per algorithm here.

Every method starts from the same base model with the same seed, so their evaluations differ
only by the data and the loss. A method's `data: logged` keeps the logged trajectories alone
(no hindsight regenerations), the comparison the miniature reproduction makes; its `alpha` mixes
the regenerations in at that share of its rows, as HOPE's replay buffer does (training_rows).

With a checkpoint directory, a killed run resumes: each method keeps its checkpoints, then its
finished model and result, under checkpoint_dir/<method>/<key>, the key a hash of all it trains
on (the training table, the base model's files, the method's config, the seed), so a rerun
resumes where the method stopped or reuses its finished model, and never a stale checkpoint.
The directory is removed once the stage has succeeded.

With train.nproc_per_node > 1 the stage runs on that many ranks under torchrun (distributed.py):
every rank trains, DeepSpeed shards the model across them, rank 0 alone writes. Resuming is
single-process only: a multi-rank run trains every method from the start.

Two methods read other tables than the training table: leap (relabel's counterfactuals at their
logged states) and eto (the expert stage's trajectories against collect's failures, paired once
for every eto method). rft reads the environment's win rule (Environment.won). step_dpo with
pairs_from: branches rolls its branches out from collect's logged trajectories here, once for every
step_dpo method of the same branch settings (tasks/train/step_dpo.py says why inside train);
star_gate_d distils from its teacher, a method trained before it in this stage (or a model
directory), whose weights are in its checkpoint key.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import polars as pl
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

from storage.validate import StageInputs
from tasks.train import distributed  # not its `launch`, which would shadow the module tasks.train.launch
from tasks.train.distributed import deepspeed_config, partition, rank, save, world_size
from tasks.train.sft import TrainingDiverged, latest_checkpoint


def algorithms() -> dict:
    from tasks.train import dpo, eto, filtered_bc, grpo, ilql, leap, ppo_returns, refit, rft, sft, star_gate, star_gate_d, step_dpo, swift

    return {
        "sft": sft.train, "refit": refit.train, "swift": swift.train, "filtered_bc": filtered_bc.train, "ilql": ilql.train, "leap": leap.train,
        "rft": rft.train, "eto": eto.train, "grpo": grpo.train, "ppo_returns": ppo_returns.train, "star_gate": star_gate.train,
        "star_gate_d": star_gate_d.train, "dpo": dpo.train, "step_dpo": step_dpo.train,
    }


def _file_digest(paths: list[Path], root: Path) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(str(path.relative_to(root)).encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def training_rows(table: pl.DataFrame, method, seed: int) -> tuple[pl.DataFrame, dict]:
    """The rows of the training table `method` trains on (in the table's order), and how many
    are logged and hindsight (source "regeneration"), with the hindsight share.

    data: logged drops the regenerations. alpha (HOPE's hindsight share, in [0, 1)) keeps every
    logged row and round(alpha / (1 - alpha) * logged) regenerations; with fewer regenerations
    than that, it keeps them all and subsamples the logged rows to round(regenerations * (1 -
    alpha) / alpha), so the share is alpha up to rounding (with no regeneration at all, no share
    can be reached and the logged rows are kept). aggregate_multiple (HR's aggregation, 5 in the
    paper) keeps every logged row and round((multiple - 1) * logged) regenerations, so the rows
    are that multiple of the logged ones, originals counted; with fewer regenerations, all of
    them (never a logged row less). The rows drawn are the first by a hash of (seed,
    trajectory_id): the same on every run, and a row's draw does not depend on the other rows
    in the table."""
    hindsight = pl.col("source") == "regeneration"
    if method.data == "logged":
        table = table.filter(~hindsight)
    elif method.alpha is not None:
        logged, regenerations, a = table.filter(~hindsight), table.filter(hindsight), method.alpha
        wanted = round(a / (1 - a) * logged.height)
        if wanted <= regenerations.height:
            table = table.filter(~hindsight | pl.col("trajectory_id").is_in(_drawn(regenerations, wanted, seed)))
        elif regenerations.height:
            kept = min(logged.height, round(regenerations.height * (1 - a) / a))
            table = table.filter(hindsight | pl.col("trajectory_id").is_in(_drawn(logged, kept, seed)))
    elif getattr(method, "aggregate_multiple", None) is not None:
        logged, regenerations = table.filter(~hindsight), table.filter(hindsight)
        wanted = round((method.aggregate_multiple - 1) * logged.height)
        if wanted < regenerations.height:
            table = table.filter(~hindsight | pl.col("trajectory_id").is_in(_drawn(regenerations, wanted, seed)))
    n_hindsight = table.filter(hindsight).height
    counts = {
        "rows_logged": table.height - n_hindsight, "rows_hindsight": n_hindsight,
        "hindsight_share": n_hindsight / table.height if table.height else None,
    }
    if getattr(method, "aggregate_multiple", None) is not None:  # the multiple reached, originals counted
        counts["multiple"] = round(table.height / counts["rows_logged"], 4) if counts["rows_logged"] else None
    return table, counts


def _drawn(rows: pl.DataFrame, n: int, seed: int) -> list[str]:
    """The trajectory IDs of `n` of `rows`: the first by sha256 of (seed, trajectory_id)."""
    ids = rows["trajectory_id"].to_list()
    return sorted(ids, key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).digest())[:n]


def checkpoint_store(checkpoint_dir: Path, name: str, config: dict) -> Path:
    """`name`'s checkpoint folder for this config (its inputs' digests, settings and seed);
    folders for another config are stale, so removed."""
    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    for stale in (checkpoint_dir / name).glob("*"):
        if stale.name != key:
            shutil.rmtree(stale)
    return checkpoint_dir / name / key


def path_digest(path: str | Path) -> str:
    """The digest of a file, or of a directory's files (a model), with the path itself (a hub
    name where no such path exists)."""
    base = Path(path)
    if base.is_file():
        return _file_digest([base], base.parent) + str(path)
    return _file_digest(sorted(p for p in base.rglob("*") if p.is_file()), base) + str(path)


def _method_store(checkpoint_dir: Path, name: str, inputs: str, method, cfg, seed: int) -> Path:
    return checkpoint_store(checkpoint_dir, name, {"inputs": inputs, "method": method.model_dump(), "config": cfg.model_dump(mode="json"), "seed": seed})


def _write_loss(out_dir: Path, name: str, points: list[dict]) -> None:
    (out_dir / "loss").mkdir(parents=True, exist_ok=True)
    (out_dir / "loss" / f"{name}.json").write_text(json.dumps(points, indent=1) + "\n")


def leap_rows(params, checked: StageInputs, relabels: Path | None, trajectories: Path | None) -> list[dict]:
    """LEAP's examples, once for every leap method: relabel's counterfactuals at their parents'
    states (tasks/train/leap.py). A relabel whose parent is not in `trajectories` is quarantined."""
    from storage.schema import from_table
    from tasks.regenerate import ok_relabels
    from tasks.train import leap

    parents = {t["trajectory_id"]: t for t in from_table(checked.read(trajectories, "trajectories"))}
    return leap.counterfactuals(params.env.environment(), ok_relabels(checked, relabels, parents, str(trajectories)), parents)


def eto_pairs(checked: StageInputs, expert: Path, trajectories: Path) -> tuple[list[dict], dict]:
    """ETO's (expert, failure) pairs, once for every eto method, and the pairing's counts
    (tasks/train/eto.py)."""
    from storage.schema import from_table
    from tasks.train import eto

    return eto.pairs(from_table(checked.read(expert, "trajectories")), from_table(checked.read(trajectories, "trajectories")))


def step_dpo_branches(params, checked: StageInputs, table: pl.DataFrame, trajectories: Path, cfg) -> tuple[list[dict], dict]:
    """StepDPO's branches for one branch setting (tasks/train/step_dpo.py), from collect's rows that
    are logged rows of the training table (the labelled train trajectories)."""
    from storage.schema import from_table
    from tasks.train import step_dpo

    logged = set(table.filter(pl.col("source") != "regeneration")["trajectory_id"].to_list())
    parents = [t for t in from_table(checked.read(trajectories, "trajectories")) if t["trajectory_id"] in logged]
    return step_dpo.roll_branches(params, params.train.base_model, parents, cfg)


def run_train(
    params, training: Path, out_dir: Path, checkpoint_dir: Path | None = None, relabels: Path | None = None, trajectories: Path | None = None,
    expert: Path | None = None,
) -> dict:
    """Writes out_dir/models/<method>/ (HF model directories), out_dir/loss/<method>.json and
    out_dir/metrics.json. With checkpoint_dir, resumes a killed run (see the module's docstring).
    Raises TrainingDiverged, naming the method, when a loss turns NaN/inf or diverges.
    With train.nproc_per_node > 1, relaunches itself on that many ranks (distributed.py). A leap
    method also reads `relabels` and the `trajectories` they were proposed on; an eto method the
    `expert` stage's trajectories and collect's `trajectories`."""
    t0 = time.time()
    tp = params.train
    leap = any(m.algorithm == "leap" for m in tp.methods.values())
    eto = any(m.algorithm == "eto" for m in tp.methods.values())
    branches = any(m.algorithm == "step_dpo" and tp.config_for(m).step_dpo.pairs_from == "branches" for m in tp.methods.values())
    if leap and (relabels is None or trajectories is None):
        raise ValueError("train: a leap method learns relabel's counterfactuals; pass the relabels table and the trajectories they "
                         "were proposed on (the stage reads data/relabel/relabels.parquet and data/collect/trajectories.parquet)")
    if eto and (expert is None or trajectories is None):
        raise ValueError("train: an eto method pairs the expert's trajectories with the policy's failures; pass the expert table and "
                         "collect's trajectories (the stage reads data/expert/trajectories.parquet and data/collect/trajectories.parquet)")
    if branches and trajectories is None:
        raise ValueError("train: a step_dpo method with pairs_from: branches branches from the logged trajectories; pass collect's "
                         "trajectories (the stage reads data/collect/trajectories.parquet)")
    other_inputs = {"relabels": relabels} if leap else {}  # the ranks' options (launch.py)
    if eto:
        other_inputs["expert"] = expert
    if leap or eto or branches:
        other_inputs["trajectories"] = [trajectories]
    if tp.nproc_per_node > 1 and not torch.distributed.is_torchelastic_launched():
        return distributed.launch(params, training, out_dir, checkpoint_dir, tp.nproc_per_node, inputs=other_inputs)
    main, ranks = rank() == 0, world_size()
    if ranks > 1 and checkpoint_dir is not None:
        if main:
            print(f"train: resuming is single-process only; with {ranks} ranks a killed run trains every method from the start", flush=True)
        checkpoint_dir = None
    checked = StageInputs()
    table = checked.read_polars(training, "training")
    counterfactuals = leap_rows(params, checked, relabels, trajectories) if leap else []
    comparisons, pairing = eto_pairs(checked, expert, trajectories) if eto else ([], {})
    won = params.env.environment().won if any(m.algorithm == "rft" and m.success_threshold is None for m in tp.methods.values()) else None
    metrics: dict = {"inputs": checked.write(out_dir) if main else {}, "base_model": tp.base_model, "rows": table.height, "methods": {}}
    if ranks > 1:
        metrics["world_size"] = ranks
    if checkpoint_dir is not None:
        others = [*([Path(relabels)] if leap else []), *([Path(expert)] if eto else []), *([Path(trajectories)] if leap or eto or branches else [])]
        inputs = "".join(_file_digest([p], p.parent) for p in [training, *others]) + path_digest(tp.base_model)
    rolled: dict[str, tuple[list[dict], dict]] = {}  # StepDPO's branches by their settings, rolled out once
    for name, method in tp.methods.items():
        t_method = time.time()
        cfg = tp.config_for(method)
        cfg = cfg.model_copy(update={"deepspeed": deepspeed_config(cfg.deepspeed)})
        teacher = None
        if method.algorithm == "star_gate_d":  # an earlier method's model, finished by now, or a directory
            teacher = out_dir / "models" / cfg.distill.teacher if cfg.distill.teacher in tp.methods else Path(cfg.distill.teacher)
        store = None
        if checkpoint_dir is not None:
            store = _method_store(checkpoint_dir, name, inputs + (path_digest(teacher) if teacher else ""), method, cfg, params.seed)
            if (store / "result.json").exists():
                saved = json.loads((store / "result.json").read_text())
                shutil.copytree(store / "model", out_dir / "models" / name, dirs_exist_ok=True)
                _write_loss(out_dir, name, saved["points"])
                metrics["methods"][name] = saved["metrics"]
                print(f"train {name}: finished before the run was interrupted; its model is reused", flush=True)
                continue
            cfg = cfg.model_copy(update={"checkpoint_dir": store / "trainer"})
            if resume := latest_checkpoint(store / "trainer"):
                print(f"train {name}: resuming from its checkpoint at step {resume.name.rsplit('-', 1)[1]}", flush=True)
        if method.algorithm == "leap":  # every counterfactual, and no row of the training table
            data, mix = counterfactuals, {"rows_logged": 0, "rows_hindsight": len(counterfactuals), "hindsight_share": 1.0 if counterfactuals else None}
        elif method.algorithm == "eto":  # logged trajectories both sides, and no row of the training table
            data, mix = comparisons, {"rows_logged": len(comparisons), "rows_hindsight": 0, "hindsight_share": 0.0 if comparisons else None, **pairing}
        else:
            data, mix = training_rows(table, method, params.seed)
        extra = {"won": won} if method.algorithm == "rft" else {}  # rft: what a success is, by the environment's rule
        if teacher is not None:
            extra["teacher"] = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
        if method.algorithm == "step_dpo" and cfg.step_dpo.pairs_from == "branches":  # before the seed is set: training starts alike
            key = cfg.step_dpo.model_dump_json()
            if key not in rolled:
                rolled[key] = step_dpo_branches(params, checked, table, trajectories, cfg)
            extra["branches"], mix["rollout"] = rolled[key]
        set_seed(params.seed)
        torch.use_deterministic_algorithms(True)
        tokenizer = AutoTokenizer.from_pretrained(tp.base_model)
        model = AutoModelForCausalLM.from_pretrained(tp.base_model, dtype=torch.float32)
        if main:
            what = {"leap": "counterfactuals", "eto": "(expert, failure) pairs"}.get(method.algorithm, "trajectories")
            print(f"train {name}: {method.algorithm} on {len(data)} {what} ({mix['rows_logged']} logged, {mix['rows_hindsight']} hindsight)", flush=True)
        try:
            result = algorithms()[method.algorithm](model, tokenizer, data, cfg, params.seed, **extra)
        except TrainingDiverged as e:
            e.method = name
            raise
        curve = result.pop("curve")
        model = result.pop("model", model)  # a method that trains another model than the base (ilql: the base with heads)
        if result["rows"] == 0 and main:
            # Saved untrained, so evaluate still compares it; the metrics say why.
            print(f"train {name}: no trajectory carries a training signal; the base model is kept", flush=True)
        if (held := partition(model)) is not None:
            result["partition"] = held
        save(model, tokenizer, out_dir / "models" / name, main)
        if not main:
            continue
        points = [{"step": e["step"], "loss": e["loss"]} for e in curve]
        _write_loss(out_dir, name, points)
        metrics["methods"][name] = {
            "algorithm": method.algorithm,
            "data": method.data,
            "alpha": method.alpha,
            **mix,
            **result,
            "trained": result["rows"] > 0,
            "final_loss": points[-1]["loss"] if points else None,
            "seconds": round(time.time() - t_method, 1),
        }
        if store is not None:
            # The model first, then result.json, which marks the method finished; its checkpoints go.
            shutil.rmtree(store / "model", ignore_errors=True)
            shutil.copytree(out_dir / "models" / name, store / "model")
            (store / "result.tmp").write_text(json.dumps({"metrics": metrics["methods"][name], "points": points}))
            os.replace(store / "result.tmp", store / "result.json")
            shutil.rmtree(store / "trainer", ignore_errors=True)
    if not main:
        return metrics
    metrics["seconds"] = round(time.time() - t0, 1)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    if checkpoint_dir is not None:
        shutil.rmtree(checkpoint_dir)
    return metrics
