"""storage: versioned schemas, deterministic atomic Parquet, the DuckDB catalog, content IDs."""
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage.catalog import list_tables, open_catalog
from storage.parquet import SchemaVersionError, read_polars, read_table, write_table
from storage.schema import SCHEMAS, from_table, to_table, trajectory_id

ROOT = Path(__file__).resolve().parents[1]


def traj(task_id: str = "apple", **overrides) -> dict:
    row = {
        "env": "twenty_questions",
        "task_id": task_id,
        "split": "train",
        "source": "policy",
        "parent_id": None,
        "branch_turn": None,
        "relabel_id": None,
        "policy_id": "tiny",
        "seed": 7,
        "messages": [
            {"role": "system", "content": "Guess the object."},
            {"role": "user", "content": "Ask your first question."},
            {"role": "assistant", "content": "Is it a fruit?"},
            {"role": "user", "content": "Yes."},
        ],
        "turns": [{"turn": 0, "reason": "", "action": "Is it a fruit?", "observation": "Yes.", "reward": None}],
        "return": None,
        "success": None,
        "num_turns": 1,
    }
    row.update(overrides)
    return {"trajectory_id": trajectory_id(row), **row}


def quarantine_rows() -> list[dict]:
    return [
        {"source_file": "logs.jsonl", "row": 3, "field": "seed", "reason": "expected an integer", "raw": '{"seed": "abc"}'},
        {"source_file": "logs.jsonl", "row": 9, "field": "json", "reason": "invalid JSON", "raw": "{"},
    ]


def test_trajectories_round_trip_keeps_nulls_and_nested_lists(tmp_path):
    rows = [
        traj(),
        traj(
            "pear",
            source="regeneration",
            parent_id="abc",
            branch_turn=2,
            relabel_id="r1",
            turns=[{"turn": 0, "reason": "why", "action": "Is it red?", "observation": "No.", "reward": -1.0}],
            messages=[{"role": "assistant", "content": "Is it red?"}],
            **{"return": -1.0, "success": False},
        ),
    ]
    path = tmp_path / "trajectories.parquet"
    write_table(to_table(rows, "trajectories"), path, "trajectories")
    table = read_table(path, "trajectories")
    assert table.schema.names == SCHEMAS["trajectories"].schema.names
    assert from_table(table) == rows  # the messages as written: no tool keys appear
    assert from_table(read_polars(path, "trajectories")) == rows


def test_quarantine_round_trip(tmp_path):
    path = tmp_path / "quarantine.parquet"
    write_table(to_table(quarantine_rows(), "quarantine"), path, "quarantine")
    assert read_table(path, "quarantine").to_pylist() == quarantine_rows()


@pytest.mark.parametrize(
    "override, match",
    [
        ({"seed": 1.5}, r"row 1, column 'seed': expected int64, got float"),
        ({"num_turns": 2**40}, r"row 1, column 'num_turns'"),
        ({"split": None}, r"row 1, column 'split': null"),
        ({"messages": [{"role": "user", "content": None}]}, r"row 1, column 'messages'\[0\]\.content: null"),
        ({"turns": [{"turn": 0, "reason": "", "action": "a", "observation": "o", "reward": "high"}]}, r"column 'turns'.*reward"),
        ({"sucess": True}, r"row 1: unknown column 'sucess'"),
    ],
)
def test_to_table_names_the_row_and_column_of_a_bad_value(override, match):
    rows = [traj(), {**traj("pear"), **override}]
    with pytest.raises(ValueError, match=match):
        to_table(rows, "trajectories")


def test_write_casts_compatible_columns_and_names_an_incompatible_one(tmp_path):
    rows = [traj(), traj("pear")]
    from_polars = pl.DataFrame(rows).to_arrow()  # large strings, int64 where the schema has int32
    path = tmp_path / "t.parquet"
    write_table(from_polars, path, "trajectories")
    assert from_table(read_table(path)) == rows

    bad = to_table(rows, "trajectories").set_column(9, "seed", pa.array(["x", "y"]))
    with pytest.raises(ValueError, match=r"column 'seed': cannot store string as int64"):
        write_table(bad, path, "trajectories")
    with pytest.raises(ValueError, match=r"lacks column 'num_turns'"):
        write_table(to_table(rows, "trajectories").drop_columns(["num_turns"]), path, "trajectories")
    nulls = to_table(rows, "trajectories").set_column(2, "task_id", pa.array([None, "x"], pa.string()))
    with pytest.raises(ValueError, match=r"column 'task_id': null in a non-nullable field"):
        write_table(nulls, path, "trajectories")


def test_same_table_writes_byte_identical_files(tmp_path):
    table = to_table([traj(), traj("pear")], "trajectories")
    write_table(table, tmp_path / "a/t.parquet", "trajectories")
    write_table(table, tmp_path / "b/t.parquet", "trajectories")
    first = (tmp_path / "a/t.parquet").read_bytes()
    assert (tmp_path / "b/t.parquet").read_bytes() == first
    write_table(table, tmp_path / "a/t.parquet", "trajectories")  # overwrite in place
    assert (tmp_path / "a/t.parquet").read_bytes() == first
    assert os.listdir(tmp_path / "a") == ["t.parquet"]  # no temp file left behind

    meta = pq.read_metadata(tmp_path / "a/t.parquet")
    assert meta.metadata[b"retrosight.schema"] == b"trajectories"
    assert meta.metadata[b"retrosight.schema_version"] == b"2"
    assert meta.row_group(0).column(0).compression == "ZSTD"


# Runs in a child process: a file-size limit makes the write fail for real, halfway through.
FAILING_WRITE = """
import os, resource, signal, sys
from storage.parquet import write_table
from storage.schema import to_table
rows = [{"source_file": "f", "row": i, "field": "x", "reason": "r", "raw": os.urandom(1000).hex()} for i in range(1000)]
table = to_table(rows, "quarantine")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG as an OSError instead of being killed
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    write_table(table, sys.argv[1], "quarantine")
except OSError as e:
    print("write failed:", e)
    sys.exit(3)
"""


def failing_write(target: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", FAILING_WRITE, str(target)], env=env, capture_output=True, text=True)


def test_failed_write_leaves_no_partial_or_temp_file(tmp_path):
    fresh = tmp_path / "fresh/quarantine.parquet"
    result = failing_write(fresh)
    assert result.returncode == 3, result.stderr
    assert os.listdir(fresh.parent) == []

    existing = tmp_path / "existing/quarantine.parquet"
    write_table(to_table(quarantine_rows(), "quarantine"), existing, "quarantine")
    before = existing.read_bytes()
    result = failing_write(existing)
    assert result.returncode == 3, result.stderr
    assert os.listdir(existing.parent) == ["quarantine.parquet"]
    assert existing.read_bytes() == before
    assert read_table(existing, "quarantine").num_rows == 2


def test_newer_version_wrong_name_and_missing_metadata_are_refused(tmp_path):
    path = tmp_path / "x.parquet"
    write_table(to_table([traj()], "trajectories"), path, "trajectories")
    table = pq.read_table(path)

    newer = table.replace_schema_metadata({**table.schema.metadata, b"retrosight.schema_version": b"7"})
    pq.write_table(newer, path)
    with pytest.raises(SchemaVersionError) as e:
        read_table(path, "trajectories")
    assert str(e.value) == f"{path}: 'trajectories' schema version 7 is not supported (this build reads version 2)"
    older = table.replace_schema_metadata({**table.schema.metadata, b"retrosight.schema_version": b"1"})  # before tool messages
    pq.write_table(older, path)
    with pytest.raises(SchemaVersionError, match=r"version 1 is not supported \(this build reads version 2\); it was written by an older build: rerun"):
        read_table(path, "trajectories")

    pq.write_table(table, path)
    with pytest.raises(SchemaVersionError, match=r"x\.parquet: expected a 'quarantine' table, found 'trajectories'"):
        read_table(path, "quarantine")

    pq.write_table(table.replace_schema_metadata(None), path)
    with pytest.raises(SchemaVersionError, match=r"x\.parquet: no retrosight schema metadata"):
        read_table(path)


def test_catalog_exposes_each_stage_table_as_a_view(tmp_path):
    write_table(to_table([traj(), traj("pear"), traj("fig")], "trajectories"), tmp_path / "collect/trajectories.parquet", "trajectories")
    write_table(to_table(quarantine_rows(), "quarantine"), tmp_path / "import/quarantine.parquet", "quarantine")
    write_table(to_table([traj()], "trajectories"), tmp_path / 'we"ird/my table.parquet', "trajectories")
    (tmp_path / "other").mkdir()
    pq.write_table(pa.table({"a": [1]}), tmp_path / "other/plain.parquet")

    infos = {(t.stage, t.table): t for t in list_tables(tmp_path)}
    assert set(infos) == {("collect", "trajectories"), ("import", "quarantine"), ('we"ird', "my table"), ("other", "plain")}
    assert (infos["collect", "trajectories"].rows, infos["collect", "trajectories"].schema_version) == (3, 2)
    assert infos["import", "quarantine"].schema_name == "quarantine"
    assert infos["other", "plain"].schema_name is None

    con = open_catalog(tmp_path)
    assert con.sql("SELECT count(*) FROM collect.trajectories").fetchall() == [(3,)]
    assert con.sql("SELECT row, field FROM import.quarantine ORDER BY row").fetchall() == [(3, "seed"), (9, "json")]
    assert con.sql('SELECT count(*) FROM "we""ird"."my table"').fetchall() == [(1,)]
    # A table name only one stage writes is also a plain view.
    assert con.sql("SELECT count(*) FROM quarantine").fetchall() == [(2,)]

    # A view reads its file at query time, so an atomic replacement shows up.
    write_table(to_table([traj()], "trajectories"), tmp_path / "collect/trajectories.parquet", "trajectories")
    assert con.sql("SELECT count(*) FROM collect.trajectories").fetchall() == [(1,)]


def test_a_table_name_two_stages_write_gets_no_plain_view(tmp_path):
    for stage in ("collect", "regenerate"):
        write_table(to_table([traj()], "trajectories"), tmp_path / stage / "trajectories.parquet", "trajectories")
    con = open_catalog(tmp_path)
    assert con.sql("SELECT count(*) FROM regenerate.trajectories").fetchall() == [(1,)]
    with pytest.raises(duckdb.CatalogException):
        con.sql("SELECT count(*) FROM trajectories")


def test_trajectory_id_is_stable_and_content_sensitive():
    row = traj()
    # Pinned: changing how IDs are computed silently changes every stored dataset.
    assert row["trajectory_id"] == trajectory_id(dict(reversed(list(row.items())))) == "7443813d245dfc41"
    assert trajectory_id({**row, "return": 1.0, "success": True, "turns": []}) == row["trajectory_id"]
    changes = {
        "env": "other", "task_id": "pear", "split": "val", "source": "import", "parent_id": "p", "branch_turn": 1,
        "relabel_id": "r", "policy_id": "big", "seed": 8, "messages": row["messages"][:-1],
    }
    ids = {trajectory_id({**row, key: value}) for key, value in changes.items()}
    assert len(ids) == len(changes) and row["trajectory_id"] not in ids
