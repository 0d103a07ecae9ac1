"""Importing chat-format logs: good rows converted, every bad row named by file, row and field."""
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage.parquet import read_table
from storage.schema import from_table, trajectory_id
from tasks.ingest import ImportValidationError, import_trajectories, write_import


def good(task_id: str = "apple", **extra) -> dict:
    return {
        "messages": [
            {"role": "system", "content": "Guess the object."},
            {"role": "user", "content": "Ask a question."},
            {"role": "assistant", "content": "Is it a fruit?"},
            {"role": "user", "content": "Yes."},
            {"role": "assistant", "content": "Is it an apple?"},
        ],
        "task_id": task_id,
        "env": "twenty_questions",
        **extra,
    }


def full(task_id: str = "pear") -> dict:
    """A row with every optional field given."""
    turns = [
        {"turn": 0, "reason": "start broad", "action": "Is it a fruit?", "observation": "Yes.", "reward": -1.0},
        {"turn": 1, "reason": "guess", "action": "Is it an apple?", "observation": "", "reward": None},
    ]
    return good(task_id, split="val", policy_id="gpt", seed=3, turns=turns, success=True, **{"return": -1.0})


def write_jsonl(path: Path, rows: list) -> Path:
    """Dicts become JSON lines; strings are written as they are (to write broken lines)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_good_jsonl_import(tmp_path):
    minimal = good()
    del minimal["env"]  # filled from the env argument
    path = write_jsonl(tmp_path / "logs.jsonl", [full(), "", minimal])
    trajectories, quarantine = import_trajectories(path, env="twenty_questions")
    assert quarantine.num_rows == 0
    rows = {r["task_id"]: r for r in from_table(trajectories)}
    assert [r["trajectory_id"] for r in trajectories.to_pylist()] == sorted(r["trajectory_id"] for r in rows.values())

    apple = rows["apple"]
    assert (apple["env"], apple["split"], apple["policy_id"], apple["seed"]) == ("twenty_questions", "train", "import", 0)
    assert (apple["source"], apple["parent_id"], apple["branch_turn"], apple["relabel_id"]) == ("import", None, None, None)
    assert (apple["return"], apple["success"], apple["num_turns"]) == (None, None, 2)
    assert apple["turns"] == [
        {"turn": 0, "reason": "", "action": "Is it a fruit?", "observation": "Yes.", "reward": None},
        {"turn": 1, "reason": "", "action": "Is it an apple?", "observation": "", "reward": None},
    ]
    assert apple["trajectory_id"] == trajectory_id(apple)

    pear = rows["pear"]
    assert (pear["split"], pear["policy_id"], pear["seed"], pear["return"], pear["success"]) == ("val", "gpt", 3, -1.0, True)
    assert pear["turns"] == full()["turns"]
    assert pear["messages"] == full()["messages"]


def test_good_parquet_import_matches_the_same_rows_in_jsonl(tmp_path):
    rows = [full("pear"), full("fig")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "logs.parquet")
    from_parquet, quarantine = import_trajectories(tmp_path / "logs.parquet")
    from_jsonl, _ = import_trajectories(write_jsonl(tmp_path / "logs.jsonl", rows))
    assert quarantine.num_rows == 0 and from_parquet.num_rows == 2
    assert from_parquet.equals(from_jsonl)


def test_parquet_rows_are_numbered_from_zero(tmp_path):
    rows = [good("pear"), good("fig"), good("kiwi")]
    rows[1]["task_id"] = None
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "logs.parquet")
    _, quarantine = import_trajectories(tmp_path / "logs.parquet")
    assert quarantine.select(["row", "field", "reason"]).to_pylist() == [{"row": 1, "field": "task_id", "reason": "missing"}]


def with_message(i: int, **change) -> dict:
    row = good()
    row["messages"][i] = {**row["messages"][i], **change}
    return row


def without(key: str) -> dict:
    row = good()
    del row[key]
    return row


def with_roles(*roles: str) -> dict:
    return good(messages=[{"role": r, "content": f"message {i}"} for i, r in enumerate(roles)])


def with_turn(i: int, **change) -> dict:
    turns = full()["turns"]
    turns[i] = {**turns[i], **change}
    return good(turns=turns)


MB = 1_000_000


BAD_ROWS = {
    "invalid JSON": ('{"messages": [', "json", r"invalid JSON: .* at column"),
    "not an object": ("[1, 2]", "json", r"expected a JSON object, got array"),
    "duplicate key": ('{"task_id": "a", "task_id": "b"}', "task_id", r"key appears twice"),
    "missing messages": (without("messages"), "messages", r"^missing$"),
    "messages not a list": (good(messages="hi"), "messages", r"expected a list of \{role, content\} objects, got string"),
    "empty messages": (good(messages=[]), "messages", r"empty list"),
    "bad role": (with_message(1, role="tool"), "messages[1].role", r"'tool' is not one of system, user, assistant"),
    "assistant first": (with_roles("assistant", "user", "assistant"), "messages[0].role", r"^expected 'system' or 'user' first, got 'assistant'$"),
    "assistant right after system": (with_roles("system", "assistant"), "messages[1].role", r"^expected 'system' or 'user' after 'system', got 'assistant'$"),
    "system later": (with_message(3, role="system"), "messages[3].role", r"^expected 'user' after 'assistant', got 'system' \(system messages may only come first\)$"),
    "two user messages in a row": (with_message(2, role="user"), "messages[2].role", r"^expected 'assistant' after 'user', got 'user'$"),
    "two assistant messages in a row": (with_message(3, role="assistant"), "messages[3].role", r"^expected 'user' after 'assistant', got 'assistant'$"),
    "extra message key": (with_message(1, name="bob"), "messages[1].name", r"unknown key"),
    "empty content": (with_message(3, content="  \n"), "messages[3].content", r"empty string"),
    "content not a string": (with_message(3, content=5), "messages[3].content", r"expected a string, got integer 5"),
    "no assistant turn": (good(messages=[{"role": "user", "content": "hi"}]), "messages", r"no assistant message"),
    "over-long text": (with_message(3, content="x" * 100_001), "messages", r"100,062 characters of text, over the limit of 100,000"),
    "1 MB message": (with_message(3, content="x" * MB), "messages", r"^1,000,061 characters of text, over the limit of 100,000$"),
    "1 MB turn": (with_turn(0, action="x" * MB), "turns", r"^1,000,035 characters of text, over the limit of 100,000$"),
    "missing task_id": (without("task_id"), "task_id", r"^missing$"),
    "empty task_id": (good(""), "task_id", r"empty string"),
    "missing env": (without("env"), "env", r"missing \(pass env="),
    "bad split": (good(split="training"), "split", r"'training' is not one of train, val, test"),
    "seed not an int": (good(seed="abc"), "seed", r"expected an integer, got string 'abc'"),
    "seed a float": (good(seed=1.5), "seed", r"expected an integer, got number 1.5"),
    "seed too large": (good(seed=2**63), "seed", r"out of range for a 64-bit integer"),
    "return not a number": (good(**{"return": "high"}), "return", r"expected a number, got string 'high'"),
    "NaN return": (json.dumps(good(**{"return": float("nan")})), "return", r"nan is not a finite number"),
    "infinite return": (json.dumps(good(**{"return": float("inf")})), "return", r"inf is not a finite number"),
    "overflowing return": (json.dumps(good(**{"return": 1.5})).replace("1.5", "1e999"), "return", r"^inf is not a finite number$"),
    "NaN turn reward": (json.dumps(with_turn(0, reward=float("nan"))), "turns[0].reward", r"^nan is not a finite number$"),
    "-inf turn reward": (json.dumps(with_turn(1, reward=float("-inf"))), "turns[1].reward", r"^-inf is not a finite number$"),
    "success not a bool": (good(success="yes"), "success", r"expected true or false, got string 'yes'"),
    "turns count": (good(turns=full()["turns"][:1]), "turns", r"1 turns for 2 assistant messages"),
    "turn reward": (good(turns=[{**t, "reward": "x"} for t in full()["turns"]]), "turns[0].reward", r"expected a number"),
    "turn missing action": (good(turns=[{k: v for k, v in t.items() if k != "action"} for t in full()["turns"]]), "turns[0].action", "missing"),
    "unknown key": (good(retrun=1.0), "retrun", r"unknown key \(expected one of: messages, task_id"),
}


@pytest.mark.parametrize("bad, field, reason", BAD_ROWS.values(), ids=BAD_ROWS.keys())
def test_each_bad_row_is_quarantined_with_its_field(tmp_path, bad, field, reason, faults):
    path = write_jsonl(tmp_path / "logs.jsonl", [good("pear"), bad])
    trajectories, quarantine = import_trajectories(path)
    faults(bad_rows_injected=1, rows_quarantined=quarantine.num_rows, rows_lost=2 - trajectories.num_rows - quarantine.num_rows)
    assert trajectories.num_rows == 1
    [q] = quarantine.to_pylist()
    assert (q["source_file"], q["row"], q["field"]) == (str(path), 2, field)
    assert re.search(reason, q["reason"]), q["reason"]
    assert q["raw"] == (bad if isinstance(bad, str) else json.dumps(bad))[:2000]  # a 1 MB row is not copied whole


def test_invalid_utf8_in_a_jsonl_line_is_quarantined(tmp_path):
    path = tmp_path / "logs.jsonl"
    line = json.dumps(good("fig")).encode().replace(b"Is it a fruit?", b"Is it a fr\xffuit?")
    path.write_bytes(json.dumps(good("pear")).encode() + b"\n" + line + b"\n")
    trajectories, quarantine = import_trajectories(path)
    assert trajectories.column("task_id").to_pylist() == ["pear"]
    [q] = quarantine.to_pylist()
    at = line.index(b"\xff")
    assert (q["row"], q["field"], q["reason"]) == (2, "json", f"invalid UTF-8: invalid start byte at byte {at}")
    assert "Is it a fr\ufffduit?" in q["raw"]


def write_parquet(path: Path, rows: list[dict], **options) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, **options)
    return path


def test_invalid_utf8_in_a_parquet_string_column_is_quarantined_with_its_field(tmp_path):
    # pyarrow writes and reads such bytes without complaint, so they are patched into the file:
    # uncompressed and without dictionaries, the string is in the file as it is.
    fig = full("fig")
    fig["messages"][4]["content"] = "Is it a fig?"
    path = write_parquet(tmp_path / "logs.parquet", [full("pear"), fig, full("kiwi")], compression="none", use_dictionary=False)
    data = path.read_bytes()
    assert b"Is it a fig?" in data
    path.write_bytes(data.replace(b"Is it a fig?", b"Is it a \xe0ig?"))  # a lead byte without its continuation
    trajectories, quarantine = import_trajectories(path)
    assert sorted(trajectories.column("task_id").to_pylist()) == ["kiwi", "pear"]
    [q] = quarantine.to_pylist()
    assert (q["row"], q["field"], q["reason"]) == (1, "messages[4].content", "invalid UTF-8: invalid continuation byte at byte 8")
    assert '"task_id": "fig"' in q["raw"] and "\ufffd" in q["raw"]
    with pytest.raises(ImportValidationError, match=r"logs\.parquet:1: field 'messages\[4\]\.content': invalid UTF-8"):
        import_trajectories(path, on_error="raise")


def test_parquet_non_finite_rewards_and_duplicates_are_quarantined(tmp_path):
    nan_return = {**full("fig"), "return": float("nan")}
    inf_turn = full("kiwi")
    inf_turn["turns"][1]["reward"] = float("inf")
    path = write_parquet(tmp_path / "logs.parquet", [full("pear"), full("pear"), nan_return, inf_turn, full("plum")])
    trajectories, quarantine = import_trajectories(path)
    assert sorted(trajectories.column("task_id").to_pylist()) == ["pear", "plum"]
    assert quarantine.select(["row", "field", "reason"]).to_pylist() == [
        {"row": 1, "field": "trajectory_id", "reason": "duplicate of row 0 (same content)"},
        {"row": 2, "field": "return", "reason": "nan is not a finite number"},
        {"row": 3, "field": "turns[1].reward", "reason": "inf is not a finite number"},
    ]


def test_parquet_1mb_turn_is_quarantined_without_a_1mb_copy(tmp_path):
    huge = full("fig")
    huge["messages"][2]["content"] = "y" * MB
    path = write_parquet(tmp_path / "logs.parquet", [full("pear"), huge])
    counts = write_import(path, tmp_path / "out")
    assert counts == {"rows_in": 2, "imported": 1, "quarantined": 1}
    [q] = read_table(tmp_path / "out/quarantine.parquet", "quarantine").to_pylist()
    assert (q["row"], q["field"]) == (1, "messages")
    assert "over the limit of 100,000" in q["reason"] and len(q["raw"]) == 2000


def test_parquet_written_by_pandas_with_an_index_imports(tmp_path):
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame([full("pear"), full("fig")]).iloc[[1, 0]]  # a non-default index is stored as a column
    pq.write_table(pa.Table.from_pandas(df), tmp_path / "logs.parquet")
    trajectories, quarantine = import_trajectories(tmp_path / "logs.parquet")
    assert quarantine.num_rows == 0 and trajectories.num_rows == 2


def test_duplicate_trajectory_names_the_earlier_row(tmp_path):
    path = write_jsonl(tmp_path / "logs.jsonl", [good("pear"), good("fig"), good("pear", success=True)])
    _, quarantine = import_trajectories(path)
    assert quarantine.select(["row", "field", "reason"]).to_pylist() == [
        {"row": 3, "field": "trajectory_id", "reason": "duplicate of row 1 (same content)"}
    ]


def test_rows_in_equal_rows_out_plus_quarantined(tmp_path):
    rows = [good(f"t{i}") for i in range(5)] + [bad for bad, _, _ in BAD_ROWS.values()] + [""]
    path = write_jsonl(tmp_path / "logs.jsonl", rows)
    counts = write_import(path, tmp_path / "out")
    assert counts == {"rows_in": 5 + len(BAD_ROWS), "imported": 5, "quarantined": len(BAD_ROWS)}
    assert read_table(tmp_path / "out/trajectories.parquet", "trajectories").num_rows == 5
    quarantine = read_table(tmp_path / "out/quarantine.parquet", "quarantine")
    assert quarantine.num_rows == len(BAD_ROWS)
    assert max(len(raw) for raw in quarantine.column("raw").to_pylist()) == 2000  # the over-long row, truncated


def test_import_writes_identical_bytes_whatever_the_row_order(tmp_path):
    rows = [good(f"t{i}") for i in range(5)]
    write_import(write_jsonl(tmp_path / "a.jsonl", rows), tmp_path / "a")
    write_import(write_jsonl(tmp_path / "b.jsonl", rows[::-1]), tmp_path / "b")
    assert (tmp_path / "a/trajectories.parquet").read_bytes() == (tmp_path / "b/trajectories.parquet").read_bytes()


def test_on_error_raise_names_file_row_and_field(tmp_path):
    path = write_jsonl(tmp_path / "logs.jsonl", [good("pear"), good("fig"), good(seed="abc")])
    with pytest.raises(ImportValidationError) as e:
        import_trajectories(path, on_error="raise")
    assert str(e.value) == f"{path}:3: field 'seed': expected an integer, got string 'abc'"


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("empty.jsonl", "", r"empty\.jsonl: empty file"),
        ("blank.jsonl", "\n  \n", r"blank\.jsonl: empty file"),
        ("logs.csv", "a,b\n", r"logs\.csv: unsupported file type '\.csv'"),
        ("broken.parquet", "not parquet", r"broken\.parquet: not a readable Parquet file"),
    ],
)
def test_unusable_files_are_clear_errors(tmp_path, name, content, match):
    (tmp_path / name).write_text(content)
    with pytest.raises(ImportValidationError, match=match):
        import_trajectories(tmp_path / name)


def truncated(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def retrosight_table(path: Path) -> Path:
    write_import(write_jsonl(path.parent / "in.jsonl", [good()]), path.parent / "imported")
    return path.parent / "imported/trajectories.parquet"


UNUSABLE_PARQUET = {
    "truncated": (lambda p: truncated(write_parquet(p, [full()])), r"logs\.parquet: not a readable Parquet file"),
    "no rows": (lambda p: pq.write_table(pa.Table.from_pylist([full()]).slice(0, 0), p) or p, r"logs\.parquet: empty file"),
    "other columns": (
        lambda p: write_parquet(p, [{"prompt": "hi", "completion": "hello"}]),
        r"logs\.parquet: not chat-format logs: unknown column 'prompt' \(expected columns from: messages, task_id",
    ),
    "no messages column": (lambda p: write_parquet(p, [{"task_id": "apple"}]), r"logs\.parquet: not chat-format logs: no 'messages' column"),
    "a retrosight table": (retrosight_table, r"trajectories\.parquet: a retrosight 'trajectories' table, not chat-format logs"),
}


@pytest.mark.parametrize("make, match", UNUSABLE_PARQUET.values(), ids=UNUSABLE_PARQUET.keys())
def test_unusable_parquet_files_are_clear_errors_naming_the_file(tmp_path, make, match):
    path = make(tmp_path / "logs.parquet")
    with pytest.raises(ImportValidationError, match=match):
        import_trajectories(path)
