"""train: fine-tune the base policy with each configured method, one file per algorithm here.

Every method starts from the same base model with the same seed, so their evaluations differ
only by the data and the loss. A method's `data: logged` keeps the logged trajectories alone
(no hindsight regenerations), the comparison the miniature reproduction makes.

With a checkpoint directory, a killed run resumes: each method keeps its checkpoints, then its
finished model and result, under checkpoint_dir/<method>/<key>, the key a hash of all it trains
on (the training table, the base model's files, the method's config, the seed), so a rerun
resumes where the method stopped or reuses its finished model, and never a stale checkpoint.
The directory is removed once the stage has succeeded.
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
from tasks.train.sft import TrainingDiverged, latest_checkpoint


def algorithms() -> dict:
    from tasks.train import filtered_bc, refit, sft, swift

    return {"sft": sft.train, "refit": refit.train, "swift": swift.train, "filtered_bc": filtered_bc.train}


def _file_digest(paths: list[Path], root: Path) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(str(path.relative_to(root)).encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def _method_store(checkpoint_dir: Path, name: str, inputs: str, method, cfg, seed: int) -> Path:
    """This method's checkpoint folder for these inputs; folders for other inputs are stale, so removed."""
    config = {"inputs": inputs, "method": method.model_dump(), "config": cfg.model_dump(mode="json"), "seed": seed}
    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    for stale in (checkpoint_dir / name).glob("*"):
        if stale.name != key:
            shutil.rmtree(stale)
    return checkpoint_dir / name / key


def _write_loss(out_dir: Path, name: str, points: list[dict]) -> None:
    (out_dir / "loss").mkdir(parents=True, exist_ok=True)
    (out_dir / "loss" / f"{name}.json").write_text(json.dumps(points, indent=1) + "\n")


def run_train(params, training: Path, out_dir: Path, checkpoint_dir: Path | None = None) -> dict:
    """Writes out_dir/models/<method>/ (HF model directories), out_dir/loss/<method>.json and
    out_dir/metrics.json. With checkpoint_dir, resumes a killed run (see the module's docstring).
    Raises TrainingDiverged, naming the method, when a loss turns NaN/inf or diverges."""
    t0 = time.time()
    tp = params.train
    checked = StageInputs()
    table = checked.read_polars(training, "training")
    metrics: dict = {"inputs": checked.write(out_dir), "base_model": tp.base_model, "rows": table.height, "methods": {}}
    if checkpoint_dir is not None:
        base = Path(tp.base_model)
        files = sorted(p for p in base.rglob("*") if p.is_file())
        inputs = _file_digest([training], training.parent) + _file_digest(files, base) + tp.base_model
    for name, method in tp.methods.items():
        t_method = time.time()
        cfg = tp.config_for(method)
        store = None
        if checkpoint_dir is not None:
            store = _method_store(checkpoint_dir, name, inputs, method, cfg, params.seed)
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
        data = table.filter(pl.col("source") != "regeneration") if method.data == "logged" else table
        set_seed(params.seed)
        torch.use_deterministic_algorithms(True)
        tokenizer = AutoTokenizer.from_pretrained(tp.base_model)
        model = AutoModelForCausalLM.from_pretrained(tp.base_model, dtype=torch.float32)
        print(f"train {name}: {method.algorithm} on {data.height} trajectories ({method.data})", flush=True)
        try:
            result = algorithms()[method.algorithm](model, tokenizer, data, cfg, params.seed)
        except TrainingDiverged as e:
            e.method = name
            raise
        curve = result.pop("curve")
        if result["rows"] == 0:
            # Saved untrained, so evaluate still compares it; the metrics say why.
            print(f"train {name}: no trajectory carries a training signal; the base model is kept", flush=True)
        model.save_pretrained(out_dir / "models" / name)
        tokenizer.save_pretrained(out_dir / "models" / name)
        points = [{"step": e["step"], "loss": e["loss"]} for e in curve]
        _write_loss(out_dir, name, points)
        metrics["methods"][name] = {
            "algorithm": method.algorithm,
            "data": method.data,
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
    metrics["seconds"] = round(time.time() - t0, 1)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    if checkpoint_dir is not None:
        shutil.rmtree(checkpoint_dir)
    return metrics
