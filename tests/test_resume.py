"""Crash and resume: each generation stage SIGKILLed at random points, then run to the end.

The stage runs in a process of its own (tests/stage_child.py) with its LLM role on the hf
backend (a tiny model: every request is real generation, committed to the response cache a
chunk at a time). Each kill lands at a random point of the stage's progress. After three kills
and a final run, the stage's outputs must be byte-identical to an uninterrupted run's, no
finished call may be paid for twice, and no reader may ever see a partial Parquet file.
"""
from __future__ import annotations

import inspect
import json
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CODE, ROOT, TINY, built, digest, tiny_params, twenty_questions
from envs.twenty_questions.kb import load_kb
from envs.twenty_questions.env import Scripted
from envs.twenty_questions.policies import NoisyPolicy
from storage.parquet import read_table, write_table
from storage.schema import to_table
from tasks.params import Params
from tasks.relabel import run_relabel
from tasks.rollout import ScriptedAgent, derive_seed, new_episode, play
from tasks.summarize import run_summarize

pytestmark = pytest.mark.system

CHILD = ROOT / "tests" / "stage_child.py"
KILLS = 3
MAX_TURNS = 12
OUTPUTS = {
    "collect": ["trajectories.parquet"],
    "summarize": ["summaries.parquet"],
    "relabel": ["relabels.parquet"],
    "regenerate": ["trajectories.parquet"],
    "label": ["labels.parquet", "plots/reward_logged.json", "plots/reward_with_hindsight.json"],
}
# Which role of each stage is an LLM here; the others stay on the oracle.
LLM_ROLE = {"collect": "policy", "summarize": "summarizer", "relabel": "proposer", "regenerate": "policy", "label": "labeler"}


def _inputs(out: Path) -> None:
    kb = load_kb()
    eps = [new_episode(twenty_questions(MAX_TURNS), task, derive_seed("resume", task.name, k)) for task in kb.split("train")[:3] for k in range(3)]
    play(eps, ScriptedAgent(lambda rng: Scripted(NoisyPolicy(0.4, 0.2, 0.1))), 0, "logged")
    write_table(to_table([e.to_row() for e in eps], "trajectories"), out / "trajectories.parquet", "trajectories")
    oracle = Params.model_validate(tiny_params({"env": {"max_turns": MAX_TURNS}}))
    run_summarize(oracle, out / "trajectories.parquet", out)
    run_relabel(oracle, out / "trajectories.parquet", out / "summaries.parquet", out)


# What the inputs and the uninterrupted runs are made of: a change to any of it rebuilds them.
SOURCES = (*CODE, CHILD, ROOT / "params.yaml", TINY, MAX_TURNS)


@pytest.fixture(scope="module")
def inputs(request) -> Path:
    """Scripted logged games of at most 12 turns (3 per task on 3 train tasks), with oracle
    summaries and relabels: short prompts keep each run to seconds. Built once per tree
    (conftest.built) and shared: read only."""
    return built(request, "resume-inputs", digest(*SOURCES, inspect.getsource(_inputs)), _inputs)


def stage_params(stage: str, model_dir: Path, cache: Path) -> dict:
    role = {"backend": "hf", "model": str(model_dir), "sampling": {"max_new_tokens": 16}, "parse_attempts": 2, "max_failure_rate": 1.0, "batch_size": 4}
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 16}
    return tiny_params({
        "env": {"max_turns": MAX_TURNS},
        "cache": {"path": str(cache)},
        "roles": {LLM_ROLE[stage]: role},
        # batch 4: every step of a rollout is several committed chunks
        "collect": {"splits": ["train"], "m": 2, "limit_tasks": 3, "batch_size": 4, "sampling": sampling},
        "regenerate": {"batch_size": 4, "sampling": sampling},
    })


def start(stage: str, params: dict, inputs: Path, out: Path, model_dir: Path) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    (out / ".ready").unlink(missing_ok=True)
    path = out.parent / f"{out.name}-params.json"
    path.write_text(json.dumps(params))
    with open(out.parent / f"{out.name}.log", "a") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, str(CHILD), stage, str(path), str(inputs), str(out), str(model_dir)], stdout=log, stderr=subprocess.STDOUT)


def wait_ready(proc: subprocess.Popen, out: Path) -> float:
    while not (out / ".ready").exists():
        assert proc.poll() is None, f"the stage exited ({proc.returncode}) before starting; see {out.parent / (out.name + '.log')}"
        time.sleep(0.02)
    return time.monotonic()


def finish(proc: subprocess.Popen, out: Path) -> None:
    assert proc.wait(timeout=600) == 0, (out.parent / f"{out.name}.log").read_text()[-3000:]


def backend_calls(metrics: dict) -> int:
    """Requests that reached the backend (cache misses), wherever the stage reports them."""
    total = 0
    for key, value in metrics.items():
        if key == "cache" and isinstance(value, dict) and "misses" in value:
            total += value["misses"]
        elif isinstance(value, dict):
            total += backend_calls(value)
    return total


def cached(cache: Path) -> int:
    if not cache.exists():
        return 0
    with sqlite3.connect(cache) as db:
        if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'responses'").fetchone():
            return 0  # killed between creating the file and its table
        return db.execute("SELECT count(*) FROM responses").fetchone()[0]


def visible_parquet_is_whole(out: Path) -> None:
    for f in out.rglob("*.parquet"):
        read_table(f)  # raises on a partial file


def _uninterrupted(stage: str, inputs: Path, model_dir: Path, made: Path) -> None:
    """The stage run once to its end in a process of its own, timed from the moment it starts working."""
    proc = start(stage, stage_params(stage, model_dir, made / "ref-cache.sqlite"), inputs, made / "ref", model_dir)
    t0 = wait_ready(proc, made / "ref")
    finish(proc, made / "ref")
    (made / "seconds").write_text(f"{time.monotonic() - t0:.1f}")


@pytest.mark.parametrize("stage", list(OUTPUTS))
def test_a_stage_killed_at_random_points_resumes_to_identical_bytes(stage, inputs, tiny_model_dir, tmp_path, faults, request):
    # The uninterrupted run: built once per tree (conftest.built) and its outputs, cache and
    # metrics kept, as the same code on the same inputs writes the same bytes in any process.
    key = digest(*SOURCES, stage, str(inputs), str(tiny_model_dir), *map(inspect.getsource, (stage_params, start, _uninterrupted)))
    made = built(request, f"resume-uninterrupted-{stage}", key, lambda made: _uninterrupted(stage, inputs, tiny_model_dir, made))
    ref_cache, ref, work = made / "ref-cache.sqlite", made / "ref", float((made / "seconds").read_text())
    ref_metrics = json.loads((ref / "metrics.json").read_text())
    calls = backend_calls(ref_metrics)
    assert calls > 0 and cached(ref_cache) > 0, "the stage made no LLM call: nothing was tested"

    cache, out = tmp_path / "cache.sqlite", tmp_path / "out"
    params = stage_params(stage, tiny_model_dir, cache)
    rng = random.Random(f"kill-{stage}")
    killed_at = []  # (calls committed when killed, seconds into the run)
    for goal in sorted(rng.uniform(0.1, 0.9) * calls for _ in range(KILLS)):
        proc = start(stage, params, inputs, out, tiny_model_dir)
        t0 = wait_ready(proc, out)
        # Kill once the run has committed a random share of the calls, then a little later still,
        # so the kill lands anywhere: mid-chunk, mid-commit, while writing, or while loading.
        while proc.poll() is None and cached(cache) < goal:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            killed_at.append((cached(cache), round(time.monotonic() - t0, 1)))
        proc.wait()
        visible_parquet_is_whole(out)
    assert len(killed_at) >= 2, f"the runs finished before their kill points ({killed_at})"

    before = cached(cache)
    proc = start(stage, params, inputs, out, tiny_model_dir)
    wait_ready(proc, out)
    finish(proc, out)
    metrics = json.loads((out / "metrics.json").read_text())
    # No finished call is paid for twice: the final run asked the backend for exactly what the
    # killed runs had not committed, and the cache ends as the uninterrupted run's did.
    faults(sigkills=len(killed_at), runs_resumed=1, LLM_calls_paid_twice=backend_calls(metrics) - (calls - before))
    assert backend_calls(metrics) == calls - before, (calls, before, metrics)
    assert cached(cache) == cached(ref_cache)
    for name in OUTPUTS[stage]:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), f"{stage}: {name} differs after kills at {killed_at} s"
    assert not list(out.rglob("*.tmp")), "a killed writer's temp file was left behind"
    print(f"{stage}: {work:.1f} s of work; killed at (calls committed, s) {killed_at}; the final run made {calls - before} of {calls} calls")


def test_evaluate_stopped_between_policies_resumes_with_the_plays_it_kept(tiny_model_dir, tmp_path, capsys):
    """A play that stops evaluate (here a policy whose weights are not there yet) leaves the plays
    before it in the checkpoint directory: the rerun plays only the rest, and writes the bytes an
    uninterrupted run writes."""
    from tasks.evaluate import run_evaluate

    def params() -> Params:  # each its own response cache: nothing is reused from another run
        return Params.model_validate(tiny_params({"train": {"base_model": str(tiny_model_dir)}, "roles": {"policy": {"model": str(tiny_model_dir)}},
                                                  "evaluate": {"actor": None, "stepagent": None, "best_of_n": {"policies": []}}}))

    methods = list(params().train.methods)
    (tmp_path / "train/models").mkdir(parents=True)
    for m in methods[:-1]:
        (tmp_path / "train/models" / m).symlink_to(tiny_model_dir)
    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(OSError):
        run_evaluate(params(), tmp_path / "train", tmp_path / "stopped", checkpoints)
    assert len(list(checkpoints.glob("*.pkl"))) == len(methods)  # the base and every method before the missing one
    capsys.readouterr()
    (tmp_path / "train/models" / methods[-1]).symlink_to(tiny_model_dir)
    resumed = run_evaluate(params(), tmp_path / "train", tmp_path / "resumed", checkpoints)
    reused = [line for line in capsys.readouterr().out.splitlines() if "its episodes are reused" in line]
    assert len(reused) == len(methods) and not checkpoints.exists()
    whole = run_evaluate(params(), tmp_path / "train", tmp_path / "whole")
    assert (tmp_path / "resumed/episodes.parquet").read_bytes() == (tmp_path / "whole/episodes.parquet").read_bytes()
    assert list(resumed["policies"]) == ["bootstrap", *methods]
