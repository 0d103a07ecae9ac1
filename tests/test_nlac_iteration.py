"""NLAC's iterations as DVC stages (params.yaml `nlac_iterations`, dvc.yaml's `nlac_iteration`
foreach, flows/nlac_iteration.py): their names and files as DVC sees them, and iteration 1 run
in a fresh tiny project after its bootstrap, then rerun alone."""
import json
import shlex
import shutil

import pyarrow.parquet as pq
import pytest
import yaml

from conftest import BIN, ROOT, make_project, run, tiny_params
from flows.common import stage_names, stage_spec

ONE = {"nlac_iterations": {"1": {"policy": "data/bootstrap/model"}},
       "nlac": {"steps": 2, "batch_size": 4, "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 24}}}


def test_dvc_names_each_nlac_iteration_after_the_policy_it_collects_with(tmp_path, monkeypatch):
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params()))
    monkeypatch.chdir(tmp_path)
    assert not [s for s in stage_names() if s.startswith("nlac_iteration")]  # the default: off
    two = {"nlac_iterations": {**ONE["nlac_iterations"], "2": {"policy": "data/iteration1/nlac/model"}}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params(two)))
    names = stage_names()
    assert names.index("bootstrap") < names.index("nlac_iteration@1") < names.index("nlac_iteration@2")
    spec = stage_spec("nlac_iteration@2")
    assert spec["cmd"] == "retrosight stage nlac_iteration@2" and spec["deps"][0] == "data/iteration1/nlac/model"
    assert "data/iteration2/nlac/buffer.parquet" in spec["outs"] and "data/iteration2/nlac_collect" in spec["outs"]
    run([str(BIN / "dvc"), "init", "--no-scm", "-q"], tmp_path)
    listed = run([str(BIN / "dvc"), "stage", "list", "--name-only"], tmp_path).stdout.split()
    assert {"nlac_iteration@1", "nlac_iteration@2"} <= set(listed)  # DVC agrees


# docs/pipeline.md's command, run here as written (tests/test_documented_commands.py finds it here)
RERUN_ALONE = "retrosight run nlac_iteration@1 --force --only"


@pytest.mark.system
def test_an_nlac_iteration_runs_as_a_dvc_stage_and_reruns_alone(tmp_path):
    project = make_project(tmp_path, overrides=ONE)
    run([str(BIN / "retrosight"), "run", "bootstrap", "--only"], project)  # the base it collects with
    out = run([str(BIN / "retrosight"), "run", "nlac_iteration@1"], project).stdout
    assert "nlac_iteration@1: ran" in out, out
    assert not [s for s in ("bootstrap", "collect", "train", "evaluate") if f"{s}: ran" in out], out  # nothing depends on it
    d = project / "data/iteration1/nlac"
    metrics = json.loads((d / "metrics.json").read_text())
    assert metrics["algorithm"] == "nlac" and metrics["steps"] == 2 and metrics["samples"] == 8
    assert metrics["backends"] == {"language_critic": "oracle", "backup": "oracle", "refiner": "oracle"}
    assert metrics["roles"]["backup"]["ok"] == 8 and metrics["first_l1"] is not None and metrics["final_l2"] is not None
    buffer = pq.read_table(d / "buffer.parquet").to_pylist()
    episodes = pq.read_table(project / "data/iteration1/nlac_collect/trajectories.parquet").to_pylist()
    assert len(buffer) == sum(e["num_turns"] for e in episodes) == metrics["buffer"]["size"]
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    assert "nlac_iteration@1" in lock and lock["nlac_iteration@1"]["deps"][0]["path"] == "data/bootstrap/model"
    # Forced alone, the iteration reruns to the same tables; nothing else runs.
    tables = {name: (d / name).read_bytes() for name in ("buffer.parquet", "samples.parquet")}
    again = run([str(BIN / "retrosight"), *shlex.split(RERUN_ALONE)[1:]], project).stdout
    assert "nlac_iteration@1: ran" in again and "bootstrap: ran" not in again, again
    assert {name: (d / name).read_bytes() for name in tables} == tables
    shown = run([str(BIN / "retrosight"), "inspect"], project).stdout
    assert "iteration1_nlac.buffer" in shown and "iteration1_nlac_collect.trajectories" in shown


@pytest.mark.system
def test_every_nlac_role_on_vllms_openai_server_through_one_iteration(tiny_model_dir, untied_model_dir, tmp_path, monkeypatch):
    """The critic, the backup and the refiner on backend openai, at vLLM's OpenAI-compatible server
    started as docs/roles.md starts it, serving a tiny model: one NLAC iteration's requests reach it
    (every answer is in the response cache under the served model), and metrics.json counts them
    per role. The untrained model's texts need not parse: those failures are counted, the stage
    allowed them (max_failure_rate 1)."""
    import sqlite3

    from tasks.nlac import run_nlac_iteration
    from tasks.params import Params
    from vllm_server import serving

    monkeypatch.chdir(tmp_path)
    with serving(untied_model_dir, tmp_path / "serve.log") as server:
        role = {"backend": "openai", "model": "tiny", "base_url": server.url, "concurrency": 8, "max_retries": 1, "parse_attempts": 2,
                "max_failure_rate": 1.0, "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 24}}
        raw = tiny_params({"limit_tasks": 1, "env": {"max_turns": 3}, "nlac_iterations": {"1": {"policy": str(tiny_model_dir)}},
                           "nlac": {**ONE["nlac"], "batch_size": 3, "critic_eval": 0},
                           "roles": {"language_critic": role, "backup": role, "refiner": role}})
        p = Params.model_validate(raw)
        metrics = run_nlac_iteration(p, 1, tmp_path / "data/iteration1/nlac", tmp_path / "data/iteration1/nlac_collect")
        assert server.proc.poll() is None
    assert metrics["backends"] == {"language_critic": "openai", "backup": "openai", "refiner": "openai"}
    roles = metrics["roles"]
    futures = roles["backup"]["bootstrap_futures"]
    # Every drawn transition asked each role once (2 steps of 3); the backup first bootstrapped the non-terminal ones' futures.
    assert roles["language_critic"]["requests"] == roles["backup"]["requests"] == roles["refiner"]["requests"] == 6
    assert 1 <= futures["requests"] <= 6
    for stats in (*roles.values(), futures):
        assert stats["ok"] + stats["invalid"] + stats["failed"] == stats["requests"]
    # What reached the server: one answer cached per attempt sent (a request whose input failed, a
    # refinement without a critique, is counted failed and never sent: 0 attempts)
    sent = sum(roles[name]["attempts"] for name in ("language_critic", "backup", "refiner")) + futures["attempts"]
    with sqlite3.connect(raw["cache"]["path"]) as db:
        answered = db.execute("SELECT count(*) FROM responses WHERE backend = 'openai' AND model = 'tiny@127.0.0.1'").fetchone()[0]
    assert answered == sent >= 6 + futures["requests"]  # the critic's and the futures' at least
    samples = pq.read_table(tmp_path / "data/iteration1/nlac/samples.parquet").to_pylist()
    assert len(samples) == 6 and {s["critique_status"] for s in samples} <= {"ok", "invalid"}
