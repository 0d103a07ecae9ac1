"""Parquet files with a schema name and version in their metadata, written atomically.

Writes are deterministic (fixed writer settings, no timestamps), so the same table always
gives the same bytes and DVC sees no change on a rerun. A reader never sees a partial file:
each write goes to a hidden temp file in the target's directory, then os.replace()s it. A
writer killed mid-write leaves only its temp file, which the next write of that path removes.
"""
from __future__ import annotations

import glob
import os
import secrets
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from storage.schema import TableSchema, get_schema

META_NAME = b"retrosight.schema"
META_VERSION = b"retrosight.schema_version"
ROW_GROUP_SIZE = 10_000  # fixed: a row group boundary shifting would change the bytes
# Pinned rather than left to pyarrow's defaults, which may change between releases.
WRITE_OPTIONS = dict(compression="zstd", compression_level=3, version="2.6", data_page_version="1.0")


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

    Compatible columns are cast (e.g. polars' large_string, int64 counts into int32); anything
    else is an error naming the column.
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
        raise SchemaVersionError(
            f"{path}: {name!r} schema version {found} is not supported (this build reads version {ts.version})"
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
