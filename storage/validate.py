"""Row checks for retrosight tables at a stage boundary.

A stage reads tables an earlier stage wrote, or files a user copied or edited by hand.
read_checked() refuses a file it cannot read as the named table (ValueError naming the file)
and splits the rest into kept rows, in their original order, and quarantined rows, each with
the field (`messages[3].role`, `turns[1].reward`, `reward`) and the reason. Rows in = kept +
quarantined, always. A row is quarantined once, for the first problem found: invalid UTF-8
first (nothing else can be read from such a row), then the checks every schema gets, then the
schema's own rules, then duplicate keys among the rows still kept.

Checks are vectorised over each column (nested lists flattened once), BATCH_ROWS rows at a
time; Python loops only over the problems found, the trajectory content hashes (one SHA-256
per row over JSON polars writes), tool calls' arguments (one json.loads each) and an export's
messages (JSON text). scan_checked can spread a big file's batches over worker processes
(CheckPool). 10,000 collected trajectories (343k messages) take about 0.4 s
on top of the 0.2 s read.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from storage.parquet import SchemaVersionError, read_table, schema_of, write_table
from storage import recorded
from storage.schema import (
    ID_FIELDS,
    MESSAGE,
    MESSAGES,
    OPTIONAL_MESSAGE_KEYS,
    TableSchema,
    check_value,
    get_schema,
    stored_message,
    to_table,
    trajectory_id,
)

MAX_TEXT_CHARS = 100_000  # per string value (one message, one action, one summary)
RAW_CHARS = 2_000  # of a quarantined row's JSON: enough to see what was wrong without copying a huge row
BATCH_ROWS = 10_000  # rows checked at a time, so flattened nested columns stay small

ROLES = ("system", "user", "assistant", "tool")
SPLITS = ("train", "val", "test")
SOURCES = ("policy", "import", "regeneration")
PREFERENCE_SOURCES = ("policy", "proposer")  # the actor's: who made a state's two candidates
ROLE_STATUSES = ("ok", "invalid", "failed")  # tasks/roles.py's Outcome statuses
PRACTICE_STATUSES = ("ok", "failed")  # practice's: a sample, or the backend gave up on it
PAIR_SOURCES = ("on-policy", "hindsight")  # the buffer's: whether a logged trajectory passes through the pair
# tasks.roles.Outcome: unparseable after retries, no answer, or an answer that the dialogue did not finish (HR's labeler step 1)
STATUSES = ("ok", "invalid", "failed", "unfinished")
STANDARDIZE_STATUSES = ("ok", "tied", "singleton", "no_reward")
RELABEL_MODES = ("hope", "hr")

CALLS = "assistant with tool_calls"  # what came before, when it was an assistant message making tool calls
# The chat format's role order: optional leading system messages, then user and assistant
# alternating, starting with user; an assistant message with tool_calls is answered by tool
# messages (its calls' results) before the assistant goes on. Keyed by the previous message's
# role, or CALLS (None: the first message).
NEXT_ROLES: dict[str | None, tuple[str, ...]] = {
    None: ("system", "user"),
    "system": ("system", "user"),
    "user": ("assistant",),
    "assistant": ("user",),
    CALLS: ("tool",),
    "tool": ("tool", "assistant"),
}

Problem = tuple[int, str, str]  # (row, field path, reason)


def role_order_error(previous: str | None, role: str) -> str | None:
    """Why `role` may not follow `previous` (a role, CALLS, or None: it is the first message); None if it may."""
    expected = NEXT_ROLES[previous]
    if role in expected:
        return None
    where = "first" if previous is None else "after an assistant message with tool_calls" if previous == CALLS else f"after {previous!r}"
    hint = {"system": " (system messages may only come first)", "tool": " (tool messages answer an assistant message's tool_calls)"}.get(role, "")
    return f"expected {' or '.join(map(repr, expected))} {where}, got {role!r}{hint}"


def read_checked(path: Path | str, name: str) -> tuple[pa.Table, pa.Table]:
    """(kept rows, quarantine table) of the retrosight table `name` at `path`.

    Quarantine rows name source_file=str(path) and row = the 0-based row index in the file.
    A file that is unreadable, truncated, another table, an unknown schema version or has
    other columns is a ValueError naming the file (and the column, when that is the problem).
    """
    try:
        table = read_table(path, name)
    except SchemaVersionError as e:
        detail = _file_difference(path, name)
        raise SchemaVersionError(f"{e}: {detail}" if detail else str(e)) from None
    except (pa.ArrowException, OSError) as e:  # a readable footer over corrupt pages
        raise ValueError(f"{path}: not a readable Parquet file: {e}") from None
    return check_rows(table, name, str(path))


def check_rows(table: pa.Table, name: str, source_file: str) -> tuple[pa.Table, pa.Table]:
    """read_checked for a table in memory; columns castable to the schema's types are cast."""
    ts = get_schema(name)
    rules = RULES.get(name, Rules())
    table = _conformed(table, ts, source_file)
    problems: dict[int, tuple[str, str]] = {}
    start = 0
    for batch in table.to_batches(max_chunksize=BATCH_ROWS):
        for row, path, reason in _batch_problems(batch, rules):
            problems.setdefault(start + row, (path, reason))
        start += batch.num_rows
    bad = sorted(problems)
    keep = np.ones(table.num_rows, dtype=bool)
    keep[bad] = False
    if rules.key:
        for row, path, reason in _duplicates(table, rules.key, keep):
            problems[row] = (path, reason)
        bad = sorted(problems)
        keep[bad] = False
    quarantine = [
        {"source_file": source_file, "row": row, "field": problems[row][0], "reason": problems[row][1], "raw": raw}
        for row, raw in zip(bad, row_json(table, bad))
    ]
    return table.filter(pa.array(keep)), to_table(quarantine, "quarantine")


def scan_checked(
    path: Path | str, name: str, columns: list[str], pool: CheckPool | None = None
) -> tuple[pa.Table, np.ndarray, pa.Table, float, list]:
    """read_checked for a file too big to hold: (the kept rows' `columns`, their row numbers in
    the file, the quarantine table, seconds spent in the checks, what the pool's hook for table
    `name` returned for each batch, in file order).

    The file is read and checked BATCH_ROWS rows at a time and only `columns` of the kept rows
    are held, so memory follows those columns, not the file. With a pool, a file of at least
    POOL_MIN_ROWS rows is checked in its worker processes, row groups at a time, and the
    results are taken in file order, so they are the same as in-process. Kept rows, quarantine
    rows and errors are read_checked's: duplicates are found once every batch is checked, and
    the raw JSON of a duplicate is read back from the file. A file that is byte for byte the
    output DVC recorded for its stage (storage.recorded) is not content-hashed again: the stage
    that wrote it computed those hashes; every other check runs.
    """
    ts = get_schema(name)
    rules = RULES.get(name, Rules())
    source_file = str(path)
    file = _open_checked(path, name, ts)
    t = time.perf_counter()
    written = rules.content is not None and recorded.as_written(path)
    if pool is not None and pool.workers > 1 and file.metadata.num_rows >= POOL_MIN_ROWS:
        parts = list(pool.map(source_file, name, columns, _row_group_tasks(file), written))
        wall = time.perf_counter() - t
        busy = sum(p.busy for p in parts)
        # The workers read and check at once: the checks' share of the wall time.
        checking = wall * sum(p.seconds for p in parts) / busy if busy else 0.0
    else:
        hook = pool.hooks.get(name) if pool else None
        parts = [_check_batches(source_file, _numbered(_read_batches(file, path, columns=None)), name, columns, hook, written)]
        checking = parts[0].seconds
    problems = {k: v for p in parts for k, v in p.problems.items()}
    raws = {k: v for p in parts for k, v in p.raws.items()}
    table = pa.Table.from_batches([b for p in parts for b in p.kept], schema=pa.schema([ts.schema.field(c) for c in columns]))
    kept_rows = [r for p in parts for r in p.rows]
    rows = np.concatenate(kept_rows) if kept_rows else np.zeros(0, dtype=np.int64)
    if rules.key:
        t = time.perf_counter()
        key = pa.chunked_array([k for p in parts for k in p.keys], type=ts.schema.field(rules.key).type)
        duplicates = {row: (where, reason) for row, where, reason in _later_duplicates(key, rows, rules.key)}
        if duplicates:
            problems.update(duplicates)
            raws.update(zip(duplicates, row_json(read_rows(path, sorted(duplicates)), list(range(len(duplicates))))))
            keep = ~np.isin(rows, np.fromiter(duplicates, dtype=np.int64))
            table, rows = table.filter(pa.array(keep)), rows[keep]
        checking += time.perf_counter() - t
    quarantine = [
        {"source_file": source_file, "row": row, "field": problems[row][0], "reason": problems[row][1], "raw": raws[row]}
        for row in sorted(problems)
    ]
    return table, rows, to_table(quarantine, "quarantine"), checking, [h for p in parts for h in p.hooked]


POOL_MIN_ROWS = 100_000  # smaller files are checked in-process: starting the workers costs more
TASK_ROWS = 50_000  # rows of whole row groups sent to a worker at a time


class CheckPool:
    """Worker processes (spawned, so no thread state is forked) that check row groups for
    scan_checked; started on first use, stopped by close() or the with block's end.
    hooks[table name](file's path, first row, batch, rows the checks kept) sees every whole batch
    of that table on its way (in a worker, or in-process for a small file) and what it returns is
    handed back in file order; hooks are pickled once per worker. As with any spawned pool,
    a script that starts one needs the `if __name__ == "__main__":` guard."""

    def __init__(self, hooks: dict[str, Callable[[str, int, pa.RecordBatch, np.ndarray], object]] | None = None, workers: int | None = None) -> None:
        self.hooks = hooks or {}
        self.workers = workers if workers is not None else min(2, os.cpu_count() or 1)
        self._executor: ProcessPoolExecutor | None = None

    def map(self, path: str, name: str, columns: list[str], tasks: list[tuple[int, list[int]]], as_written: bool = False) -> Iterator[_Checked]:
        args = zip(*[(path, name, columns, start, groups, as_written) for start, groups in tasks])
        if self._executor is not None:
            return self._executor.map(_check_row_groups, *args)
        self._executor = ProcessPoolExecutor(
            self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_install_hooks, initargs=(self.hooks,)
        )
        # The workers are the parallelism: one polars thread each, or their thread pools
        # compete for the same cores. Spawned workers start (and read this) on first submit.
        saved = os.environ.get("POLARS_MAX_THREADS")
        os.environ["POLARS_MAX_THREADS"] = "1"
        try:
            return self._executor.map(_check_row_groups, *args)
        finally:
            if saved is None:
                del os.environ["POLARS_MAX_THREADS"]
            else:
                os.environ["POLARS_MAX_THREADS"] = saved

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    def __enter__(self) -> CheckPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class _Checked:
    """What checking some batches of a file found (row numbers are the file's)."""

    problems: dict[int, tuple[str, str]] = field(default_factory=dict)
    raws: dict[int, str] = field(default_factory=dict)
    kept: list[pa.RecordBatch] = field(default_factory=list)  # the kept rows' columns
    rows: list[np.ndarray] = field(default_factory=list)  # their row numbers
    keys: list[pa.Array] = field(default_factory=list)  # their keys, for the duplicate check
    hooked: list = field(default_factory=list)  # each_batch's results
    seconds: float = 0.0  # in the checks
    busy: float = 0.0  # in all, reading included


def _check_batches(
    path: str, batches: Iterator[tuple[int, pa.RecordBatch]], name: str, columns: list[str], each_batch, as_written: bool = False
) -> _Checked:
    rules = RULES.get(name, Rules())
    out = _Checked()
    t0 = time.perf_counter()
    for start, batch in batches:
        t = time.perf_counter()
        found: dict[int, tuple[str, str]] = {}
        for row, where, reason in _batch_problems(batch, rules, as_written):
            found.setdefault(row, (where, reason))
        bad = sorted(found)
        keep = np.ones(batch.num_rows, dtype=bool)
        keep[bad] = False
        for row, raw in zip(bad, row_json(pa.Table.from_batches([batch]), bad)):
            out.problems[start + row], out.raws[start + row] = found[row], raw
        mask = pa.array(keep)
        out.kept.append(batch.select(columns).filter(mask))
        out.rows.append(start + np.flatnonzero(keep))
        if rules.key:
            out.keys.append(batch.column(rules.key).filter(mask))
        out.seconds += time.perf_counter() - t
        if each_batch is not None:
            out.hooked.append(each_batch(path, start, batch, keep))
    out.busy = time.perf_counter() - t0
    return out


def _numbered(batches: Iterator[pa.RecordBatch], start: int = 0) -> Iterator[tuple[int, pa.RecordBatch]]:
    for batch in batches:
        yield start, batch
        start += batch.num_rows


def _row_group_tasks(file: pq.ParquetFile) -> list[tuple[int, list[int]]]:
    """(first row, row groups) of about TASK_ROWS rows each, in file order."""
    tasks, start, groups, rows = [], 0, [], 0
    for g in range(file.num_row_groups):
        groups.append(g)
        rows += file.metadata.row_group(g).num_rows
        if rows >= TASK_ROWS:
            tasks.append((start, groups))
            start, groups, rows = start + rows, [], 0
    if groups:
        tasks.append((start, groups))
    return tasks


_HOOKS: dict = {}  # a worker's CheckPool.hooks


def _install_hooks(hooks: dict) -> None:
    pa.set_cpu_count(1)  # as POLARS_MAX_THREADS above
    _HOOKS.update(hooks)


def _check_row_groups(path: str, name: str, columns: list[str], start: int, groups: list[int], as_written: bool) -> _Checked:
    """In a worker: _check_batches over row groups `groups` of `path`, the first at row `start`."""
    file = pq.ParquetFile(path)
    batches = file.iter_batches(batch_size=BATCH_ROWS, row_groups=groups)
    return _check_batches(path, _numbered(_read_batches(batches, path), start), name, columns, _HOOKS.get(name), as_written)


def read_rows(path: Path | str, rows: list[int] | np.ndarray) -> pa.Table:
    """Rows `rows` (ascending row numbers) of a Parquet file, reading only the row groups
    that hold them."""
    file = pq.ParquetFile(path)
    rows = np.asarray(rows, dtype=np.int64)
    ends = np.cumsum([file.metadata.row_group(i).num_rows for i in range(file.num_row_groups)])
    group = np.searchsorted(ends, rows, side="right")
    parts = [
        file.read_row_group(int(g)).take(pa.array(rows[group == g] - (ends[g - 1] if g else 0)))
        for g in np.unique(group)
    ]
    return pa.concat_tables(parts) if parts else file.schema_arrow.empty_table()


def _open_checked(path: Path | str, name: str, ts: TableSchema) -> pq.ParquetFile:
    """The file open for reading, after read_table's and read_checked's checks of it."""
    try:
        metadata = pq.read_schema(path).metadata
        file = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path}: not a readable Parquet file: {e}") from None
    try:
        found = schema_of(path, metadata)
        if found.name != name:
            raise SchemaVersionError(f"{path}: expected a {name!r} table, found {found.name!r}")
        if not file.schema_arrow.equals(ts.schema):
            raise SchemaVersionError(f"{path}: columns differ from {ts.name!r} schema version {ts.version}")
    except SchemaVersionError as e:
        detail = _file_difference(path, name)
        raise SchemaVersionError(f"{e}: {detail}" if detail else str(e)) from None
    return file


def _read_batches(file: pq.ParquetFile | Iterator[pa.RecordBatch], path: Path | str, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    batches = file.iter_batches(batch_size=BATCH_ROWS, columns=columns) if isinstance(file, pq.ParquetFile) else file
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as e:  # a readable footer over corrupt pages
            raise ValueError(f"{path}: not a readable Parquet file: {e}") from None
        yield batch


class StageInputs:
    """A stage's input tables, each row-checked as it is read. What was quarantined goes to the
    stage's one quarantine table; the counts say, per file, rows in = kept + quarantined."""

    def __init__(self) -> None:
        self.quarantined: list[pa.Table] = []
        self.counts: dict[str, dict[str, int]] = {}
        self.check_seconds = 0.0

    def read(self, path: Path | str, name: str) -> pa.Table:
        kept, quarantine = read_checked(path, name)
        rows_in = kept.num_rows + quarantine.num_rows
        self.counts[str(path)] = {"rows_in": rows_in, "kept": rows_in, "quarantined": 0}
        self.add(str(path), quarantine)
        return kept

    def read_columns(self, path: Path | str, name: str, columns: list[str], pool: CheckPool | None = None) -> tuple[pa.Table, np.ndarray, list]:
        """read() for a file too big to hold (see scan_checked): the kept rows' `columns`, their
        row numbers in the file and the pool's hook's results. check_seconds adds up the time
        spent in row checks."""
        kept, rows, quarantine, seconds, hooked = scan_checked(path, name, columns, pool)
        self.check_seconds += seconds
        rows_in = kept.num_rows + quarantine.num_rows
        self.counts[str(path)] = {"rows_in": rows_in, "kept": rows_in, "quarantined": 0}
        self.add(str(path), quarantine)
        return kept, rows, hooked

    def file_rows(self, path: Path | str, kept: pa.Table) -> list[int]:
        """The row numbers in the file of `kept`, the rows read() returned from `path`."""
        dropped = {r for q in self.quarantined for r, f in zip(q["row"].to_pylist(), q["source_file"].to_pylist()) if f == str(path)}
        return [r for r in range(kept.num_rows + len(dropped)) if r not in dropped]

    def read_polars(self, path: Path | str, name: str) -> pl.DataFrame:
        return pl.from_arrow(self.read(path, name))

    def add(self, source: str, quarantine: pa.Table) -> None:
        """Quarantines rows of an input read above, such as rows a stage finds failing a check
        across tables (a relabel of a quarantined trajectory)."""
        entry = self.counts[source]
        entry["kept"] -= quarantine.num_rows
        entry["quarantined"] += quarantine.num_rows
        assert entry["rows_in"] == entry["kept"] + entry["quarantined"], entry
        self.quarantined.append(quarantine)

    def write(self, out_dir: Path) -> dict[str, dict[str, int]]:
        """Writes out_dir/quarantine.parquet (empty when nothing was quarantined); returns the counts."""
        table = pa.concat_tables(self.quarantined) if self.quarantined else to_table([], "quarantine")
        write_table(table, Path(out_dir) / "quarantine.parquet", "quarantine")
        return self.counts


def invalid_utf8(table: pa.Table | pa.RecordBatch) -> dict[int, tuple[str, str]]:
    """{row: (field path, reason)} of the first string holding invalid UTF-8 in each such row.

    Parquet readers hand such bytes over as strings without complaint, and they only fail
    later (to_pylist, compute kernels), so they are found first, column by column.
    """
    found: dict[int, tuple[str, str]] = {}
    start = 0
    for batch in _batches(table):
        found.update(_invalid_utf8(_nodes(batch), start))
        start += batch.num_rows
    return found


def _invalid_utf8(nodes: dict[str, _Node], start: int = 0) -> dict[int, tuple[str, str]]:
    """invalid_utf8 of one batch, from its nodes; rows numbered from `start`."""
    found: dict[int, tuple[str, str]] = {}
    for node in nodes.values():
        if not _is_string(node.field.type):
            continue
        try:
            node.values.validate(full=True)
            continue
        except pa.ArrowInvalid:
            pass
        binary = pa.large_binary() if pa.types.is_large_string(node.field.type) else pa.binary()
        for k, raw in enumerate(node.values.view(binary).to_pylist()):
            if raw is None:
                continue
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                found.setdefault(start + int(node.rows[k]), (node.path(k), f"invalid UTF-8: {e.reason} at byte {e.start}"))
    return found


def row_json(table: pa.Table, rows: list[int]) -> list[str]:
    """Each of `rows` as JSON text cut to RAW_CHARS; invalid UTF-8 shows as U+FFFD."""
    if not rows:
        return []
    # Strings read as bytes, so a row with invalid UTF-8 can still be shown.
    taken = table.take(pa.array(rows, pa.int64())).cast(_as_binary(table.schema)).to_pylist()
    for row in taken:
        if isinstance(row.get("messages"), list):  # shown as written: without the optional keys it left out
            row["messages"] = [{k: v for k, v in m.items() if v is not None or k not in OPTIONAL_MESSAGE_KEYS} if isinstance(m, dict) else m for m in row["messages"]]
    return [json.dumps(row, ensure_ascii=False, default=_decode)[:RAW_CHARS] for row in taken]


# --- per-schema rules --------------------------------------------------------------------------


@dataclass(frozen=True)
class Rules:
    key: str | None = None  # unique per table; the later duplicate is quarantined
    text: tuple[str, ...] = ()  # fields that must hold more than whitespace
    enums: dict[str, tuple[str, ...]] = field(default_factory=dict)
    rows: Callable[[pa.RecordBatch, dict[str, _Node]], Iterator[Problem]] | None = None  # cross-field rules
    # Checked last (a row failing another check is reported for that), and skipped for a file
    # DVC recorded as its stage wrote it (storage.recorded): the content hash.
    content: Callable[[pa.RecordBatch], Iterator[Problem]] | None = None


@dataclass(frozen=True)
class _Node:
    """One field of a batch, nested lists flattened: a value per element, each element's row."""

    name: str  # "messages[].role"
    field: pa.Field
    values: pa.Array
    rows: np.ndarray  # the batch row of each element
    index: tuple[np.ndarray, ...]  # each element's position in each enclosing list

    def path(self, k: int) -> str:
        """The field path of element k, e.g. messages[3].role."""
        parts = self.name.split("[]")
        return "".join(p + (f"[{self.index[i][k]}]" if i < len(self.index) else "") for i, p in enumerate(parts))


def _messages_rules(batch: pa.RecordBatch, nodes: dict[str, _Node]) -> Iterator[Problem]:
    """messages non-empty, in the chat format's role order, with at least one assistant message;
    tool calls only on assistant messages, each answered by one tool message right after it."""
    lengths = _np(pc.list_value_length(batch.column("messages")), fill=-1)
    yield from _flag(lengths == 0, "messages", "empty list")
    roles = nodes["messages[].role"]
    codes = _role_codes(roles)
    calls, call_id = nodes["messages[].tool_calls"], nodes["messages[].tool_call_id"]
    has_calls = _np(calls.values.is_valid())
    n_calls = _np(pc.list_value_length(calls.values), fill=0)
    assistant, tool = codes == ROLES.index("assistant"), codes == ROLES.index("tool")
    yield from _where(calls, has_calls & ~assistant, "set on a non-assistant message (only the assistant makes tool calls)")
    yield from _where(calls, has_calls & assistant & (n_calls == 0), "empty list (an assistant message without calls has no tool_calls)")
    answers = _np(call_id.values.is_valid())
    yield from _where(call_id, answers & ~tool, "set on a non-tool message (it names the call a tool message answers)")
    yield from _where(call_id, ~answers & tool, "null on a tool message (it names the call it answers)")
    states = np.where(assistant & has_calls, len(ROLES), codes)  # len(ROLES): CALLS
    position = roles.index[-1]
    previous = np.where(position == 0, len(ROLES) + 1, np.roll(states, 1))  # len(ROLES) + 1: nothing yet
    known = (codes >= 0) & (previous >= 0)  # unknown roles are reported by the enum check
    wrong = np.zeros(len(codes), dtype=bool)
    wrong[known] = ~_ALLOWED[previous[known], codes[known]]
    for k in np.flatnonzero(wrong):
        yield int(roles.rows[k]), roles.path(k), role_order_error(_STATES[previous[k]], ROLES[codes[k]])
    yield from _flag((lengths > 0) & (_assistants(batch, nodes) == 0), "messages", "no assistant message")
    if has_calls.any() or tool.any():
        yield from _arguments(nodes)
        yield from _answers(batch, nodes, states, tool & answers & ~wrong)


_STATES = (*ROLES, CALLS, None)  # a message's state code: its role's index, len(ROLES) for CALLS
_ALLOWED = np.array([[role in NEXT_ROLES[prev] for role in ROLES] for prev in _STATES])


def _arguments(nodes: dict[str, _Node]) -> Iterator[Problem]:
    """Each tool call's arguments: the text of a JSON object (one json.loads per call)."""
    node = nodes["messages[].tool_calls[].function.arguments"]
    for k, text in enumerate(node.values.to_pylist()):
        if text is None:
            continue  # reported by the null check
        try:
            value = json.loads(text)
        except ValueError as e:
            yield int(node.rows[k]), node.path(k), f"not JSON ({e})"
            continue
        if not isinstance(value, dict):
            yield int(node.rows[k]), node.path(k), f"JSON {type(value).__name__}, expected an object"


_CALL_KEYS = {"at": pl.Int64, "id": pl.String, "k": pl.Int64}  # the assistant message, the call's id, the element


def _taken(node: _Node, at: np.ndarray) -> list:
    return node.values.take(pa.array(at, pa.int64())).to_pylist()


def _answers(batch: pa.RecordBatch, nodes: dict[str, _Node], states: np.ndarray, answering: np.ndarray) -> Iterator[Problem]:
    """Every call answered by exactly one of the tool messages right after its assistant message,
    each naming (tool_call_id) one of its calls, and the call's function when it names one.
    `answering`: the tool messages in the role order, with a tool_call_id."""
    ids, call_name = nodes["messages[].tool_calls[].id"], nodes["messages[].tool_calls[].function.name"]
    call_id, name = nodes["messages[].tool_call_id"], nodes["messages[].name"]
    # A message's index among the batch's messages; a call's message, from its row and position.
    lengths = _np(pc.list_value_length(batch.column("messages")), fill=0)
    first = np.cumsum(lengths) - lengths
    call_message = first[ids.rows] + ids.index[0]
    # The role order puts a tool message after its assistant message and other tool messages only,
    # so the last assistant message with calls before it is the one it answers.
    is_calls = states == len(ROLES)
    opened = np.maximum.accumulate(np.where(is_calls, np.arange(len(states)), -1))
    calls = np.flatnonzero(is_calls[call_message])  # calls on other messages are reported already
    made = pl.DataFrame(
        {"at": call_message[calls], "id": _taken(ids, calls), "k": calls, "function": _taken(call_name, calls)}, schema={**_CALL_KEYS, "function": pl.String}
    ).filter(pl.col("id").is_not_null())
    tools = np.flatnonzero(answering)
    given = pl.DataFrame({"at": opened[tools], "id": _taken(call_id, tools), "k": tools, "name": _taken(name, tools)}, schema={**_CALL_KEYS, "name": pl.String})
    for k, i in made.filter(pl.col("k") != pl.col("k").first().over("at", "id")).select("k", "id").iter_rows():
        yield int(ids.rows[k]), ids.path(k), f"{i!r} is the id of another call of this message"
    listed = made.group_by("at").agg(pl.col("id").unique(maintain_order=True).alias("ids"))
    for k, i, known in given.join(made, on=["at", "id"], how="anti").join(listed, on="at", how="left").select("k", "id", "ids").iter_rows():
        yield int(call_id.rows[k]), call_id.path(k), f"{i!r} is not the id of a call of the assistant message it follows (its calls: {', '.join(known or [])})"
    for k, i in given.filter(pl.col("k") != pl.col("k").first().over("at", "id")).select("k", "id").iter_rows():
        yield int(call_id.rows[k]), call_id.path(k), f"a second answer to call {i!r}"
    for k, i in made.join(given, on=["at", "id"], how="anti").select("k", "id").iter_rows():
        yield int(ids.rows[k]), ids.path(k), f"call {i!r} is not answered by a tool message after it"
    named = given.filter(pl.col("name").is_not_null()).join(made, on=["at", "id"]).filter(pl.col("name") != pl.col("function"))
    for k, n, i, f in named.select("k", "name", "id", "function").iter_rows():
        yield int(name.rows[k]), name.path(k), f"{n!r}, but call {i!r} is to {f!r}"


def _role_codes(roles: _Node) -> np.ndarray:
    """Each role's index in ROLES; -1 for a null or unknown role."""
    return _np(pc.index_in(roles.values, value_set=pa.array(ROLES)), fill=-1)


def _assistants(batch: pa.RecordBatch, nodes: dict[str, _Node]) -> np.ndarray:
    """The number of assistant messages in each row."""
    roles = nodes["messages[].role"]
    return np.bincount(roles.rows[_role_codes(roles) == ROLES.index("assistant")], minlength=batch.num_rows)


def _trajectory_rules(batch: pa.RecordBatch, nodes: dict[str, _Node]) -> Iterator[Problem]:
    yield from _messages_rules(batch, nodes)
    assistants = _assistants(batch, nodes)
    num_turns = _np(batch.column("num_turns"), fill=-1)
    turns = _np(pc.list_value_length(batch.column("turns")), fill=-1)
    has = assistants > 0
    yield from _flag(has & (num_turns != assistants), "num_turns", lambda r: f"{num_turns[r]}, but messages hold {assistants[r]} assistant messages")
    yield from _flag(has & (turns >= 0) & (turns != assistants), "turns", lambda r: f"{turns[r]} turns for {assistants[r]} assistant messages (one each expected)")
    # Lineage: a regeneration names the parent, the turn it branched at and the relabel; nothing else does.
    regenerated = _np(pc.equal(batch.column("source"), "regeneration"), fill=False)
    for name in ("parent_id", "branch_turn", "relabel_id"):
        given = _np(batch.column(name).is_valid())
        yield from _flag(regenerated & ~given, name, "null on a regeneration row (it must name its origin)")
        yield from _flag(~regenerated & given, name, lambda r: f"set on a {batch.column('source')[r].as_py()!r} row (only regenerations have one)")
    branch = _np(batch.column("branch_turn"), fill=0)
    outside = _np(batch.column("branch_turn").is_valid()) & ((branch < 0) | (branch >= num_turns))
    yield from _flag(outside, "branch_turn", lambda r: f"{branch[r]} is outside 0..{num_turns[r] - 1} (the row's turns)")


def _hash_mismatches(batch: pa.RecordBatch) -> Iterator[Problem]:
    """Rows whose trajectory_id is not storage.schema.trajectory_id of their content: a hand-edited
    row keeps its old ID, and the content hash gives it away.

    polars writes the same canonical JSON (sorted keys, no spaces, UTF-8 as is) about ten times
    faster than json.dumps over to_pylist; trajectory_id itself rehashes any row that differs
    and has the last word, so an encoding difference can cost time but never a good row. The
    JSON is that of {role, content} messages: a row with tool messages, whose canonical JSON
    leaves out the keys a message lacks, is rehashed (about 0.13 ms a CarDealer row), as
    encoding the optional keys here would triple the time of every other row.
    """
    if not batch.num_rows:
        return
    messages = pl.col("messages").list.eval(pl.struct(pl.element().struct.field("content"), pl.element().struct.field("role")))
    canonical = pl.from_arrow(batch.select(list(ID_FIELDS))).select(
        pl.struct([messages if name == "messages" else pl.col(name) for name in sorted(ID_FIELDS)]).struct.json_encode()
    ).to_series().to_arrow().cast(pa.large_string())
    # Hashed straight from the Arrow buffer: no Python string per row.
    offsets = np.frombuffer(canonical.buffers()[1], dtype=np.int64, count=len(canonical) + 1, offset=canonical.offset * 8).tolist()
    text = memoryview(canonical.buffers()[2] or b"")
    sha256 = hashlib.sha256
    ids = batch.column("trajectory_id").to_pylist()
    for r in range(len(ids)):
        if sha256(text[offsets[r] : offsets[r + 1]]).hexdigest()[:16] == ids[r]:
            continue
        expected = trajectory_id(batch.slice(r, 1).select(list(ID_FIELDS)).to_pylist()[0])
        if ids[r] != expected:
            yield r, "trajectory_id", f"{ids[r]!r} is not the content hash of the row ({expected!r}): edited after it was written?"


def _summary_rules(batch: pa.RecordBatch, nodes: dict[str, _Node]) -> Iterator[Problem]:
    ok = _np(pc.equal(batch.column("status"), "ok"), fill=False)
    yield from _flag(ok & _blank(batch.column("summary")), "summary", "empty on a row with status 'ok'")
    yield from _flag(~ok & _blank(batch.column("reason")), "reason", "empty on a row whose status is not 'ok' (it must say why)")


def _relabel_rules(batch: pa.RecordBatch, nodes: dict[str, _Node]) -> Iterator[Problem]:
    ok = _np(pc.equal(batch.column("status"), "ok"), fill=False)
    yield from _flag(ok & ~_np(batch.column("branch_turn").is_valid()), "branch_turn", "null on a row with status 'ok' (regenerate splices there)")
    yield from _flag(ok & _blank(batch.column("counterfactual_text")), "counterfactual_text", "empty on a row with status 'ok'")
    yield from _flag(~ok & _blank(batch.column("reason")), "reason", "empty on a row whose status is not 'ok' (it must say why)")
    for name in ("branch_turn", "rank"):
        values = _np(batch.column(name), fill=0)
        yield from _flag(values < 0, name, lambda r, v=values: f"{v[r]} is negative")


def _label_rules(batch: pa.RecordBatch, nodes: dict[str, _Node]) -> Iterator[Problem]:
    ok = _np(pc.equal(batch.column("status"), "ok"), fill=False)
    given = _np(batch.column("reward").is_valid())
    yield from _flag(ok & ~given, "reward", "null on a row with status 'ok'")
    yield from _flag(~ok & given, "reward", lambda r: f"{batch.column('reward')[r].as_py()} on a row with status {batch.column('status')[r].as_py()!r} (a failed label has none)")
    yield from _flag(~ok & _blank(batch.column("reason")), "reason", "empty on a row whose status is not 'ok' (it must say why)")


def _weight_rules(batch: pa.RecordBatch) -> Iterator[Problem]:
    weight = _np(batch.column("weight"), fill=0.0)
    yield from _flag((weight < 0) | (weight > 1), "weight", lambda r: f"{weight[r]} is outside [0, 1] (Refit's weight is the reward scaled to [0, 1])")


def _export_rules(batch: pa.RecordBatch, nodes: dict[str, _Node]) -> Iterator[Problem]:
    """The training table's message rules on the export's JSON messages, decoded one by one
    (json.loads each: no stage reads an export, so this is for files a user checks or edits)."""
    decoded = []
    for r, texts in enumerate(batch.column("messages").to_pylist()):
        try:
            decoded.append([_json_message(text, k) for k, text in enumerate(texts)])
        except _BadMessage as e:
            decoded.append(None)
            yield r, *e.args
    messages = pa.record_batch([pa.array(decoded, MESSAGES)], names=["messages"])
    inner = _nodes(messages)
    rules = Rules(text=MESSAGE_TEXT, enums=MESSAGE_ENUMS)
    for check in (_nulls(inner), _enums(inner, rules), _blanks(inner, rules), _messages_rules(messages, inner)):
        yield from check
    yield from _weight_rules(batch)
    # Every row of an environment's export holds the same tools: each distinct text is read once.
    verdicts: dict[str, str | None] = {}
    for r, text in enumerate(batch.column("tools").to_pylist()):
        if text is not None:
            if text not in verdicts:
                verdicts[text] = _tools_problem(text)
            if verdicts[text]:
                yield r, "tools", verdicts[text]


def _tools_problem(text: str) -> str | None:
    try:
        tools = json.loads(text)
    except ValueError as e:
        return f"not JSON ({e})"
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        return f"JSON {type(tools).__name__}, expected a list of tool objects"
    return None


class _BadMessage(Exception):
    """(field path, reason) of an export message that is not a chat message."""


def _json_message(text: str, k: int) -> dict:
    """The stored form (storage.schema.stored_message) of the export's message `text`, number k."""
    try:
        message = json.loads(text)
    except ValueError as e:
        raise _BadMessage(f"messages[{k}]", f"not JSON ({e})") from None
    if not isinstance(message, dict):
        raise _BadMessage(f"messages[{k}]", f"JSON {type(message).__name__}, expected a message object")
    message = stored_message(message)
    problem = check_value(message, MESSAGE, False)
    if problem:
        raise _BadMessage(f"messages[{k}]{problem[0]}", problem[1])
    return message


def _training_rules(batch: pa.RecordBatch, nodes: dict[str, _Node]) -> Iterator[Problem]:
    yield from _messages_rules(batch, nodes)
    yield from _weight_rules(batch)
    size = _np(batch.column("group_size"), fill=0)
    yield from _flag(size < 0, "group_size", lambda r: f"{size[r]} is negative")
    unrewarded = _np(pc.equal(batch.column("standardize_status"), "no_reward"), fill=False)
    for name in ("reward", "standardized_reward"):
        given = _np(batch.column(name).is_valid())
        yield from _flag(~unrewarded & ~given, name, "null on a row whose standardize_status is not 'no_reward'")
        yield from _flag(unrewarded & given, name, "set on a row whose standardize_status is 'no_reward'")


def _pairs_rules(batch: pa.RecordBatch, nodes: dict[str, _Node]) -> Iterator[Problem]:
    target = _np(batch.column("target"), fill=0.0)
    yield from _flag((target < 0) | (target > 1), "target", lambda r: f"{target[r]} is outside [0, 1]")
    turn = _np(batch.column("turn"), fill=0)
    yield from _flag(turn < 0, "turn", lambda r: f"{turn[r]} is negative")
    count = _np(batch.column("count"), fill=0)
    behind = _np(pc.list_value_length(batch.column("trajectory_ids")), fill=0)
    yield from _flag(count != behind, "count", lambda r: f"{count[r]}, but trajectory_ids names {behind[r]}")
    yield from _flag(behind == 0, "trajectory_ids", "empty list")


def _preference_rules(batch: pa.RecordBatch, nodes: dict[str, _Node]) -> Iterator[Problem]:
    chosen, rejected = _np(batch.column("chosen_score"), fill=0.0), _np(batch.column("rejected_score"), fill=0.0)
    for name, q in (("chosen_score", chosen), ("rejected_score", rejected)):
        yield from _flag((q < 0) | (q > 1), name, lambda r, q=q: f"{q[r]} is outside [0, 1]")
    yield from _flag(chosen <= rejected, "chosen_score", lambda r: f"{chosen[r]}, not above rejected_score {rejected[r]}")
    for name in ("round", "turn"):
        v = _np(batch.column(name), fill=0)
        yield from _flag(v < 0, name, lambda r, v=v: f"{v[r]} is negative")


def _practice_rules(batch: pa.RecordBatch, nodes: dict[str, _Node]) -> Iterator[Problem]:
    for name in ("step", "sample"):
        v = _np(batch.column(name), fill=0)
        yield from _flag(v < 0, name, lambda r, v=v: f"{v[r]} is negative")
    failed = _np(pc.equal(batch.column("status"), "failed"), fill=False)
    yield from _flag(failed & _np(batch.column("equal"), fill=False), "equal", "true on a row whose status is 'failed'")


MESSAGE_TEXT = (
    "messages[].role", "messages[].content", "messages[].tool_calls[].id", "messages[].tool_calls[].function.name",
    "messages[].tool_calls[].function.arguments", "messages[].tool_call_id", "messages[].name",
)
MESSAGE_ENUMS = {"messages[].role": ROLES, "messages[].tool_calls[].type": ("function",)}
RULES: dict[str, Rules] = {
    "trajectories": Rules(
        key="trajectory_id",
        text=("trajectory_id", "env", "task_id", "split", "source", "policy_id", *MESSAGE_TEXT),
        enums={"split": SPLITS, "source": SOURCES, **MESSAGE_ENUMS},
        rows=_trajectory_rules,
        content=_hash_mismatches,
    ),
    "summaries": Rules(
        key="trajectory_id",
        text=("trajectory_id", "task_id", "status", "role", "backend", "model", "prompt_hash"),
        enums={"status": STATUSES},
        rows=_summary_rules,
    ),
    "relabels": Rules(
        key="relabel_id",
        text=("relabel_id", "trajectory_id", "task_id", "split", "mode", "status", "proposer", "prompt_hash"),
        enums={"split": SPLITS, "mode": RELABEL_MODES, "status": STATUSES},
        rows=_relabel_rules,
    ),
    "labels": Rules(
        key="trajectory_id",
        text=("trajectory_id", "task_id", "source", "labeler", "model", "prompt_hash", "status"),
        enums={"source": SOURCES, "status": STATUSES},
        rows=_label_rules,
    ),
    "training": Rules(
        key="trajectory_id",
        text=("trajectory_id", "task_id", "split", "source", "standardize_status", *MESSAGE_TEXT),
        enums={"split": SPLITS, "source": SOURCES, "standardize_status": STANDARDIZE_STATUSES, **MESSAGE_ENUMS},
        rows=_training_rules,
    ),
    "export": Rules(
        key="trajectory_id",
        text=("trajectory_id", "task_id", "source"),
        enums={"source": SOURCES},
        rows=_export_rules,
    ),
    "quarantine": Rules(text=("source_file", "field", "reason")),
    "dropped": Rules(key="relabel_id", text=("relabel_id", "parent_id", "task_id", "forward_model", "status", "reason"),
                     enums={"status": ("unfinished", "invalid", "failed")}),
    "pairs": Rules(
        key="key",
        text=("key", "source", "prompt[].role", "action.role"),
        enums={"source": PAIR_SOURCES, "prompt[].role": ROLES, "action.role": ("assistant",)},
        rows=_pairs_rules,
    ),
    "practice": Rules(
        key="pair_id",
        text=("pair_id", "trajectory_id", "task_id", "split", "status", "policy_id", "prompt[].role", "expert.role", "agent.role"),
        enums={"split": SPLITS, "status": PRACTICE_STATUSES, "prompt[].role": ROLES, "expert.role": ("assistant",), "agent.role": ("assistant",)},
        rows=_practice_rules,
    ),
    "nlac_buffer": Rules(
        key="transition_id",
        text=("transition_id", "trajectory_id", "task_id", "split", "policy_id", "state[].role", "action.role", "observation[].role"),
        enums={"split": SPLITS, "state[].role": ROLES, "action.role": ("assistant",), "observation[].role": ROLES},
    ),
    "nlac_samples": Rules(
        text=("transition_id", "target_status", "action_source", "critique_status", "refined_status"),
        enums={"target_status": ROLE_STATUSES, "action_source": ("fresh", "stored"), "critique_status": ROLE_STATUSES, "refined_status": ROLE_STATUSES},
    ),
    "preferences": Rules(
        key="key",
        text=("key", "trajectory_id", "source", "prompt[].role", "chosen.role", "rejected.role"),
        enums={"source": PREFERENCE_SOURCES, "prompt[].role": ROLES, "chosen.role": ("assistant",), "rejected.role": ("assistant",)},
        rows=_preference_rules,
    ),
}


# --- the checks --------------------------------------------------------------------------------


def _batch_problems(batch: pa.RecordBatch, rules: Rules, as_written: bool = False) -> Iterator[Problem]:
    nodes = _nodes(batch)
    bad_text = _invalid_utf8(nodes)
    for row, (path, reason) in bad_text.items():
        yield row, path, reason
    rows = np.setdiff1d(np.arange(batch.num_rows), np.fromiter(bad_text, dtype=np.int64))
    if bad_text:  # the other checks need valid text
        clean = batch.take(pa.array(rows))
        nodes = _nodes(clean)
    else:
        clean = batch
    checks = [_nulls(nodes), _enums(nodes, rules), _blanks(nodes, rules), _lengths(nodes), _non_finite(nodes)]
    if rules.rows:
        checks.append(rules.rows(clean, nodes))
    if rules.content and not as_written:
        checks.append(rules.content(clean))
    for check in checks:
        for row, path, reason in check:
            yield int(rows[row]), path, reason


def _nulls(nodes: dict[str, _Node]) -> Iterator[Problem]:
    # Arrow does not enforce nullability, so a table built in memory can break it.
    for node in nodes.values():
        if not node.field.nullable and node.values.null_count:
            yield from _where(node, _np(node.values.is_null()), "null in a required field")


def _enums(nodes: dict[str, _Node], rules: Rules) -> Iterator[Problem]:
    for name, allowed in rules.enums.items():
        node = nodes[name]
        outside = _np(pc.invert(pc.is_in(node.values, value_set=pa.array(allowed))), fill=False)
        yield from _where(node, outside, lambda k, n=node, a=allowed: f"{n.values[k].as_py()!r} is not one of {', '.join(a)}")


def _blanks(nodes: dict[str, _Node], rules: Rules) -> Iterator[Problem]:
    for name in rules.text:
        node = nodes[name]
        yield from _where(node, _blank(node.values) & _np(node.values.is_valid()), "empty string")


def _lengths(nodes: dict[str, _Node]) -> Iterator[Problem]:
    for node in nodes.values():
        if _is_string(node.field.type):
            # Bytes bound characters from above, so only strings past the limit in bytes are counted.
            long = _np(pc.greater(pc.binary_length(node.values), MAX_TEXT_CHARS), fill=False)
            for k in np.flatnonzero(long):
                chars = len(node.values[k].as_py())
                if chars > MAX_TEXT_CHARS:
                    yield int(node.rows[k]), node.path(k), f"{chars:,} characters, over the limit of {MAX_TEXT_CHARS:,}"


def _non_finite(nodes: dict[str, _Node]) -> Iterator[Problem]:
    for node in nodes.values():
        if pa.types.is_floating(node.field.type):
            bad = _np(pc.invert(pc.is_finite(node.values)), fill=False)
            yield from _where(node, bad, lambda k, n=node: f"{n.values[k].as_py()} is not a finite number")


def _duplicates(table: pa.Table, key: str, keep: np.ndarray) -> Iterator[Problem]:
    """Each kept row whose key an earlier kept row has, naming that row."""
    rows = np.flatnonzero(keep)
    yield from _later_duplicates(table.column(key).take(pa.array(rows)), rows, key)


def _later_duplicates(values: pa.ChunkedArray | pa.Array, rows: np.ndarray, key: str) -> Iterator[Problem]:
    """_duplicates over the kept rows' key `values`, `rows` their row numbers (ascending)."""
    later = pl.DataFrame({"key": pl.from_arrow(values), "row": rows})
    later = later.with_columns(first=pl.col("row").first().over("key")).filter(pl.col("row") != pl.col("first"))
    for value, row, first in later.iter_rows():
        yield row, key, f"duplicate of row {first} (same {key} {value!r})"


# --- helpers -----------------------------------------------------------------------------------


def _nodes(batch: pa.RecordBatch) -> dict[str, _Node]:
    """Every field of `batch`, nested ones included, keyed like "messages[].role"."""
    out: dict[str, _Node] = {}

    def walk(name: str, f: pa.Field, values: pa.Array, rows: np.ndarray, index: tuple[np.ndarray, ...]) -> None:
        if isinstance(f.type, pa.ExtensionType):  # checked as what it is stored as (an export's JSON: text)
            f, values = f.with_type(f.type.storage_type), values.storage
        out[name] = _Node(name, f, values, rows, index)
        if pa.types.is_list(f.type) or pa.types.is_large_list(f.type):
            lengths = _np(pc.list_value_length(values), fill=0)
            parent = np.repeat(np.arange(len(values)), lengths)
            position = np.arange(len(parent)) - (np.cumsum(lengths) - lengths)[parent]
            # flatten() skips the contents of null lists, as list_value_length counts them 0.
            walk(f"{name}[]", f.type.value_field, values.flatten(), rows[parent], (*(i[parent] for i in index), position))
        elif pa.types.is_struct(f.type):
            for child, array in zip(f.type, values.flatten()):  # the struct's nulls carried into its fields
                walk(f"{name}.{child.name}", child, array, rows, index)

    for f, column in zip(batch.schema, batch.columns):
        walk(f.name, f, column, np.arange(batch.num_rows), ())
    return out


def _batches(table: pa.Table | pa.RecordBatch) -> Iterator[pa.RecordBatch]:
    if isinstance(table, pa.RecordBatch):
        yield table
        return
    yield from table.to_batches(max_chunksize=BATCH_ROWS)


def _where(node: _Node, mask: np.ndarray, reason: str | Callable[[int], str]) -> Iterator[Problem]:
    for k in np.flatnonzero(mask):
        yield int(node.rows[k]), node.path(k), reason if isinstance(reason, str) else reason(int(k))


def _flag(mask: np.ndarray, path: str, reason: str | Callable[[int], str]) -> Iterator[Problem]:
    """Problems of a top-level field, one per row where `mask` holds."""
    for r in np.flatnonzero(mask):
        yield int(r), path, reason if isinstance(reason, str) else reason(int(r))


def _np(values: pa.Array | pa.ChunkedArray, fill=None) -> np.ndarray:
    if fill is not None:
        values = values.fill_null(fill)
    return values.to_numpy(zero_copy_only=False)


def _blank(values: pa.Array) -> np.ndarray:
    """True where a string is null or only whitespace."""
    # Trimming copies every string, so only strings that may be blank are trimmed: empty, null,
    # or starting with a byte that can begin whitespace (ASCII space or control, or a multi-byte
    # character). Any other first byte is a printable ASCII character: not blank.
    n = len(values)
    large = pa.types.is_large_string(values.type)
    offsets = np.frombuffer(values.buffers()[1], dtype=np.int64 if large else np.int32, count=n + 1, offset=values.offset * (8 if large else 4))
    data = np.frombuffer(values.buffers()[2] or b"", dtype=np.uint8)
    lengths = np.diff(offsets)
    first = np.zeros(n, dtype=np.uint8)
    first[lengths > 0] = data[offsets[:-1][lengths > 0]]
    maybe = np.flatnonzero((lengths == 0) | (first <= 0x20) | (first >= 0x80) | ~_np(values.is_valid()))
    blank = np.zeros(n, dtype=bool)
    if len(maybe):
        some = values.take(pa.array(maybe))
        blank[maybe] = _np(pc.equal(pc.binary_length(pc.utf8_trim_whitespace(some)), 0), fill=True)
    return blank


def _is_string(typ: pa.DataType) -> bool:
    return pa.types.is_string(typ) or pa.types.is_large_string(typ)


def _as_binary(schema: pa.Schema) -> pa.Schema:
    """`schema` with strings as bytes and every field nullable (a quarantined row may hold nulls)."""

    def convert(f: pa.Field) -> pa.Field:
        typ = f.type
        if _is_string(typ):
            typ = pa.large_binary() if pa.types.is_large_string(typ) else pa.binary()
        elif pa.types.is_list(typ):
            typ = pa.list_(convert(typ.value_field))
        elif pa.types.is_large_list(typ):
            typ = pa.large_list(convert(typ.value_field))
        elif pa.types.is_struct(typ):
            typ = pa.struct([convert(child) for child in typ])
        return pa.field(f.name, typ, nullable=True)

    return pa.schema([convert(f) for f in schema])


def _decode(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _conformed(table: pa.Table, ts: TableSchema, where: str) -> pa.Table:
    """`table` with the columns of `ts`, in its order, cast where the types differ but fit."""
    problem = _missing_or_extra(table.schema, ts.schema)
    if problem:
        raise ValueError(f"{where}: {ts.name!r} table {problem}")
    columns = []
    for f in ts.schema:
        column = table.column(f.name)
        if column.type != f.type:
            try:
                column = column.cast(f.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                raise ValueError(f"{where}: column {f.name!r} is {column.type}, expected {f.type}") from None
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=ts.schema.with_metadata(table.schema.metadata))


def _missing_or_extra(found: pa.Schema, expected: pa.Schema) -> str | None:
    missing = [n for n in expected.names if n not in found.names]
    extra = [n for n in found.names if n not in expected.names]
    if missing:
        return f"lacks column {missing[0]!r}"
    return f"has unknown column {extra[0]!r}" if extra else None


def _file_difference(path: Path | str, name: str) -> str | None:
    """Which column makes a file with the right schema name and version differ from it."""
    found = pq.read_schema(path)
    try:
        ts = schema_of(path, found.metadata)
    except SchemaVersionError:
        return None  # the metadata itself is the problem, and the error says so
    if ts.name != name:
        return None
    problem = _missing_or_extra(found, ts.schema)
    if problem:
        return problem
    for f in ts.schema:
        g = found.field(f.name)
        if g.type != f.type:
            return f"column {f.name!r} is {g.type}, expected {f.type}"
        if g.nullable != f.nullable:
            return f"column {f.name!r} is {'nullable' if g.nullable else 'required'}, expected {'nullable' if f.nullable else 'required'}"
    return "columns in another order"
