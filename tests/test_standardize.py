"""Standardization on hand-computed examples, std = 0 and m = 1 included, with the statistics
of the logged rows or of every row; Refit's weight map; the stage streaming its inputs writes
what it writes in one piece."""
import importlib.util
import math
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import tasks.standardize as stage
from storage import validate
from storage.parquet import TableWriter, write_table
from tasks.params import load_params
from tasks.standardize import counts, refit_weight, standardize


def frame(groups: dict[str, list], regenerations: dict[str, list] | None = None) -> pl.DataFrame:
    """One row per reward: logged rows (source "policy") per task, then its regenerations."""
    rows = [
        {"trajectory_id": f"{t}-{source[0]}{i}", "env": "e", "task_id": t, "source": source, "reward": r}
        for source, tasks in (("policy", groups), ("regeneration", regenerations or {}))
        for t, rs in tasks.items() for i, r in enumerate(rs)
    ]
    schema = {"trajectory_id": pl.Utf8, "env": pl.Utf8, "task_id": pl.Utf8, "source": pl.Utf8, "reward": pl.Float64}
    return pl.DataFrame(rows, schema=schema)


def z(df: pl.DataFrame, task: str) -> list:
    return df.filter(pl.col("task_id") == task)["standardized_reward"].to_list()


def test_per_context_uses_the_unbiased_std():
    # Rewards 1, 2, 3: mean 2, sample std sqrt(((1)^2 + 0 + 1^2) / 2) = 1 -> z = -1, 0, 1.
    # Rewards 0, 0, 3: mean 1, sample std sqrt((1 + 1 + 4) / 2) = sqrt(3).
    out = standardize(frame({"a": [1.0, 2.0, 3.0], "b": [0.0, 0.0, 3.0]}))
    assert z(out, "a") == pytest.approx([-1.0, 0.0, 1.0])
    s3 = math.sqrt(3)
    assert z(out, "b") == pytest.approx([-1 / s3, -1 / s3, 2 / s3])
    # With m = 3 every group's z sums to 0 and their squares to m - 1 = 2.
    assert sum(z(out, "b")) == pytest.approx(0.0)
    assert sum(v * v for v in z(out, "b")) == pytest.approx(2.0)


def test_tied_group_and_singleton_get_zero_weight_and_a_status():
    out = standardize(frame({"tied": [-20.0, -20.0, -20.0], "one": [-5.0], "ok": [-20.0, -8.0]}))
    assert z(out, "tied") == [0.0, 0.0, 0.0]
    assert z(out, "one") == [0.0]
    # Two rewards: mean -14, sample std sqrt(36 + 36) = 8.485 -> z = -/+ 1/sqrt(2).
    assert z(out, "ok") == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)])
    assert counts(out) == {"ok": 2, "singleton": 1, "tied": 3}


def test_missing_rewards_are_kept_and_left_out_of_the_statistics():
    out = standardize(frame({"a": [1.0, None, 3.0]}))
    assert z(out, "a")[1] is None
    assert z(out, "a")[0] == pytest.approx(-1 / math.sqrt(2))  # mean 2, std sqrt(2)
    assert out["group_size"].to_list() == [2, 2, 2]
    assert counts(out) == {"no_reward": 1, "ok": 2}
    assert out.height == 3  # nothing dropped


def test_global_and_min_max_modes():
    df = frame({"a": [0.0, 2.0], "b": [4.0]})
    g = standardize(df, mode="global")  # mean 2, sample std 2
    assert g["standardized_reward"].to_list() == pytest.approx([-1.0, 0.0, 1.0])
    mm = standardize(df, mode="min_max")
    assert mm["standardized_reward"].to_list() == pytest.approx([0.0, 0.5, 1.0])
    flat = standardize(frame({"a": [3.0, 3.0]}), mode="min_max")
    assert flat["standardized_reward"].to_list() == [0.0, 0.0]
    assert counts(flat) == {"tied": 2}


def test_clipping():
    out = standardize(frame({"a": [0.0, 0.0, 0.0, 0.0, 10.0]}), clip=1.0)
    values = z(out, "a")
    assert max(values) == 1.0 and min(values) == pytest.approx(-0.4472135955)


def test_logged_statistics_score_every_row_of_the_context_against_its_logged_rows():
    # Logged -20, -20, -5: mean -15, sample std sqrt((25 + 25 + 100) / 2) = sqrt(75). The
    # regenerations -2 and -20 are scored against them: (-2 + 15) / sqrt(75), (-20 + 15) / sqrt(75).
    df = frame({"a": [-20.0, -20.0, -5.0]}, {"a": [-2.0, -20.0]})
    out = standardize(df)
    s75 = math.sqrt(75)
    assert z(out, "a") == pytest.approx([-5 / s75, -5 / s75, 10 / s75, 13 / s75, -5 / s75])
    assert out["group_size"].to_list() == [3] * 5 and out["group_mean"].to_list() == pytest.approx([-15.0] * 5)
    assert out["group_std"].to_list() == pytest.approx([s75] * 5) and counts(out) == {"ok": 5}
    # pooled: the five rewards together, mean -13.4.
    pooled = standardize(df, stats="pooled")
    assert pooled["group_size"].to_list() == [5] * 5 and pooled["group_mean"].to_list() == pytest.approx([-13.4] * 5)


def test_the_tie_rules_apply_to_the_logged_rows_and_their_regenerations_follow():
    out = standardize(frame({"tied": [-20.0, -20.0, -20.0], "one": [-20.0]}, {"tied": [-3.0], "one": [-3.0, -1.0]}))
    assert z(out, "tied") == [0.0] * 4 and z(out, "one") == [0.0] * 3
    assert out.filter(pl.col("task_id") == "tied")["standardize_status"].to_list() == ["tied"] * 4
    assert out.filter(pl.col("task_id") == "one")["standardize_status"].to_list() == ["singleton"] * 3
    # Pooled, the regenerations break both ties.
    assert counts(standardize(frame({"tied": [-20.0, -20.0, -20.0], "one": [-20.0]}, {"tied": [-3.0], "one": [-3.0, -1.0]}), stats="pooled")) == {"ok": 7}


def test_refit_weight_maps_an_environment_return_onto_zero_to_one():
    # TwentyQuestions: -1 per turn, 0 for the correct guess, so a win at turn j returns -(j - 1)
    # and weighs 1 - (j - 1) / T; a loss returns -T and weighs 0.
    df = frame({"a": [-20.0, 0.0, -4.0, -19.0, None]})
    assert refit_weight(df, "return_range", (-20.0, 0.0))["weight"].to_list() == pytest.approx([0.0, 1.0, 0.8, 0.05, None])
    assert refit_weight(frame({"a": [-8.0, -2.0]}), "return_range", (-8.0, 0.0))["weight"].to_list() == pytest.approx([0.0, 0.75])


def test_refit_weight_identity_keeps_a_reward_already_in_zero_to_one():
    df = frame({"a": [0.0, 0.35, 1.0, None]})  # a rubric judge's Overall / 10
    assert refit_weight(df, "identity", (-20.0, 0.0))["weight"].to_list() == [0.0, 0.35, 1.0, None]


def test_a_reward_outside_the_weight_map_is_an_error_naming_the_rows():
    with pytest.raises(ValueError, match=r"1 reward\(s\) outside \[-20, 0\].*weight: return_range.*: a-p1 \(0\.7\).*weight: identity"):
        refit_weight(frame({"a": [-3.0, 0.7]}), "return_range", (-20.0, 0.0))
    with pytest.raises(ValueError, match=r"2 reward\(s\) outside \[0, 1\].*: a-p0 \(-3\), a-p2 \(-20\)"):
        refit_weight(frame({"a": [-3.0, 0.7, -20.0]}), "identity", (-20.0, 0.0))


def test_the_logged_rows_weigh_the_same_with_or_without_regenerations_in_the_table():
    # The regenerations reach a return (-1) and a z beyond the logged rows'; neither may move
    # the logged rows' Refit weight or Swift z, so the logged-only arm sees the same numbers.
    logged = {"a": [-20.0, -5.0, -12.0], "b": [-20.0, -20.0, -3.0]}
    alone = refit_weight(standardize(frame(logged)), "return_range", (-20.0, 0.0))
    mixed = refit_weight(standardize(frame(logged, {"a": [-1.0, -20.0], "b": [0.0]})), "return_range", (-20.0, 0.0))
    mixed = mixed.filter(pl.col("source") != "regeneration")
    assert mixed["trajectory_id"].to_list() == alone["trajectory_id"].to_list()
    for column in ("weight", "standardized_reward", "group_mean", "group_std", "group_size"):
        assert mixed[column].to_list() == alone[column].to_list(), column


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="no column 'score'"):
        standardize(frame({"a": [1.0]}), reward="score")
    with pytest.raises(ValueError, match="clip must be > 0"):
        standardize(frame({"a": [1.0]}), clip=0)
    with pytest.raises(ValueError, match="no column 'source'"):  # stats: logged tells the logged rows by it
        standardize(frame({"a": [1.0]}).drop("source"))


# --- the stage streaming its inputs --------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("data_scale", ROOT / "bench" / "data_scale.py")
data_scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(data_scale)  # the bench's generator of valid trajectories and labels


@pytest.fixture(scope="module")
def faulty_inputs(tmp_path_factory) -> tuple[list[Path], Path]:
    """Two trajectory files and labels with every case the stage handles: rows the checks
    quarantine (an edited text, a duplicate ID), other splits, failed labels, trajectories with
    no label row, and a label quarantined in turn."""
    d = tmp_path_factory.mktemp("streaming")
    rng = np.random.default_rng(7)
    table = data_scale._chunk(rng, 0, 400, 12)
    labels = data_scale._labels(rng, table)
    rows = table.to_pylist()
    rows[5]["messages"][-1]["content"] += " (edited)"  # hash mismatch
    rows[40] = dict(rows[3])  # a duplicate ID, later in the file
    rows[250] = dict(rows[120])
    bad_labels = labels.to_pylist()
    for r in (10, 11, 300):
        bad_labels[r]["reward"] = None  # ok without a reward: quarantined, so its trajectory too
    keep = [r for r in range(len(bad_labels)) if r % 97 != 1]  # a few trajectories without a label row
    a, b = d / "a.parquet", d / "b.parquet"
    write_table(pa.Table.from_pylist(rows[:260], schema=table.schema), a, "trajectories")
    write_table(pa.Table.from_pylist(rows[260:], schema=table.schema), b, "trajectories")
    write_table(pa.Table.from_pylist([bad_labels[r] for r in keep], schema=labels.schema), d / "labels.parquet", "labels")
    return [a, b], d / "labels.parquet"


def _outputs(out: Path) -> dict[str, bytes]:
    names = ["train.parquet", "export/train.parquet", "quarantine.parquet", "plots/weight.json", "plots/standardized_reward.json"]
    return {name: (out / name).read_bytes() for name in names}


def test_streaming_in_small_batches_and_blocks_writes_the_same_bytes(faulty_inputs, tmp_path, monkeypatch):
    files, labels = faulty_inputs
    params = load_params(ROOT / "params.yaml")
    whole = stage.run_standardize(params, files, labels, tmp_path / "whole")
    monkeypatch.setattr(validate, "BATCH_ROWS", 7)  # many check batches per file
    monkeypatch.setattr(stage, "SORT_BLOCK_ROWS", 25)  # many output blocks in each batch's spill file
    monkeypatch.setattr(stage, "WRITE_ROWS", 10)
    monkeypatch.setattr(validate, "POOL_MIN_ROWS", 0)  # checked in worker processes
    phases = {}
    pieces = stage.run_standardize(params, files, labels, tmp_path / "pieces", phases=phases)
    assert _outputs(tmp_path / "whole") == _outputs(tmp_path / "pieces")
    assert {k: v for k, v in whole.items() if k != "seconds"} == {k: v for k, v in pieces.items() if k != "seconds"}
    assert set(phases) == {"read_check", "check", "join", "standardize", "export"} and all(v >= 0 for v in phases.values())
    # Every case happened, and rows in = rows out + other splits + quarantined trajectories.
    q = pq.read_table(tmp_path / "pieces" / "quarantine.parquet").to_pylist()
    reasons = " | ".join(r["reason"] for r in q)
    assert "duplicate of row 3" in reasons and "content hash" in reasons and "no usable label row" in reasons
    assert pieces["rows_other_splits"] > 0 and pieces["status"]["no_reward"] > 0
    quarantined = sum(pieces["inputs"][str(f)]["quarantined"] for f in files)
    assert 400 == pieces["rows_out"] + pieces["rows_other_splits"] + quarantined
    train = pq.read_table(tmp_path / "pieces" / "train.parquet")
    assert train.num_rows == pieces["rows_out"] and train.column("trajectory_id").to_pylist() == train.sort_by([("task_id", "ascending"), ("trajectory_id", "ascending")]).column("trajectory_id").to_pylist()
    # Each row carries its own trajectory's messages.
    source = pa.concat_tables([pq.read_table(f) for f in files])
    by_id = dict(zip(source.column("trajectory_id").to_pylist(), source.column("messages").to_pylist()))
    assert all(by_id[i] == m for i, m in zip(train.column("trajectory_id").to_pylist(), train.column("messages").to_pylist()))


def test_scan_checked_keeps_and_quarantines_what_read_checked_does(faulty_inputs, monkeypatch):
    path = faulty_inputs[0][0]
    kept, quarantine = validate.read_checked(path, "trajectories")
    monkeypatch.setattr(validate, "BATCH_ROWS", 9)
    columns = ["trajectory_id", "task_id"]
    scanned, rows, scanned_quarantine, seconds, hooked = validate.scan_checked(path, "trajectories", columns)
    assert scanned.equals(kept.select(columns)) and scanned_quarantine.equals(quarantine) and seconds > 0 and hooked == []
    assert quarantine.num_rows == 3 and len(rows) + quarantine.num_rows == pq.ParquetFile(path).metadata.num_rows
    assert pc.all(pc.equal(pq.read_table(path).take(pa.array(rows)).column("trajectory_id"), kept.column("trajectory_id"))).as_py()


def _kept_rows(path, start, batch, keep):
    return (start, batch.num_rows, int(keep.sum()))


def test_check_pool_gives_in_process_results_in_file_order(faulty_inputs, tmp_path, monkeypatch):
    # Row groups of 10 rows, a task per 2 groups: the workers' results come back in many pieces.
    path = tmp_path / "groups.parquet"
    table = pq.read_table(faulty_inputs[0][0])
    pq.write_table(table, path, row_group_size=10)
    columns = ["trajectory_id", "task_id"]
    alone = validate.scan_checked(path, "trajectories", columns, validate.CheckPool({"trajectories": _kept_rows}, workers=1))
    monkeypatch.setattr(validate, "POOL_MIN_ROWS", 0)
    monkeypatch.setattr(validate, "TASK_ROWS", 20)
    with validate.CheckPool({"trajectories": _kept_rows}, workers=2) as pool:
        pooled = validate.scan_checked(path, "trajectories", columns, pool)
        assert pool._executor is not None  # the workers did the checks
    assert pooled[0].equals(alone[0]) and np.array_equal(pooled[1], alone[1]) and pooled[2].equals(alone[2]) and pooled[3] > 0
    assert pooled[2].num_rows == 3 and pooled[2].column("source_file")[0].as_py() == str(path)
    # The hook saw every batch, in file order: in-process one batch, in the pool one per task.
    # (Rows the batch checks keep: duplicates are only found afterwards, across batches.)
    assert len(alone[4]) == 1 and alone[4][0][:2] == (0, table.num_rows) and alone[4][0][2] > len(alone[1])
    assert [h[0] for h in pooled[4]] == list(range(0, table.num_rows, 20)) and sum(h[2] for h in pooled[4]) == alone[4][0][2]


def test_table_writer_writes_write_tables_bytes(tmp_path):
    rng = np.random.default_rng(3)
    one = data_scale._chunk(rng, 0, 2000, 5)
    big = pa.concat_tables([one] * 12)  # 24,000 rows: several row groups
    for n in (0, 3, big.num_rows):
        part = big.slice(0, n)
        write_table(part, tmp_path / "a.parquet", "trajectories")
        with TableWriter(tmp_path / "b.parquet", "trajectories") as w:
            for i in range(0, n, 4321):  # pieces across the 10,000-row groups
                w.write(part.slice(i, 4321))
        assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes(), n
    with pytest.raises(RuntimeError), TableWriter(tmp_path / "c.parquet", "trajectories") as w:
        w.write(big.slice(0, 100))
        raise RuntimeError("killed")
    assert list(tmp_path.glob("*c.parquet*")) == []


def _dvc(cwd: Path, *args: str) -> None:
    import subprocess
    import sys

    subprocess.run([str(Path(sys.executable).parent / "dvc"), *args], cwd=cwd, check=True, capture_output=True, text=True)


def test_a_file_as_its_stage_wrote_it_is_not_rehashed_and_one_edited_by_hand_is(tmp_path):
    """The content hash is skipped only for a file byte for byte the output DVC recorded for its
    stage; a row edited by hand afterwards changes the file's MD5, and the row is quarantined."""
    rng = np.random.default_rng(11)
    table = data_scale._chunk(rng, 0, 60, 3)
    write_table(data_scale._labels(rng, table), tmp_path / "labels.parquet", "labels")
    rows = table.to_pylist()
    rows[7]["trajectory_id"] = "0123456789abcdef"  # a wrong ID, in the file as the stage wrote it
    written = tmp_path / "trajectories.parquet"
    write_table(pa.Table.from_pylist(rows, schema=table.schema), written, "trajectories")
    _dvc(tmp_path, "init", "--no-scm", "-q")
    _dvc(tmp_path, "stage", "add", "-q", "-n", "collect", "-O", "trajectories.parquet", "echo collected")
    _dvc(tmp_path, "commit", "-f", "-q", "collect")  # dvc.lock: the file's MD5, as `dvc repro` records it
    from storage.recorded import as_written, file_md5, recorded_md5

    assert recorded_md5(written) == file_md5(written) and as_written(written)
    _, quarantine = validate.scan_checked(written, "trajectories", ["trajectory_id"])[1:3]
    assert quarantine.num_rows == 0  # trusted: the writing stage computed the IDs (here, one wrongly on purpose)

    edited = pq.read_table(written)
    messages = edited.column("messages").to_pylist()
    messages[20][-1]["content"] += " (edited)"
    edited = edited.set_column(edited.schema.get_field_index("messages"), edited.schema.field("messages"),
                               pa.array(messages, edited.schema.field("messages").type))
    pq.write_table(edited, written)  # by hand, with pyarrow, as a user would: the schema's metadata kept
    assert not as_written(written)
    metrics = stage.run_standardize(load_params(ROOT / "params.yaml"), [written], tmp_path / "labels.parquet", tmp_path / "out")
    q = pq.read_table(tmp_path / "out" / "quarantine.parquet").to_pylist()
    by_row = {r["row"]: r["reason"] for r in q if r["field"] == "trajectory_id"}
    assert "content hash" in by_row[20] and "content hash" in by_row[7], q  # both: the whole file is hashed again
    assert metrics["inputs"][str(written)]["quarantined"] >= 2
