"""Import logged trajectories in the OpenAI/TRL chat format from JSONL or Parquet.

Every row is validated; a bad row is either quarantined with the field and reason, or stops the
import with "FILE:ROW: field 'X': reason". Rows in = rows imported + rows quarantined, always.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from storage.parquet import META_NAME, write_table
from storage.schema import to_table, trajectory_id
from storage.validate import RAW_CHARS, SPLITS, invalid_utf8, role_order_error, row_json

KEYS = ("messages", "task_id", "env", "split", "policy_id", "seed", "return", "success", "turns")
TURN_KEYS = ("turn", "reason", "action", "observation", "reward")
ROLES = ("system", "user", "assistant")  # messages are imported as {role, content}: no tool calls, so no tool results
INT32, INT64 = 2**31, 2**63


class ImportValidationError(ValueError):
    """A bad row (with on_error="raise") or a file that cannot be imported at all."""


class BadRow(Exception):
    def __init__(self, field: str, reason: str, raw: str = ""):
        super().__init__(f"field '{field}': {reason}")
        self.field, self.reason, self.raw = field, reason, raw  # raw: for a row that cannot be read as text


def import_trajectories(
    path: Path,
    env: str | None = None,
    on_error: Literal["quarantine", "raise"] = "quarantine",
    max_chars: int = 100_000,
    check: Callable[[dict], None] | None = None,
) -> tuple[pa.Table, pa.Table]:
    """Validate and convert a user's trajectories; returns (trajectories, quarantine) tables.

    `path` is JSONL (one JSON object per line; blank lines are skipped) or Parquet, by suffix.
    Rows are numbered as a user finds them: 1-based line numbers in JSONL, 0-based row
    indices in Parquet. `env` fills rows that have none. Trajectories come out sorted by
    trajectory_id, quarantined rows in file order, so the same input gives the same bytes.
    `check`, a caller's own rule, sees each valid row and raises BadRow to refuse it (the expert
    stage's: the run's environment and splits).
    """
    if on_error not in ("quarantine", "raise"):
        raise ValueError(f"on_error must be 'quarantine' or 'raise', not {on_error!r}")
    path = Path(path)
    records = _read(path)
    if not records:
        raise ImportValidationError(f"{path}: empty file: no rows to import")
    good: list[dict] = []
    bad: list[dict] = []
    first_row_of: dict[str, int] = {}
    for row, record in records:
        try:
            out = _validate(_parse(record), env, max_chars)
            if check is not None:
                check(out)
            earlier = first_row_of.setdefault(out["trajectory_id"], row)
            if earlier != row:
                raise BadRow("trajectory_id", f"duplicate of row {earlier} (same content)")
            good.append(out)
        except BadRow as e:
            if on_error == "raise":
                raise ImportValidationError(f"{path}:{row}: {e}") from None
            bad.append({"source_file": str(path), "row": row, "field": e.field, "reason": e.reason, "raw": _raw(record)})
    assert len(records) == len(good) + len(bad), "every row is either imported or quarantined"
    good.sort(key=lambda r: r["trajectory_id"])
    return to_table(good, "trajectories"), to_table(bad, "quarantine")


def write_import(
    path: Path,
    out_dir: Path,
    env: str | None = None,
    on_error: Literal["quarantine", "raise"] = "quarantine",
    max_chars: int = 100_000,
) -> dict:
    """Import `path` into out_dir/trajectories.parquet and out_dir/quarantine.parquet."""
    trajectories, quarantine = import_trajectories(path, env=env, on_error=on_error, max_chars=max_chars)
    write_table(trajectories, Path(out_dir) / "trajectories.parquet", "trajectories")
    write_table(quarantine, Path(out_dir) / "quarantine.parquet", "quarantine")
    return {
        "rows_in": trajectories.num_rows + quarantine.num_rows,
        "imported": trajectories.num_rows,
        "quarantined": quarantine.num_rows,
    }


def _read(path: Path) -> list[tuple[int, bytes | dict | BadRow]]:
    """(row number, record): a JSONL line's raw bytes, or a Parquet row as a dict (or, when it
    holds invalid UTF-8, the BadRow saying where)."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open("rb") as f:
            return [(n, line.rstrip(b"\r\n")) for n, line in enumerate(f, start=1) if line.strip()]
    if suffix == ".parquet":
        table = _read_parquet(path)
        # pyarrow reads invalid UTF-8 into string columns without complaint; to_pylist would fail.
        bad = invalid_utf8(table)
        raws = dict(zip(sorted(bad), row_json(table, sorted(bad))))
        keep = pa.array([row not in bad for row in range(table.num_rows)], pa.bool_())
        good = iter(table.filter(keep).to_pylist())
        return [(row, BadRow(*bad[row], raw=raws[row]) if row in bad else next(good)) for row in range(table.num_rows)]
    raise ImportValidationError(f"{path}: unsupported file type {path.suffix!r}: expected .jsonl or .parquet")


def _read_parquet(path: Path) -> pa.Table:
    """A Parquet file of chat-format logs; anything else (unreadable, truncated, a retrosight
    table, other columns) is an error naming the file."""
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise ImportValidationError(f"{path}: not a readable Parquet file: {e}") from None
    metadata = table.schema.metadata or {}
    if META_NAME in metadata:
        raise ImportValidationError(
            f"{path}: a retrosight {metadata[META_NAME].decode()!r} table, not chat-format logs; stages read it as it is"
        )
    # pandas keeps a non-default index as an extra column; it is not part of the logs.
    index = [c for c in (table.schema.pandas_metadata or {}).get("index_columns", []) if isinstance(c, str)]
    table = table.drop_columns(index)
    unknown = [c for c in table.column_names if c not in KEYS]
    if unknown:
        raise ImportValidationError(
            f"{path}: not chat-format logs: unknown column {unknown[0]!r} (expected columns from: {', '.join(KEYS)})"
        )
    if "messages" not in table.column_names:
        raise ImportValidationError(f"{path}: not chat-format logs: no 'messages' column")
    return table


def _parse(record: bytes | dict | BadRow) -> Any:
    if isinstance(record, BadRow):
        raise record
    if isinstance(record, dict):
        return record
    try:
        return json.loads(record.decode("utf-8-sig"), object_pairs_hook=_unique_keys)
    except UnicodeDecodeError as e:
        raise BadRow("json", f"invalid UTF-8: {e.reason} at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise BadRow("json", f"invalid JSON: {e.msg} at column {e.colno}") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    # json.loads would silently keep the last of two equal keys.
    obj: dict = {}
    for key, value in pairs:
        if key in obj:
            raise BadRow(key, "key appears twice in one object")
        obj[key] = value
    return obj


def _raw(record: bytes | dict | BadRow) -> str:
    if isinstance(record, BadRow):
        return record.raw
    text = record.decode("utf-8", "replace") if isinstance(record, bytes) else json.dumps(record, ensure_ascii=False, default=str)
    return text[:RAW_CHARS]


def _validate(obj: Any, default_env: str | None, max_chars: int) -> dict:
    """The trajectory row for one record, or BadRow naming the first field that is wrong."""
    if not isinstance(obj, dict):
        raise BadRow("json", f"expected a JSON object, got {_kind(obj)}")
    for key in obj:
        if key not in KEYS:
            raise BadRow(key, f"unknown key (expected one of: {', '.join(KEYS)})")
    # Null counts as absent: Parquet has no other way to leave an optional column out of a row.
    given = {k: v for k, v in obj.items() if v is not None}
    messages = _messages(given.get("messages"), max_chars)
    env = given.get("env", default_env)
    if env is None:
        raise BadRow("env", "missing (pass env= to fill rows that have none)")
    split = _text(given.get("split", "train"), "split")
    if split not in SPLITS:
        raise BadRow("split", f"{split!r} is not one of {', '.join(SPLITS)}")
    row = {
        "env": _text(env, "env"),
        "task_id": _text(given.get("task_id"), "task_id"),
        "split": split,
        "source": "import",
        "parent_id": None,
        "branch_turn": None,
        "relabel_id": None,
        "policy_id": _text(given.get("policy_id", "import"), "policy_id"),
        "seed": _integer(given.get("seed", 0), "seed", INT64),
        "messages": messages,
    }
    num_turns = sum(m["role"] == "assistant" for m in messages)
    turns = given.get("turns")
    return {
        "trajectory_id": trajectory_id(row),
        **row,
        "turns": _derive_turns(messages) if turns is None else _turns(turns, num_turns, max_chars),
        "return": _number(given["return"], "return") if "return" in given else None,
        "success": _boolean(given["success"], "success") if "success" in given else None,
        "num_turns": num_turns,
    }


def _messages(value: Any, max_chars: int) -> list[dict]:
    if value is None:
        raise BadRow("messages", "missing")
    if not isinstance(value, list):
        raise BadRow("messages", f"expected a list of {{role, content}} objects, got {_kind(value)}")
    if not value:
        raise BadRow("messages", "empty list")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRow(where, f"expected an object with role and content, got {_kind(m)}")
        for key in m:
            if key not in ("role", "content"):
                raise BadRow(f"{where}.{key}", "unknown key (expected role, content)")
        role = m.get("role")
        if role is None:
            raise BadRow(f"{where}.role", "missing")
        if not isinstance(role, str) or role not in ROLES:
            raise BadRow(f"{where}.role", f"{role!r} is not one of {', '.join(ROLES)}")
        wrong_order = role_order_error(out[-1]["role"] if out else None, role)
        if wrong_order:
            raise BadRow(f"{where}.role", wrong_order)
        out.append({"role": role, "content": _text(m.get("content"), f"{where}.content")})
    chars = sum(len(m["content"]) for m in out)
    if chars > max_chars:
        raise BadRow("messages", f"{chars:,} characters of text, over the limit of {max_chars:,}")
    if not any(m["role"] == "assistant" for m in out):
        raise BadRow("messages", "no assistant message")
    return out


def _turns(value: Any, num_turns: int, max_chars: int) -> list[dict]:
    if not isinstance(value, list):
        raise BadRow("turns", f"expected a list of turn objects, got {_kind(value)}")
    if len(value) != num_turns:
        raise BadRow("turns", f"{len(value)} turns for {num_turns} assistant messages (one each expected)")
    out = []
    for i, t in enumerate(value):
        where = f"turns[{i}]"
        if not isinstance(t, dict):
            raise BadRow(where, f"expected an object, got {_kind(t)}")
        for key in t:
            if key not in TURN_KEYS:
                raise BadRow(f"{where}.{key}", f"unknown key (expected one of: {', '.join(TURN_KEYS)})")
        turn = {"turn": _integer(t.get("turn"), f"{where}.turn", INT32)}
        for key in ("reason", "action", "observation"):
            turn[key] = _string(t.get(key), f"{where}.{key}")
        turn["reward"] = None if t.get("reward") is None else _number(t["reward"], f"{where}.reward")
        out.append(turn)
    chars = sum(len(t[k]) for t in out for k in ("reason", "action", "observation"))
    if chars > max_chars:
        raise BadRow("turns", f"{chars:,} characters of text, over the limit of {max_chars:,}")
    return out


def _derive_turns(messages: list[dict]) -> list[dict]:
    """One turn per assistant message; its observation is the next user message before the next action."""
    turns = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        observation = ""
        for later in messages[i + 1 :]:
            if later["role"] == "assistant":
                break
            if later["role"] == "user":
                observation = later["content"]
                break
        turns.append({"turn": len(turns), "reason": "", "action": m["content"], "observation": observation, "reward": None})
    return turns


def _kind(value: Any) -> str:
    """A value's type in JSON's words, with a short excerpt of the value."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number"}
    kind = "null" if value is None else names.get(type(value), type(value).__name__)
    return kind if isinstance(value, (dict, list)) or value is None else f"{kind} {value!r:.60}"


def _string(value: Any, field: str) -> str:
    if value is None:
        raise BadRow(field, "missing")
    if not isinstance(value, str):
        raise BadRow(field, f"expected a string, got {_kind(value)}")
    return value


def _text(value: Any, field: str) -> str:
    """A string with something in it besides whitespace."""
    value = _string(value, field)
    if not value.strip():
        raise BadRow(field, "empty string")
    return value


def _integer(value: Any, field: str, bound: int) -> int:
    if value is None:
        raise BadRow(field, "missing")
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRow(field, f"expected an integer, got {_kind(value)}")
    if not -bound <= value < bound:
        raise BadRow(field, f"{value} is out of range for a {bound.bit_length()}-bit integer")
    return value


def _number(value: Any, field: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadRow(field, f"expected a number, got {_kind(value)}")
    try:
        number = float(value)
    except OverflowError:
        raise BadRow(field, f"{value} is too large for a 64-bit float") from None
    if not math.isfinite(number):
        raise BadRow(field, f"{value} is not a finite number")
    return number


def _boolean(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise BadRow(field, f"expected true or false, got {_kind(value)}")
    return value
