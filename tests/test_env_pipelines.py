"""The whole DAG on each environment beside TwentyQuestions, as a user takes a quick look at one
(docs/environments.md): `retrosight run -S env.name=X -S limit_tasks=2` in a fresh repository
with the tiny preset, through Prefect and `dvc repro` (the documented quick looks on the
repository's own params run in tests/test_documented_commands.py). Every stage runs, and what they write is
that environment's: its tasks, its scripted policies, its trajectories through evaluate."""
import json

import pyarrow.parquet as pq
import pytest
import yaml

from conftest import BIN, ROOT, make_project, run
from flows.common import stage_names

pytestmark = pytest.mark.system

# dvc.yaml's stages, but the foreach groups' (iterations: none by default)
STAGES = [s for s in stage_names(ROOT / "dvc.yaml") if "@" not in s]

# Each environment's own -S keys, and room for its longest scripted action: a policy cut short of
# its format writes nothing the environment can parse. ScienceWorld: its real simulator (Java),
# on the two lifespan types (gold paths of 3 and 4 actions) at 6 steps, not ETO's 10: a tiny
# model's garbled turns run every episode to its limit.
ENVIRONMENTS = {
    "guess_my_city": (["env.max_turns=6", "env.show_candidates=false"], 64),
    "car_dealer": (["env.max_turns=3"], 100),
    "scienceworld": (["env.task_types=[lifespan-longest-lived,lifespan-shortest-lived]", "env.max_steps.lifespan-longest-lived=6",
                      "env.max_steps.lifespan-shortest-lived=6"], 100),
    # the QA teacher logged as Refit/Swift log it: m = 3 a question, one at each temperature
    "qa_teacher": (["collect.m=3", "collect.temperatures=[0.3,0.7,1.0]"], 100),
}  # persuasion: its documented command, as written (below)


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_the_whole_dag_runs_on_each_environment(name, tmp_path):
    keys, tokens = ENVIRONMENTS[name]
    sampling = {"max_new_tokens": tokens}
    # the tiny preset (TwentyQuestions' env keys); bootstrap and collect take the top-level
    # limit_tasks the run sets, evaluate keeps its own (1), which wins
    repo = make_project(tmp_path, overrides={
        "bootstrap": {"limit_tasks": None, "demos_per_task": 1, "eval_sampling": sampling,
                      "behaviour_mix": {"expert": 0.4, "noisy": 0.3, "random": 0.3}},
        "collect": {"limit_tasks": None, "m": 1, "sampling": sampling}, "regenerate": {"sampling": sampling},
        "actor": {"sampling": sampling}, "expert": {"limit_tasks": None}, "practice": {"sampling": sampling}, "evaluate": {"sampling": sampling}})

    sets = [arg for key in [f"env.name={name}", *keys, "limit_tasks=2"] for arg in ("-S", key)]
    out = run([str(BIN / "retrosight"), "run", *sets], repo, timeout=3000)
    for stage in STAGES:
        assert f"{stage}: ran" in out.stdout, out.stdout[-3000:]
    env = yaml.safe_load((repo / "params.yaml").read_text())["env"]
    assert env["name"] == name and "observation" not in env  # TwentyQuestions' keys dropped

    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert set(lock["stages"]) == set(STAGES)
    status = run([str(BIN / "dvc"), "status"], repo).stdout
    assert "up to date" in status, status

    bootstrap = json.loads((repo / "data/bootstrap/metrics.json").read_text())
    assert {"expert", "noisy", "random"} <= set(bootstrap["scripted"])
    logged = pq.read_table(repo / "data/collect/trajectories.parquet").to_pylist()
    assert logged and {r["env"] for r in logged} == {name}
    splits = {r["split"] for r in logged}
    m = yaml.safe_load((repo / "params.yaml").read_text())["collect"]["m"]  # the preset's 1, or the environment's own -S
    assert len(logged) == m * len({r["task_id"] for r in logged}) == m * 2 * len(splits)  # 2 tasks a split
    demos = pq.read_table(repo / "data/bootstrap/demos.parquet").to_pylist()
    assert len({r["task_id"] for r in demos}) == 2
    for table in ("summarize/summaries", "label/labels", "buffer/pairs"):
        assert pq.read_table(repo / f"data/{table}.parquet").num_rows > 0, table
    played = pq.read_table(repo / "data/evaluate/episodes.parquet").to_pylist()
    assert played and {r["env"] for r in played} == {name}
    assert {r["split"]: r["task_id"] for r in played}.keys() == {"val", "test"}
    assert len({r["task_id"] for r in played}) == 2  # evaluate's own limit_tasks: 1 a split
    assert {"bootstrap", "actor", "stepagent", "sft"} <= {r["policy_id"].split(":")[0] for r in played}
    evaluation = json.loads((repo / "data/evaluate/metrics.json").read_text())
    assert {"bootstrap", "actor", "stepagent", "sft"} <= set(evaluation["policies"])
    experts = pq.read_table(repo / "data/expert/trajectories.parquet").to_pylist()
    assert len(experts) == 2 and {r["env"] for r in experts} == {name} and {r["policy_id"] for r in experts} == {"scripted:expert"}
    assert json.loads((repo / "data/practice/metrics.json").read_text())["samples"] > 0
    if name == "qa_teacher":  # three temperatures a question, judged by the oracle rubric, standardized in groups of three
        temperatures = {}
        for r in logged:
            temperatures.setdefault(r["task_id"], set()).add(r["policy_id"].rsplit("@T=", 1)[1])
        assert all(t == {"0.3", "0.7", "1"} for t in temperatures.values())
        labels = pq.read_table(repo / "data/label/labels.parquet").to_pylist()
        assert all(json.loads(r["scores"])["Overall"] == pytest.approx(10 * r["reward"]) for r in labels)
        trained = [r for r in pq.read_table(repo / "data/standardize/train.parquet").to_pylist() if r["source"] == "policy"]
        assert {r["group_size"] for r in trained} == {3}
    if name == "scienceworld":  # its oracle hindsight roles read the turns against the task's gold path
        summaries = pq.read_table(repo / "data/summarize/summaries.parquet").to_pylist()
        assert all(r["summary"].startswith(f"Task {r['task_id']}: ") and "The gold path takes" in r["summary"] for r in summaries)
        relabels = [r for r in pq.read_table(repo / "data/relabel/relabels.parquet").to_pylist() if r["status"] == "ok"]
        assert relabels and all(r["counterfactual_action"] != r["original_action"] and r["rationale"] for r in relabels)


def test_hrs_preset_runs_every_stage_on_persuasion_with_the_learned_forward_models_and_ilql(tmp_path):
    """A quick look at HR's miniature: `retrosight run --preset bench/presets/hr_persuasion.yaml
    -S limit_tasks=N`. The forward stage fine-tunes both of HR's forward models, regenerate has
    them write each dialogue on after the donor's answer to its counterfactual, and the preset's
    arms (ILQL and filtered BC, logged and with regenerations) train and play."""
    sampling = {"max_new_tokens": 64}
    repo = make_project(tmp_path, overrides={
        "bootstrap": {"limit_tasks": None, "eval_sampling": sampling},
        "collect": {"limit_tasks": None, "sampling": sampling}, "evaluate": {"sampling": sampling}})
    preset = ROOT / "bench/presets/hr_persuasion.yaml"
    # the tiny model's forward models write little the parser reads: what they write is kept or
    # dropped with its reason, rather than stopping regenerate on the role's failure rate
    sets = [arg for key in ["env.max_turns=4", "limit_tasks=2", "roles.forward.sampling.max_new_tokens=96", "roles.forward.parse_attempts=1",
                            "roles.forward.max_failure_rate=1.0", "evaluate.episodes_per_task=1"]
            for arg in ("-S", key)]
    out = run([str(BIN / "retrosight"), "run", "--preset", str(preset), *sets], repo, timeout=3000)
    for stage in STAGES:
        assert f"{stage}: ran" in out.stdout, out.stdout[-3000:]
    p = yaml.safe_load((repo / "params.yaml").read_text())
    assert (p["env"]["name"], p["roles"]["forward"]["backend"], p["relabel"]["mode"]) == ("persuasion", "learned", "hr")

    forward = json.loads((repo / "data/forward/metrics.json").read_text())
    assert forward["trained"] is True and set(forward["fidelity"]) == {"model", "hard_model"}
    assert all((repo / "data/forward/models" / m / "config.json").exists() for m in ("model", "hard_model"))
    regen = json.loads((repo / "data/regenerate/metrics.json").read_text())
    assert regen["relabels"] == regen["regenerations"] + regen["dropped_rows"] > 0
    kept = pq.read_table(repo / "data/regenerate/trajectories.parquet").to_pylist()
    assert all(r["policy_id"].startswith("forward:") for r in kept)  # written by the learned models, not the policy
    dropped = pq.read_table(repo / "data/regenerate/dropped.parquet").to_pylist()
    assert len(dropped) == regen["dropped_rows"] and all(r["reason"] and r["forward_model"] in ("model", "hard_model") for r in dropped)

    trained = json.loads((repo / "data/train/metrics.json").read_text())
    assert set(trained["methods"]) == {"ilql_logged", "ilql", "filtered_bc_logged", "filtered_bc"}
    evaluation = json.loads((repo / "data/evaluate/metrics.json").read_text())
    assert {"bootstrap", "ilql_logged", "ilql"} <= set(evaluation["policies"])
