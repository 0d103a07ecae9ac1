"""HOPE's later iterations (params.yaml `iterations`, dvc.yaml's `iteration` foreach,
flows/iteration.py): their params, their stage names and files as DVC sees them, their tables in
the catalog and lineage, and iteration 2 run after the finished tiny pipeline, then rerun alone."""
import json
import shlex
import shutil

import pyarrow.parquet as pq
import pytest
import yaml
from pydantic import ValidationError

from conftest import BIN, ROOT, copy_repo, run, tiny_params, twenty_questions
from flows.common import stage_names, stage_spec
from flows.iteration import iteration_params
from envs.twenty_questions.env import Scripted
from envs.twenty_questions.kb import load_kb
from envs.twenty_questions.policies import NoisyPolicy
from storage.catalog import list_tables, open_catalog
from storage.lineage import lineage
from storage.parquet import write_table
from storage.schema import to_table
from tasks.params import Params
from tasks.rollout import ScriptedAgent, new_episode, play
from tasks.summarize import run_summarize

KB = load_kb()
TWO = {"2": {"policy": "data/actor/model"}}


def test_iterations_count_from_two_each_collecting_with_the_previous_actor():
    p = Params.model_validate(tiny_params({"iterations": {**TWO, "3": {"policy": "data/iteration2/actor/model"}}}))
    assert list(p.iterations) == [2, 3]
    with pytest.raises(ValidationError, match="'3' where iteration 2 belongs"):
        Params.model_validate(tiny_params({"iterations": {"3": {"policy": "data/actor/model"}}}))
    with pytest.raises(ValidationError, match="iteration 2 collects with iteration 1's actor, data/actor/model"):
        Params.model_validate(tiny_params({"iterations": {"2": {"policy": "data/bootstrap/model"}}}))
    with pytest.raises(ValidationError, match="write iteration 2 as '2' \\(quoted\\)"):
        Params.model_validate(tiny_params({"iterations": {2: {"policy": "data/actor/model"}}}))


def test_an_iteration_plays_the_previous_actor_ranks_with_its_own_critic_and_draws_its_own_seed():
    p = Params.model_validate(tiny_params({"iterations": TWO}))
    q = iteration_params(p, 2)
    assert q.roles.policy.model == "data/actor/model" and q.actor.critic == "data/iteration2/critic/model"
    assert q.seed != p.seed and q.seed == iteration_params(p, 2).seed
    assert (q.critic.base_model, q.actor.base_model) == (p.critic.base_model, p.actor.base_model)  # HOPE: both restart from pi_0


def test_dvc_names_each_iteration_and_its_files(tmp_path, monkeypatch):
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params()))
    monkeypatch.chdir(tmp_path)
    assert not [s for s in stage_names() if s.startswith("iteration")]  # the default: one iteration
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params({"iterations": {**TWO, "3": {"policy": "data/iteration2/actor/model"}}})))
    names = stage_names()
    assert names[names.index("actor") + 1 : names.index("actor") + 3] == ["iteration@2", "iteration@3"]
    spec = stage_spec("iteration@3")
    assert spec["cmd"] == "retrosight stage iteration@3" and spec["deps"][0] == "data/iteration2/actor/model"
    assert "data/iteration3/collect" in spec["outs"] and "data/iteration3/metrics.json" in spec["metrics"][0]
    run([str(BIN / "dvc"), "init", "--no-scm", "-q"], tmp_path)
    listed = run([str(BIN / "dvc"), "stage", "list", "--name-only"], tmp_path).stdout.split()
    assert [s for s in listed if s.startswith("iteration")] == ["iteration@2", "iteration@3"]  # DVC agrees


def test_the_catalog_and_lineage_see_an_iterations_tables(tmp_path):
    # Iteration 2's logged game and a regeneration of it, by hand, in its folders.
    d = tmp_path / "data/iteration2"
    (ep,) = [new_episode(twenty_questions(20), KB.split("train")[0], 7)]
    play([ep], ScriptedAgent(lambda rng: Scripted(NoisyPolicy(0.4, 0.2, 0.1))), 0, "logged")
    parent = ep.to_row()
    child = {**parent, "trajectory_id": "c" * 16, "source": "regeneration", "parent_id": parent["trajectory_id"], "branch_turn": 1, "relabel_id": "r" * 16}
    write_table(to_table([parent], "trajectories"), d / "collect/trajectories.parquet", "trajectories")
    write_table(to_table([child], "trajectories"), d / "regenerate/trajectories.parquet", "trajectories")
    run_summarize(Params.model_validate(tiny_params()), d / "collect/trajectories.parquet", d / "summarize")
    names = {f"{t.stage}.{t.table}" for t in list_tables(tmp_path / "data")}
    assert {"iteration2_collect.trajectories", "iteration2_regenerate.trajectories", "iteration2_summarize.summaries"} <= names
    found = lineage(open_catalog(tmp_path / "data"), "ccccccc")
    assert [t["trajectory_id"] for t in found["chain"]] == [parent["trajectory_id"], child["trajectory_id"]]
    assert found["summary"]["status"] == "ok"


@pytest.mark.system
def test_a_stage_that_only_an_override_would_make_is_refused_without_it(project):
    params = (project / "params.yaml").read_text()
    for argv in (["iteration@2"], ["iteration@3", "-S", "+iterations.2.policy=data/actor/model"]):
        r = run([str(BIN / "retrosight"), "run", *argv], project, check=False)
        assert r.returncode != 0 and f"unknown stage '{argv[0]}'" in r.stdout + r.stderr, r.stdout + r.stderr
        assert (project / "params.yaml").read_text() == params  # the override is undone


# docs/pipeline.md's commands, run here as written (tests/test_documented_commands.py finds them here)
SECOND_ITERATION = "retrosight run -S +iterations.2.policy=data/actor/model"
RERUN_ALONE = "retrosight run iteration@2 --force --only"


def test_iteration_two_runs_after_the_pipeline_and_reruns_alone(finished_workspace, tmp_path):
    project = copy_repo(finished_workspace.repo, tmp_path)
    lock = lambda: yaml.safe_load((project / "dvc.lock").read_text())["stages"]  # noqa: E731
    before = {k: v for k, v in lock().items()}
    # docs/pipeline.md's command as written: only the new iteration is stale, so only it runs
    out = run([str(BIN / "retrosight"), *shlex.split(SECOND_ITERATION)[1:]], project).stdout
    assert "iteration@2: ran" in out and "actor: ran" not in out and "collect: ran" not in out, out
    d = project / "data/iteration2"
    metrics = json.loads((d / "metrics.json").read_text())
    assert metrics["policy"] == "data/actor/model" and metrics["collect"]["trajectories"] > 0
    played = {r["policy_id"] for r in pq.read_table(d / "collect/trajectories.parquet").to_pylist()}
    assert len(played) == 1 and played.isdisjoint(r["policy_id"] for r in pq.read_table(project / "data/collect/trajectories.parquet").to_pylist())
    assert (d / "critic/model/config.json").exists()
    assert (d / "actor/model/config.json").exists() and pq.read_metadata(d / "buffer/pairs.parquet").num_rows > 0
    assert {k: v for k, v in lock().items() if k != "iteration@2"} == before  # iteration 1 as it was
    assert json.loads(run([str(BIN / "dvc"), "status", "--json"], project).stdout) == {}
    # Forced alone, iteration 2 reruns to the same outputs; nothing of iteration 1 runs.
    tables = lambda: {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*.parquet"))}  # noqa: E731 (metrics hold timings)
    outs = tables()
    again = run([str(BIN / "retrosight"), *shlex.split(RERUN_ALONE)[1:]], project).stdout
    assert "iteration@2: ran" in again and not [s for s in ("actor", "collect") for o in ("ran", "skipped") if f"{s}: {o}" in again], again
    assert tables() == outs and len(outs) >= 8  # deterministic under the seed
    shown = run([str(BIN / "retrosight"), "inspect"], project).stdout
    assert "iteration2_collect.trajectories" in shown and "iteration2_regenerate.trajectories" in shown
    child = pq.read_table(d / "regenerate/trajectories.parquet").to_pylist()
    if child:
        tree = run([str(BIN / "retrosight"), "lineage", child[0]["trajectory_id"]], project).stdout
        assert child[0]["parent_id"] in tree and "relabel" in tree
