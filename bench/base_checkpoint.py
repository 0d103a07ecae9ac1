"""Train the base policy the default run starts from, and pack it into the repository.

    python bench/base_checkpoint.py                   # train with params.yaml, pack into models/base/<env>
    python bench/base_checkpoint.py --set runtime.threads=2 --out models/base/twenty_questions
    python bench/base_checkpoint.py --pack DIR        # pack a finished bootstrap output (DIR/params.yaml)
    python bench/base_checkpoint.py --preset bench/presets/stepagent_scienceworld.yaml   # a preset's base

Trains exactly as `retrosight run bootstrap --only -S bootstrap.checkpoint=null` does (params.yaml,
with the --preset laid over it and the --set overrides, the bootstrap stage's function), in a work
directory, then packs the model, its training curve and provenance.json (this command, the seed,
the env and bootstrap keys the weights depend on, bootstrap's metrics with the first look, the
SHA-256 of every file) into --out.
`bootstrap.checkpoint: auto` then starts every run with the same keys from it. The twenty-questions
base takes about an hour of SFT on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.hindsight_repro import override  # noqa: E402
from models.checkpoint import pack  # noqa: E402
from tasks.params import Params, lay_preset, read_preset  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", type=Path, help="a params file laid over params.yaml first (bench/presets/), as `retrosight run --preset`")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a params override, key.path=value")
    ap.add_argument("--out", type=Path, help="where the checkpoint goes (default: models/base/<env.name>)")
    ap.add_argument("--pack", type=Path, help="a finished bootstrap output to pack instead of training (its params.yaml beside it)")
    args = ap.parse_args()

    from tasks.bootstrap import _differences, run_bootstrap, training_keys
    from tasks.runtime import apply

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    if args.preset:
        lay_preset(raw, read_preset(args.preset))
    for s in args.sets:
        override(raw, s)
    raw["bootstrap"]["checkpoint"] = None
    params = Params.model_validate(raw)
    out = args.out or ROOT / "models" / "base" / params.env.name
    command = shlex.join(["python", "bench/base_checkpoint.py", *([f"--preset={args.preset}"] if args.preset else []),
                          *(f"--set={s}" for s in args.sets)])
    threads = apply(params.runtime)
    with tempfile.TemporaryDirectory(prefix="retrosight-base-") as work:
        source = args.pack or Path(work)
        if args.pack:
            trained = Params.model_validate(yaml.safe_load((args.pack / "params.yaml").read_text()))
            if differ := _differences(training_keys(trained), training_keys(params)):
                sys.exit(f"{args.pack} was trained with other keys than this command's: {'; '.join(differ)}")
            metrics = json.loads((args.pack / "metrics.json").read_text())
        else:
            t0 = time.time()
            metrics = run_bootstrap(params, source)
            print(f"bootstrap trained in {time.time() - t0:.0f} s", flush=True)
        provenance = pack(source, out, {
            "command": command,
            "made": f"packed from {args.pack.name}, a bootstrap output trained with this command's keys" if args.pack else "trained by the command",
            "params": {"seed": params.seed, "threads": threads, "training": training_keys(params)},
            "metrics": metrics,
        })
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    look = metrics["model"]["success"]
    print(f"packed {out} ({size / 1e6:.1f} MB, {len(provenance['files'])} files); "
          + ("first look greedy: " + ", ".join(f"{k} {v['success_rate']:.3f}" for k, v in look.items()) if look
             else "no first look (bootstrap.eval_splits is empty)"))


if __name__ == "__main__":
    main()
