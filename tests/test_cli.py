"""The command line as a user types it: import a log with a bad row, then inspect."""
import json

from conftest import BIN, ROOT, run

GOOD = {
    "task_id": "Apple",
    "env": "twenty_questions",
    "messages": [
        {"role": "user", "content": "Turn 1 of 20. Ask a yes-no question."},
        {"role": "assistant", "content": "REASON: Known: nothing yet.\nQUESTION: Is it Apple?"},
        {"role": "user", "content": "Answer: yes. You found it."},
    ],
    "return": 0.0,
    "success": True,
}


def test_import_quarantines_a_bad_row_and_inspect_shows_it(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    bad = dict(GOOD, task_id="Dog", seed="abc")
    (work / "logs.jsonl").write_text(json.dumps(GOOD) + "\n" + json.dumps(bad) + "\n{not json\n")
    out = run([str(BIN / "retrosight"), "import", "logs.jsonl"], work)
    assert "3 rows read, 1 imported, 2 quarantined" in out.stdout, out.stdout

    listing = run([str(BIN / "retrosight"), "inspect"], work)
    assert "import.trajectories" in listing.stdout and "import.quarantine" in listing.stdout
    # Files as the workspace names them, whole (the output is a pipe, where rich would cut at 80 columns).
    assert "data/import/trajectories.parquet" in listing.stdout and str(work) not in listing.stdout, listing.stdout
    assert "…" not in listing.stdout, listing.stdout

    q = run([str(BIN / "retrosight"), "inspect", "--sql", "SELECT row, field FROM import.quarantine ORDER BY row"], work)
    assert "seed" in q.stdout and "json" in q.stdout.lower()


def test_import_raise_mode_names_file_row_and_field(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "logs.jsonl").write_text(json.dumps(dict(GOOD, seed="abc")) + "\n")
    out = run([str(BIN / "retrosight"), "import", "logs.jsonl", "--on-error", "raise"], work, check=False)
    assert out.returncode != 0
    assert "logs.jsonl:1: field 'seed'" in out.stdout + out.stderr


def test_inspect_with_a_bad_query_names_the_problem(tmp_path):
    out = run([str(BIN / "retrosight"), "inspect", "--sql", "SELECT nope FROM nowhere"], tmp_path, check=False)
    assert out.returncode != 0 and "nowhere" in out.stdout


def test_every_dvc_stage_has_its_flow_and_each_is_imported_alone():
    """`retrosight stage NAME` imports only NAME's flow module: the table must name every dvc.yaml
    stage, and each entry must resolve to that stage's Prefect flow."""
    import yaml
    from prefect import Flow

    from flows.cli import STAGE_FLOWS, _stage_flow

    assert set(STAGE_FLOWS) == set(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])
    for group in STAGE_FLOWS:
        found = _stage_flow(group)
        assert isinstance(found, Flow) and found.name == group, (group, found)
    # In a new process, summarize's flow does not bring the actor's module or TRL with it.
    alone = "from flows.cli import _stage_flow; import sys; _stage_flow('summarize'); print(sorted({'flows.actor', 'flows.train', 'trl'} & set(sys.modules)))"
    assert run([str(BIN / "python"), "-c", alone], ROOT).stdout.strip() == "[]"


def test_a_preset_is_laid_over_params_yaml_keeping_its_comments(tmp_path):
    from flows.pipeline import apply_preset
    from tasks.params import load_params

    params = tmp_path / "params.yaml"
    params.write_text((ROOT / "params.yaml").read_text())
    apply_preset(ROOT / "bench/presets/hr_persuasion.yaml", params)
    p = load_params(params)
    assert p.env.name == "persuasion" and p.env.environment().options.max_turns == 10  # persuasion's own default, not 20Q's 20
    assert list(p.train.methods) == ["ilql_logged", "ilql", "filtered_bc_logged", "filtered_bc"]  # the arms replaced whole
    assert p.relabel.hr_suggestions == 3 and p.relabel.k == 2  # merged: the preset's key set, params.yaml's others kept
    text = params.read_text()
    assert "# HOPE's replay buffer and critic targets" in text  # comments of untouched keys stay


def test_run_with_a_bad_preset_names_it_and_leaves_params_yaml_alone(tmp_path):
    out = run([str(BIN / "retrosight"), "run"], tmp_path, check=False)
    assert out.returncode != 0 and "no dvc.yaml in" in out.stdout + out.stderr, out.stdout + out.stderr
    for name in ("params.yaml", "dvc.yaml"):
        (tmp_path / name).write_text((ROOT / name).read_text())
    for preset, says in (("missing.yaml", "preset missing.yaml: not found"), ("list.yaml", "expected a mapping of params keys")):
        (tmp_path / "list.yaml").write_text("- a\n- b\n")
        out = run([str(BIN / "retrosight"), "run", "--preset", preset], tmp_path, check=False)
        assert out.returncode != 0 and says in out.stdout + out.stderr, out.stdout + out.stderr
        assert (tmp_path / "params.yaml").read_text() == (ROOT / "params.yaml").read_text()


def _split(success: float, se: float, ret: float) -> dict:
    return {"episodes": 48, "success_rate": success, "success_se": se, "mean_return": ret, "return_se": 1.3, "mean_turns": 17.5, "turns_se": 0.7}


def test_results_print_whole_figures_into_a_pipe_at_any_width(tmp_path):
    """rich cuts a table to 80 columns (or $COLUMNS) when its output is not a terminal: figures
    came out as `0.000±0.0…` in make run's log. Into a pipe, the table is printed whole."""
    names = ["bootstrap", "refit_logged", "filtered_bc_logged", "bootstrap+best_of_4", "a_policy_with_a_long_name_of_its_own"]
    metrics = {
        "splits": ["val", "test"], "episodes_per_task": 1, "sampling": {"temperature": 0.7, "top_p": 1.0, "max_new_tokens": 112},
        "policies": {n: {s: _split(0.125 * i, 0.0478, -20.0 + i) for s in ("val", "test", "heldout")} for i, n in enumerate(names)},
    }
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    for columns in ("80", "40"):
        out = run([str(BIN / "retrosight"), "results", "--metrics", "metrics.json"], tmp_path, env_extra={"COLUMNS": columns}).stdout
        assert "…" not in out, out
        for i, name in enumerate(names):
            row = next(line for line in out.splitlines() if f" {name} " in line)
            cells = [c.strip() for c in row.strip("│ ").split("│")]
            assert cells == [name, *[f"{0.125 * i:.3f}±0.048"] * 3, f"{-20.0 + i:.1f}±1.3", "17.5±0.7"], row


def test_inspect_names_a_table_at_a_revision_by_its_path_in_the_repository():
    from pathlib import Path

    from flows.cli import _repo_path
    from storage.catalog import TableInfo

    cached = Path("/elsewhere/.dvc/cache/files/md5/ab/cdef")  # where a revision's file is read from
    for stage, table, path in (("collect", "trajectories", "data/collect/trajectories.parquet"),
                               ("iteration2_collect", "trajectories", "data/iteration2/collect/trajectories.parquet")):
        assert _repo_path(TableInfo(stage, table, cached, 1, "trajectories", 1)) == path
