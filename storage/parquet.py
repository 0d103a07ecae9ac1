"""Parquet files with a schema name and version in their metadata, written atomically.

Writes are deterministic (fixed writer settings, no timestamps), so the same table always
gives the same bytes and DVC sees no change on a rerun. A reader never sees a partial file:
each write goes to a hidden temp file in the target's directory, then os.replace()s it. A
writer killed mid-write leaves only its temp file, which the next write of that path removes.
"""
from __future__ import annotations

import contextlib
import glob
import os
import secrets
from pathlib import Path
from typing import Self

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from storage.schema import JSON_MESSAGES, MESSAGES, TableSchema, get_schema, json_messages

META_NAME = b"retrosight.schema"
META_VERSION = b"retrosight.schema_version"
ROW_GROUP_SIZE = 10_000  # fixed: a row group boundary shifting would change the bytes
# Pinned rather than left to pyarrow's defaults, which may change between releases.
WRITE_OPTIONS = {"compression": "zstd", "compression_level": 3, "version": "2.6", "data_page_version": "1.0"}


class SchemaVersionError(ValueError):
    """A file this build must not read: another schema, an unknown version, or no metadata."""


def write_table(table: pa.Table, path: Path | str, name: str) -> None:
    """Write `table` as schema `name` to `path`, atomically; parent directories are created."""
    path = Path(path)
    ts = get_schema(name)
    table = conform(table, ts, where=str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            pq.write_table(table, f, row_group_size=ROW_GROUP_SIZE, **WRITE_OPTIONS)
            f.flush()
            os.fsync(f.fileno())  # the rename must not land before the data does
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class TableWriter:
    """write_table for a table too big to hold: pieces go in with write(), in order, and the
    file appears at `path` on close(). Each piece is conformed like write_table's table and
    row groups are cut at every ROW_GROUP_SIZE rows whatever the pieces' sizes, so the bytes
    equal write_table's of the pieces concatenated. Used as a context manager, an exception
    leaves no file behind (nor the temp file)."""

    def __init__(self, path: Path | str, name: str) -> None:
        self.path = Path(path)
        self.ts = get_schema(name)
        self.rows = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.path)
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        self._file = open(self.tmp, "xb")  # noqa: SIM115 - open until close() or abort()
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._writer: pq.ParquetWriter | None = None

    def write(self, table: pa.Table) -> None:
        table = conform(table, self.ts, where=str(self.path))
        self._pending.append(table)
        self._pending_rows += table.num_rows
        self.rows += table.num_rows
        if self._pending_rows >= ROW_GROUP_SIZE:
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        buffered = pa.concat_tables(self._pending) if self._pending else conform(self.ts.schema.empty_table(), self.ts)
        whole = buffered.num_rows if final else buffered.num_rows - buffered.num_rows % ROW_GROUP_SIZE
        if self._writer is None:
            self._writer = pq.ParquetWriter(self._file, buffered.schema, **WRITE_OPTIONS)
        if whole or (final and self.rows == 0):  # an empty table: what write_table writes for one
            self._writer.write_table(buffered.slice(0, whole), row_group_size=ROW_GROUP_SIZE)
        rest = buffered.slice(whole)
        self._pending, self._pending_rows = ([rest] if rest.num_rows else []), rest.num_rows

    def close(self) -> None:
        """Writes what is left and puts the file in place."""
        try:
            self._flush(final=True)
            self._writer.close()
            self._file.flush()
            os.fsync(self._file.fileno())  # the rename must not land before the data does
            self._file.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Drops what was written; no file appears."""
        if self._writer is not None and self._writer.is_open and not self._file.closed:
            with contextlib.suppress(OSError, pa.ArrowException):
                self._writer.close()  # else its finalizer would write to a closed file
        if not self._file.closed:
            self._file.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def remove_stale_temps(path: Path) -> list[Path]:
    """Delete temp files a killed writer of `path` left behind (its pid is no longer running),
    so they never pile up in an output directory DVC tracks. Returns what was removed."""
    removed = []
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = tmp.name[len(path.name) + 2 :].split(".", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def conform(table: pa.Table, ts: TableSchema, where: str = "table") -> pa.Table:
    """`table` in the exact column order and types of `ts`, stamped with its name and version.

    Compatible columns are cast (e.g. polars' large_string, int64 counts into int32), and chat
    messages stored as structs are encoded as the export's JSON (storage.schema.json_messages);
    anything else is an error naming the column.
    """
    missing = [n for n in ts.schema.names if n not in table.column_names]
    extra = [n for n in table.column_names if n not in ts.schema.names]
    if missing or extra:
        what = f"lacks column {missing[0]!r}" if missing else f"has unknown column {extra[0]!r}"
        raise ValueError(f"{where}: {ts.name!r} table {what}")
    columns = []
    for field in ts.schema:
        col = table.column(field.name)
        if col.type != field.type:
            try:
                if field.type == JSON_MESSAGES:
                    col = pa.chunked_array([json_messages(c) for c in col.cast(MESSAGES).chunks], JSON_MESSAGES)
                else:
                    col = col.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
                raise ValueError(f"{where}: column {field.name!r}: cannot store {col.type} as {field.type}: {e}") from None
        if any(_has_forbidden_null(chunk, field) for chunk in col.chunks):
            raise ValueError(f"{where}: column {field.name!r}: null in a non-nullable field")
        columns.append(col)
    meta = {META_NAME: ts.name.encode(), META_VERSION: str(ts.version).encode()}
    return pa.Table.from_arrays(columns, schema=ts.schema.with_metadata(meta))


def _has_forbidden_null(arr: pa.Array, field: pa.Field) -> bool:
    # Arrow does not enforce nullability, nested fields included, so it is checked here.
    if not field.nullable and arr.null_count:
        return True
    if pa.types.is_list(field.type):
        return _has_forbidden_null(arr.flatten(), field.type.value_field)
    if pa.types.is_struct(field.type):
        valid = arr.filter(arr.is_valid()) if arr.null_count else arr
        return any(_has_forbidden_null(valid.field(i), child) for i, child in enumerate(field.type))
    return False


def schema_of(path: Path | str, metadata: dict[bytes, bytes] | None) -> TableSchema:
    """The registered schema a file's metadata names, or SchemaVersionError saying why not."""
    metadata = metadata or {}
    if META_NAME not in metadata:
        raise SchemaVersionError(f"{path}: no retrosight schema metadata; not written by retrosight's storage.parquet")
    name = metadata[META_NAME].decode()
    found = metadata.get(META_VERSION, b"?").decode()
    try:
        ts = get_schema(name)
    except ValueError as e:
        raise SchemaVersionError(f"{path}: {e}") from None
    if found != str(ts.version):
        # One version is read: an older file is written again by the stage that made it, as
        # `retrosight run` does when the schema changes (dvc.yaml's stages depend on storage/schema.py).
        older = "; it was written by an older build: rerun the stage (or the import) that made it" if found.isdigit() and int(found) < ts.version else ""
        raise SchemaVersionError(
            f"{path}: {name!r} schema version {found} is not supported (this build reads version {ts.version}){older}"
        )
    return ts


def read_table(path: Path | str, name: str | None = None) -> pa.Table:
    """Read a retrosight Parquet file; with `name`, refuse a file holding any other table."""
    try:
        metadata = pq.read_schema(path).metadata
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path}: not a readable Parquet file: {e}") from None
    ts = schema_of(path, metadata)
    if name is not None and ts.name != name:
        raise SchemaVersionError(f"{path}: expected a {name!r} table, found {ts.name!r}")
    table = pq.read_table(path)
    if not table.schema.equals(ts.schema):
        raise SchemaVersionError(f"{path}: columns differ from {ts.name!r} schema version {ts.version}")
    return table


def read_polars(path: Path | str, name: str | None = None) -> pl.DataFrame:
    return pl.from_arrow(read_table(path, name))
