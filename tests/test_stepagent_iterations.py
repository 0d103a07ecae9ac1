"""StepAgent's later iterations (params.yaml `stepagent_iterations`, dvc.yaml's `stepagent_iteration`
foreach, flows/stepagent_iteration.py) and the choice among them (stepagent_select): their params,
their stage names and files as DVC sees them, and iteration 2 run after the finished tiny
pipeline, chosen on the val split, then rerun alone."""
import json
import shlex
import shutil

import pyarrow.parquet as pq
import pytest
import yaml
from pydantic import ValidationError

from conftest import BIN, ROOT, copy_repo, run, tiny_params
from flows.common import stage_names, stage_spec
from flows.stepagent_iteration import stepagent_iteration_params
from tasks.params import Params
from tasks.stepagent_select import run_stepagent_select

TWO = {"stepagent_iterations": {"2": {"policy": "data/stepagent/model", "beta": 0.5}}, "stepagent_select": {"last": "data/iteration2/stepagent/model"}}


def test_iterations_count_from_two_each_from_the_previous_policy_and_the_last_is_named():
    three = {"stepagent_iterations": {**TWO["stepagent_iterations"], "3": {"policy": "data/iteration2/stepagent/model"}},
             "stepagent_select": {"last": "data/iteration3/stepagent/model"}}
    assert list(Params.model_validate(tiny_params(three)).stepagent_iterations) == [2, 3]
    with pytest.raises(ValidationError, match="'3' where iteration 2 belongs"):
        Params.model_validate(tiny_params({"stepagent_iterations": {"3": {"policy": "data/stepagent/model"}}}))
    with pytest.raises(ValidationError, match="iteration 2 practises with iteration 1's policy, data/stepagent/model"):
        Params.model_validate(tiny_params({"stepagent_iterations": {"2": {"policy": "data/bootstrap/model"}}}))
    with pytest.raises(ValidationError, match="set stepagent_select.last to data/iteration2/stepagent/model"):
        Params.model_validate(tiny_params({"stepagent_iterations": TWO["stepagent_iterations"]}))
    with pytest.raises(ValidationError, match="write iteration 2 as '2' \\(quoted\\)"):
        Params.model_validate(tiny_params({"stepagent_iterations": {2: {"policy": "data/stepagent/model"}}}))


def test_an_iteration_practises_and_starts_from_the_previous_policy_with_its_own_seed_and_beta():
    p = Params.model_validate(tiny_params(TWO))
    q = stepagent_iteration_params(p, 2)
    assert q.practice.model == q.stepagent.base_model == "data/stepagent/model"  # pi_ref re-initialised from the agent
    assert q.stepagent.beta == 0.5 and p.stepagent.beta == 0.1
    assert q.seed != p.seed and q.seed == stepagent_iteration_params(p, 2).seed


def test_dvc_names_each_iteration_and_the_choice_follows_the_last(tmp_path, monkeypatch):
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params()))
    monkeypatch.chdir(tmp_path)
    assert not [s for s in stage_names() if s.startswith("stepagent_iteration")]  # the default: one iteration
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params(TWO)))
    names = stage_names()
    assert names.index("stepagent") < names.index("stepagent_iteration@2") < names.index("stepagent_select") < names.index("evaluate")
    spec = stage_spec("stepagent_iteration@2")
    assert spec["cmd"] == "retrosight stage stepagent_iteration@2" and spec["deps"][1] == "data/stepagent/model"
    assert spec["outs"] == ["data/iteration2/practice", "data/iteration2/stepagent"]
    run([str(BIN / "dvc"), "init", "--no-scm", "-q"], tmp_path)
    listed = run([str(BIN / "dvc"), "stage", "list", "--name-only"], tmp_path).stdout.split()
    assert "stepagent_iteration@2" in listed  # DVC agrees


def test_one_iteration_is_copied_without_a_game_and_a_missing_one_is_named(tiny_model_dir, tmp_path):
    p = Params.model_validate(tiny_params())
    m = run_stepagent_select(p, {1: tiny_model_dir}, tmp_path / "out")
    assert m["chosen"] == 1 and "nothing to choose" in m["why"]
    assert (tmp_path / "out/model/model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    assert pq.read_metadata(tmp_path / "out/episodes.parquet").num_rows == 0
    with pytest.raises(FileNotFoundError, match="no policy at .*iteration2"):
        run_stepagent_select(p, {1: tiny_model_dir, 2: tmp_path / "data/iteration2/stepagent/model"}, tmp_path / "out")


# docs/pipeline.md's commands, run here as written (tests/test_documented_commands.py finds them here)
SECOND_ITERATION = "retrosight run -S +stepagent_iterations.2.policy=data/stepagent/model -S stepagent_select.last=data/iteration2/stepagent/model"
RERUN_ALONE = "retrosight run stepagent_iteration@2 --force --only"


@pytest.mark.system
def test_iteration_two_runs_after_the_pipeline_is_chosen_on_val_and_reruns_alone(finished_workspace, tmp_path):
    project = copy_repo(finished_workspace.repo, tmp_path)
    lock = lambda: yaml.safe_load((project / "dvc.lock").read_text())["stages"]  # noqa: E731
    before = lock()
    out = run([str(BIN / "retrosight"), *shlex.split(SECOND_ITERATION)[1:]], project).stdout
    assert "stepagent_iteration@2: ran" in out and "stepagent_select: ran" in out, out
    assert not [s for s in ("practice", "stepagent", "collect", "train") if f"{s}: ran" in out], out
    d = project / "data/iteration2"
    practice = pq.read_table(d / "practice/pairs.parquet").to_pylist()
    assert practice and {r["policy_id"].split("@")[0] for r in practice} == {"model"}  # practised by data/stepagent/model
    assert practice[0]["policy_id"] != pq.read_table(project / "data/practice/pairs.parquet").to_pylist()[0]["policy_id"]
    metrics = json.loads((d / "stepagent/metrics.json").read_text())
    assert metrics["base_model"] == "data/stepagent/model" and metrics["beta"] == 0.1 and metrics["reference_practised"]
    chosen = json.loads((project / "data/stepagent_select/metrics.json").read_text())
    assert set(chosen["iterations"]) == {"1", "2"} and chosen["chosen"] in (1, 2)
    val = pq.read_table(project / "data/stepagent_select/episodes.parquet").to_pylist()
    assert {r["split"] for r in val} == {"val"} and len({r["policy_id"] for r in val}) == 2
    best = project / ("data/stepagent/model" if chosen["chosen"] == 1 else "data/iteration2/stepagent/model")
    assert (project / "data/stepagent_select/model/model.safetensors").read_bytes() == (best / "model.safetensors").read_bytes()
    assert {k: v for k, v in lock().items() if k not in ("stepagent_iteration@2", "stepagent_select", "evaluate")} == \
        {k: v for k, v in before.items() if k not in ("stepagent_select", "evaluate")}
    # Forced alone, iteration 2 reruns to the same tables; nothing else runs.
    outs = (d / "practice/pairs.parquet").read_bytes()
    again = run([str(BIN / "retrosight"), *shlex.split(RERUN_ALONE)[1:]], project).stdout
    assert "stepagent_iteration@2: ran" in again and "stepagent_select: ran" not in again, again
    assert (d / "practice/pairs.parquet").read_bytes() == outs
    shown = run([str(BIN / "retrosight"), "inspect"], project).stdout
    assert "iteration2_practice.pairs" in shown
