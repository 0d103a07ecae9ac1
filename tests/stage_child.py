"""Runs one stage function in a process of its own, for tests that SIGKILL it.

    python tests/stage_child.py STAGE PARAMS_JSON INPUTS_DIR OUT_DIR MODEL_DIR

Touches OUT_DIR/.ready once the imports are done, so a test can time its kill from the moment
the stage starts working rather than from interpreter start-up.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.collect import run_collect
from tasks.label import run_label
from tasks.params import Params
from tasks.regenerate import run_regenerate
from tasks.relabel import run_relabel
from tasks.summarize import run_summarize


def main(stage: str, params_json: str, inputs: str, out: str, model: str) -> None:
    params = Params.model_validate(json.loads(Path(params_json).read_text()))
    inp, out_dir = Path(inputs), Path(out)
    trajs = inp / "trajectories.parquet"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / ".ready").touch()
    if stage == "collect":
        run_collect(params, Path(model), out_dir)
    elif stage == "summarize":
        run_summarize(params, trajs, out_dir)
    elif stage == "relabel":
        run_relabel(params, trajs, inp / "summaries.parquet", out_dir)
    elif stage == "regenerate":
        run_regenerate(params, trajs, inp / "relabels.parquet", Path(model), out_dir)
    elif stage == "label":
        run_label(params, [trajs], out_dir)
    else:
        raise SystemExit(f"unknown stage {stage!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
