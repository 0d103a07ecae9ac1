"""train: fine-tune the base policy with each configured method, one file per algorithm here.

Every method starts from the same base model with the same seed, so their evaluations differ
only by the data and the loss. A method's `data: logged` keeps the logged trajectories alone
(no hindsight regenerations), the comparison the miniature reproduction makes.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import polars as pl
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

from storage.parquet import read_polars


def algorithms() -> dict:
    from tasks.train import filtered_bc, refit, sft, swift

    return {"sft": sft.train, "refit": refit.train, "swift": swift.train, "filtered_bc": filtered_bc.train}


def run_train(params, training: Path, out_dir: Path) -> dict:
    """Writes out_dir/models/<method>/ (HF model directories), out_dir/loss/<method>.json and
    out_dir/metrics.json."""
    t0 = time.time()
    tp = params.train
    table = read_polars(training, "training")
    metrics: dict = {"base_model": tp.base_model, "rows": table.height, "methods": {}}
    for name, method in tp.methods.items():
        t_method = time.time()
        data = table.filter(pl.col("source") != "regeneration") if method.data == "logged" else table
        set_seed(params.seed)
        torch.use_deterministic_algorithms(True)
        tokenizer = AutoTokenizer.from_pretrained(tp.base_model)
        model = AutoModelForCausalLM.from_pretrained(tp.base_model, dtype=torch.float32)
        print(f"train {name}: {method.algorithm} on {data.height} trajectories ({method.data})", flush=True)
        result = algorithms()[method.algorithm](model, tokenizer, data, tp.config_for(method), params.seed)
        curve = result.pop("curve")
        if result["rows"] == 0:
            # Saved untrained, so evaluate still compares it; the metrics say why.
            print(f"train {name}: no trajectory carries a training signal; the base model is kept", flush=True)
        model.save_pretrained(out_dir / "models" / name)
        tokenizer.save_pretrained(out_dir / "models" / name)
        (out_dir / "loss").mkdir(parents=True, exist_ok=True)
        points = [{"step": e["step"], "loss": e["loss"]} for e in curve]
        (out_dir / "loss" / f"{name}.json").write_text(json.dumps(points, indent=1) + "\n")
        metrics["methods"][name] = {
            "algorithm": method.algorithm,
            "data": method.data,
            **result,
            "trained": result["rows"] > 0,
            "final_loss": points[-1]["loss"] if points else None,
            "seconds": round(time.time() - t_method, 1),
        }
    metrics["seconds"] = round(time.time() - t0, 1)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics
