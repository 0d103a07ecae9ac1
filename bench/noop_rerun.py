"""A rerun with nothing changed against the full run, in one fresh workspace.

    python bench/noop_rerun.py [--small] [--repeats 3] [--set key.path=value ...]

Builds a new git + DVC workspace from this checkout (code, dvc.yaml, params.yaml with the
overrides; --small uses the test suite's tiny sizes), runs `retrosight run` there from nothing,
then `retrosight run` again `--repeats` times with nothing changed, then once after changing one
late stage's param (`standardize.clip`: standardize reruns, and what follows it only if its output
changed). Prints the wall time of each and their ratios to the full run. Each run is a new process, as a user or a
schedule starts it: the no-op time includes Python start-up, Prefect's local API and `dvc status`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BIN = Path(sys.executable).parent

from bench.hindsight_repro import override  # noqa: E402


def workspace(d: Path, raw: dict) -> Path:
    repo = d / "repo"
    repo.mkdir()
    for name in ("flows", "tasks", "storage", "envs", "models"):
        shutil.copytree(ROOT / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "dvc.yaml", repo / "dvc.yaml")
    raw["cache"] = {"path": ".retrosight/cache/responses.sqlite"}
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    for cmd in (["git", "init", "-q"], [str(BIN / "dvc"), "init", "-q"]):
        subprocess.run(cmd, cwd=repo, check=True, env=_env(d))
    shutil.copy(ROOT / ".dvcignore", repo / ".dvcignore")
    if (ROOT / ".dvc" / "plots").exists():
        shutil.copytree(ROOT / ".dvc" / "plots", repo / ".dvc" / "plots")
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-qm", "bench"], cwd=repo, check=True)
    return repo


def _env(d: Path) -> dict:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PREFECT_HOME": str(d / ".prefect-home"), "DVC_NO_ANALYTICS": "1"}
    env.pop("PREFECT_API_URL", None)
    return env


def timed_run(repo: Path, label: str, *extra: str) -> tuple[float, str]:
    print(f"{label} ...", flush=True)
    t0 = time.perf_counter()
    out = subprocess.run([str(BIN / "retrosight"), "run", *extra], cwd=repo, env=_env(repo.parent), text=True, capture_output=True)
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{label} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    print(f"{label}: {seconds:.1f}s", flush=True)
    return seconds, out.stdout


def ran_stages(stdout: str) -> list[str]:
    return [line.split(":")[0].strip() for line in stdout.splitlines() if line.strip().endswith(": ran")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="the test suite's tiny sizes (about a minute)")
    ap.add_argument("--repeats", type=int, default=3, help="no-op reruns (the median is reported)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a params override, key.path=value")
    ap.add_argument("--keep", action="store_true", help="keep the workspace")
    args = ap.parse_args()

    if args.small:
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import tiny_params

        raw = tiny_params()
        raw["train"]["methods"] = {"refit": {"algorithm": "refit"}}  # one method: train and evaluate stay short
    else:
        raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    for s in args.sets:
        override(raw, s)
    d = Path(tempfile.mkdtemp(prefix="retrosight-noop-"))
    try:
        repo = workspace(d, raw)
        full, full_out = timed_run(repo, "full run")
        noops = [timed_run(repo, f"no-op rerun {i + 1}") for i in range(args.repeats)]
        stale = [s for _, out in noops for s in ran_stages(out)]
        if stale:
            raise SystemExit(f"a rerun with nothing changed ran stages: {stale}")
        clip = raw["standardize"].get("clip")
        one, one_out = timed_run(repo, "after standardize.clip changed", "-S", f"standardize.clip={(clip or 3.0) + 1.0}")
    finally:
        if not args.keep:
            shutil.rmtree(d, ignore_errors=True)
    noop = statistics.median(s for s, _ in noops)
    rows = [
        ("full run", full, ", ".join(ran_stages(full_out))),
        (f"no-op rerun (median of {args.repeats})", noop, "none"),
        ("standardize param changed", one, ", ".join(ran_stages(one_out))),
    ]
    print(f"\n{'size: small (tests)' if args.small else 'size: params.yaml'}{' + ' + ' '.join(args.sets) if args.sets else ''}; {os.cpu_count()} cores")
    print(f"{'run':<36}{'seconds':>10}{'of full':>10}  stages run")
    for name, seconds, stages in rows:
        print(f"{name:<36}{seconds:>10.1f}{seconds / full:>10.4f}  {stages}")
    print(f"full run / no-op rerun: {full / noop:.0f}x")
    out = ROOT / "bench/out/noop_rerun.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "small": args.small, "sets": args.sets, "full_seconds": full, "noop_seconds": [s for s, _ in noops],
        "one_param_seconds": one, "stages_full": ran_stages(full_out), "stages_one_param": ran_stages(one_out),
    }, indent=2) + "\n")


if __name__ == "__main__":
    main()
