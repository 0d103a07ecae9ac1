"""The miniature reproduction: does hindsight data help? Held-out success over several seeds.

    python bench/hindsight_repro.py [--seeds 0 1 2] [--out bench/out/repro] [--set relabel.n=2 ...]

For each seed, runs every stage (bootstrap -> collect -> summarize -> relabel -> regenerate ->
label -> standardize -> train -> evaluate) with params.yaml plus the overrides, through the same
stage functions `retrosight run` calls, and prints one table: held-out (val + test) success of
(a) the bootstrap policy, (b) Refit on the logged data only, (c) Refit on logged data plus
hindsight regenerations, (d) Swift on the same, (e) filtered BC (and SFT), as mean and standard
error over seeds, with each method's ratio to the bootstrap policy. A seed whose evaluation is
already on disk is read back rather than rerun (--fresh reruns it). --upstream DIR reuses
DIR/seedN's bootstrap, collect and summarize outputs, so a hindsight or training setting can be
varied without paying for the base policy and the logged data again; --reuse names other stages
to take from DIR (with `--reuse ... train --set "evaluate.splits=[train]"`, the same trained
policies play the train tasks their data came from).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.params import Params  # noqa: E402

STAGES = ["bootstrap", "collect", "summarize", "relabel", "regenerate", "label", "standardize", "train", "evaluate"]


def override(raw: dict, assignment: str) -> None:
    """key.path=value, the value parsed as YAML (so numbers, lists and null work)."""
    key, _, value = assignment.partition("=")
    *path, last = key.split(".")
    node = raw
    for part in path:
        node = node.setdefault(part, {})
    node[last] = yaml.safe_load(value)


UPSTREAM = ["bootstrap", "collect", "summarize"]


def run_seed(params: Params, d: Path, upstream: Path | None = None, reuse: list[str] = UPSTREAM) -> dict:
    from tasks.bootstrap import run_bootstrap
    from tasks.collect import run_collect
    from tasks.evaluate import run_evaluate
    from tasks.label import run_label
    from tasks.regenerate import run_regenerate
    from tasks.relabel import run_relabel
    from tasks.standardize import run_standardize
    from tasks.summarize import run_summarize
    from tasks.train import run_train

    trajectories = [d / "collect/trajectories.parquet", d / "regenerate/trajectories.parquet"]
    steps = {
        "bootstrap": lambda: run_bootstrap(params, d / "bootstrap"),
        "collect": lambda: run_collect(params, d / "bootstrap/model", d / "collect"),
        "summarize": lambda: run_summarize(params, trajectories[0], d / "summarize"),
        "relabel": lambda: run_relabel(params, trajectories[0], d / "summarize/summaries.parquet", d / "relabel"),
        "regenerate": lambda: run_regenerate(params, trajectories[0], d / "relabel/relabels.parquet", d / "bootstrap/model", d / "regenerate"),
        "label": lambda: run_label(params, trajectories, d / "label"),
        "standardize": lambda: run_standardize(params, trajectories, d / "label/labels.parquet", d / "standardize"),
        "train": lambda: run_train(params, d / "standardize/train.parquet", d / "train"),
        "evaluate": lambda: run_evaluate(params, d / "train", d / "evaluate"),
    }
    for stage in STAGES:
        if upstream is not None and stage in reuse:
            shutil.copytree(upstream / stage, d / stage, dirs_exist_ok=True)
            continue
        t0 = time.time()
        steps[stage]()
        print(f"[seed {params.seed}] {stage} done in {time.time() - t0:.0f}s", flush=True)
    return json.loads((d / "evaluate/metrics.json").read_text())


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    se = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) if len(xs) > 1 else 0.0
    return m, se


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=ROOT / "bench/out/repro")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a params override, key.path=value")
    ap.add_argument("--fresh", action="store_true", help="rerun seeds whose results are on disk")
    ap.add_argument("--upstream", type=Path, help="reuse bootstrap/collect/summarize from DIR/seedN")
    ap.add_argument("--reuse", nargs="+", choices=STAGES[:-1], default=UPSTREAM, help="the stages --upstream provides")
    args = ap.parse_args()

    results, t_all = {}, time.time()
    for seed in args.seeds:
        raw = yaml.safe_load((ROOT / "params.yaml").read_text())
        for s in [*args.sets, f"seed={seed}"]:
            override(raw, s)
        d = args.out / f"seed{seed}"
        override(raw, f"train.base_model={d / 'bootstrap/model'}")
        params = Params.model_validate(raw)
        done = d / "evaluate/metrics.json"
        if args.fresh and d.exists():
            shutil.rmtree(d)
        up = args.upstream / f"seed{seed}" if args.upstream else None
        results[seed] = json.loads(done.read_text()) if done.exists() else run_seed(params, d, up, args.reuse)
        (d / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))

    first = results[args.seeds[0]]
    policies = list(first["policies"])
    splits = [*first["splits"], "heldout"]
    where = "Held-out" if set(first["splits"]) <= {"val", "test"} else "+".join(first["splits"])
    print(f"\n{where} success over seeds {args.seeds} (mean ± standard error over seeds; "
          f"{first['episodes_per_task']} episodes per task, T={first['sampling']['temperature']}); overrides: {args.sets or 'none'}")
    header = f"{'policy':<14}" + "".join(f"{s:>18}" for s in splits) + f"{'vs bootstrap':>14}" + "".join(f"{'seed ' + str(s):>9}" for s in args.seeds)
    print(header)
    base = mean_se([results[s]["policies"]["bootstrap"]["heldout"]["success_rate"] for s in args.seeds])[0]
    for name in policies:
        cells = []
        for split in splits:
            m, se = mean_se([results[s]["policies"][name][split]["success_rate"] for s in args.seeds])
            cells.append(f"{m:.3f} ± {se:.3f}")
        held = mean_se([results[s]["policies"][name]["heldout"]["success_rate"] for s in args.seeds])[0]
        ratio = f"{held / base:.2f}x" if base > 0 else "n/a"
        per_seed = "".join(f"{results[s]['policies'][name]['heldout']['success_rate']:>9.3f}" for s in args.seeds)
        print(f"{name:<14}" + "".join(f"{c:>18}" for c in cells) + f"{ratio:>14}" + per_seed)
    print(f"\n({time.time() - t_all:.0f}s; per-seed outputs under {args.out})")


if __name__ == "__main__":
    main()
