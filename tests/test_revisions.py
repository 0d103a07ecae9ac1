"""Reading tables at past revisions through DVC, and the statistics `retrosight diff` prints."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pytest
import yaml

from conftest import BIN, make_project, run
from storage.diff import describe, ks_statistic
from storage.parquet import write_table
from storage.revisions import Revision, RevisionError, list_versions, params_diff

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]


def _labels(n: int, reward: float) -> pa.Table:
    return pa.Table.from_pylist([
        {"trajectory_id": f"t{i}", "task_id": "x", "source": "policy", "env_reward": reward, "env_success": False,
         "reward": reward, "labeler": "oracle", "model": "m", "prompt_hash": "h", "scores": None, "status": "ok", "reason": ""}
        for i in range(n)
    ])


@pytest.fixture
def repo(tmp_path):
    """Two commits of a DVC-tracked labels table: 3 rows at reward -20, then 5 rows at -10."""
    root = tmp_path / "repo"
    root.mkdir()
    run(["git", "init", "-q"], root)
    run([str(BIN / "dvc"), "init", "-q"], root)
    table = root / "data" / "label" / "labels.parquet"
    for i, (n, reward) in enumerate([(3, -20.0), (5, -10.0)]):
        write_table(_labels(n, reward), table, "labels")
        (root / "params.yaml").write_text(f"label:\n  n: {n}\n")
        run([str(BIN / "dvc"), "add", "-q", str(table.relative_to(root))], root)
        run(["git", "add", "-A"], root)
        run([*GIT, "commit", "-qm", f"run {i}"], root)
        run(["git", "tag", f"run{i}"], root)
    return root


def test_tables_at_a_revision_come_from_the_cache_without_checkout(repo):
    old = Revision(repo, "run0")
    [info] = old.tables()
    assert (info.stage, info.table, info.rows, info.schema_name) == ("label", "labels", 3, "labels")
    assert ".dvc/cache" in str(info.path)
    assert Revision(repo, "run1").table("labels").rows == 5
    assert Revision(repo).table("label.labels").rows == 5  # the workspace
    assert old.params() == {"label": {"n": 3}}
    assert params_diff(old.params(), Revision(repo, "run1").params()) == {"label.n": (3, 5)}
    with pytest.raises(RevisionError, match="no table 'summaries' at run0"):
        old.table("summaries")
    with pytest.raises(RevisionError, match="unknown revision 'nope'"):
        Revision(repo, "nope").tables()


def test_a_table_neither_cache_nor_remote_holds_is_named(repo):
    shutil.rmtree(repo / ".dvc" / "cache")
    old = Revision(repo, "run0")
    assert old.tables() == [] and old.missing == ["data/label/labels.parquet"]
    with pytest.raises(RevisionError, match="labels.parquet at run0 is in neither the DVC cache nor the remote"):
        old.table("labels")


def test_a_directory_output_whose_manifest_is_not_in_the_cache_does_not_hide_the_tables(repo):
    # A model directory beside the tables, as bootstrap writes: in a fresh clone neither its files
    # nor its manifest are in the cache, and listing the revision must not open it.
    model = repo / "data" / "bootstrap" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    write_table(_labels(2, -5.0), repo / "data" / "bootstrap" / "demos.parquet", "labels")
    run([str(BIN / "dvc"), "add", "-q", "data/bootstrap/model", "data/bootstrap/demos.parquet"], repo)
    run(["git", "add", "-A"], repo)
    run([*GIT, "commit", "-qm", "with a model"], repo)
    run(["git", "tag", "run2"], repo)
    shutil.rmtree(repo / ".dvc" / "cache")
    rev = Revision(repo, "run2")
    assert rev.tables() == [] and rev.missing == ["data/bootstrap/demos.parquet", "data/label/labels.parquet"]


def test_versions_are_the_commits_that_change_dvc_lock_oldest_first(repo):
    # `dvc add` writes .dvc files, not dvc.lock: a pipeline commit is what makes a version.
    assert list_versions(repo) == []
    (repo / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")
    run(["git", "add", "dvc.lock"], repo)
    run([*GIT, "commit", "-qm", "a pipeline run"], repo)
    [v] = list_versions(repo)
    assert (v.kind, v.message) == ("commit", "a pipeline run")


def test_ks_and_describe():
    a, b = np.array([-20.0, -20.0, -10.0]), np.array([-10.0, -10.0, -10.0])
    assert ks_statistic(a, a) == 0.0
    assert ks_statistic(a, b) == pytest.approx(2 / 3)
    assert ks_statistic(np.array([0.0]), np.array([1.0])) == 1.0
    assert ks_statistic(a, np.array([])) is None
    d = describe(a)
    assert d["n"] == 3 and d["mean"] == pytest.approx(-50 / 3) and d["p50"] == -20.0
    assert describe(np.array([])) is None


def _lock(model_md5: str, collect_saw: str, m: int) -> str:
    """A dvc.lock of two stages: bootstrap wrote the model `model_md5`; collect ran on the model
    `collect_saw` with collect.m = `m`."""
    return yaml.safe_dump({"schema": "2.0", "stages": {
        "bootstrap": {"cmd": "b", "outs": [{"path": "data/bootstrap/model", "hash": "md5", "md5": model_md5}]},
        "collect": {
            "cmd": "c",
            "deps": [{"path": "data/bootstrap/model", "hash": "md5", "md5": collect_saw}, {"path": "tasks/collect.py", "hash": "md5", "md5": "c0de"}],
            "params": {"params.yaml": {"collect.m": m, "seed": 0}},
            "outs": [{"path": "data/collect/trajectories.parquet", "hash": "md5", "md5": "t1"}],
        },
    }})


def test_a_stage_recorded_from_other_inputs_than_its_version_s_is_stale(repo):
    cases = {
        "fresh": (_lock("new.dir", "new.dir", 3), {}),
        "model": (_lock("new.dir", "old.dir", 3), {"collect": "data/bootstrap/model changed"}),
        "param": (_lock("new.dir", "new.dir", 2), {"collect": "param collect.m changed"}),
    }
    for tag, (lock, _) in cases.items():
        (repo / "dvc.lock").write_text(lock)
        (repo / "params.yaml").write_text("seed: 0\ncollect:\n  m: 3\n")
        run(["git", "add", "-A"], repo)
        run([*GIT, "commit", "-qm", tag], repo)
        run(["git", "tag", tag], repo)
    for tag, (_, stale) in cases.items():
        assert Revision(repo, tag).stale_stages() == stale, tag
    assert Revision(repo).stale_stages() == {"collect": "param collect.m changed"}  # the workspace
    assert Revision(repo, "run0").stale_stages() == {}  # no dvc.lock at all


@pytest.mark.system
def test_a_version_saved_after_only_leaves_the_stages_it_did_not_run_stale(tmp_path):
    """`run bootstrap --only --name`: `dvc exp save` must not record collect, whose model just
    changed under it, as up to date (issue 17: it did, with force)."""
    project = make_project(tmp_path)
    retro = str(BIN / "retrosight")
    run([str(BIN / "dvc"), "repro", "collect"], project)  # bootstrap, then collect on its model
    out = run([retro, "run", "bootstrap", "--only", "-S", "bootstrap.train.epochs=2", "--name", "ep2"], project).stdout
    assert "bootstrap: ran" in out and "Saved as DVC experiment ep2" in out, out
    assert "Left stale in it, as in the workspace: collect" in " ".join(out.split()), out

    status = json.loads(run([str(BIN / "dvc"), "status", "--json"], project).stdout)
    assert "collect" in status and "bootstrap" not in status, status
    assert status["collect"] == [{"changed deps": {"data/bootstrap/model": "modified"}}], status["collect"]
    # The experiment holds collect as it ran, on the old model, so it is stale there too.
    saved = Revision(project, "ep2")
    assert saved.stale_stages() == {"collect": "data/bootstrap/model changed"}
    assert saved.params()["bootstrap"]["train"]["epochs"] == 2

    versions = run([retro, "versions"], project).stdout
    row = next(line for line in versions.splitlines() if line.startswith("│ ep2"))
    assert row.rstrip(" │").endswith("collect"), versions
    inspect = run([retro, "inspect", "--rev", "ep2", "--sql", "SELECT count(*) AS n FROM collect.trajectories"], project)
    assert "note: at ep2, collect is stale (data/bootstrap/model changed since it ran)" in inspect.stderr, inspect.stderr
