"""A DuckDB catalog over the stage tables: `data/<stage>/<table>.parquet` is view `<stage>.<table>`.

Views read their file at query time, so a file another process has since replaced (atomically,
see storage.parquet) is simply read in its new version.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from storage.parquet import META_NAME, META_VERSION


@dataclass(frozen=True)
class TableInfo:
    stage: str
    table: str
    path: Path
    rows: int
    schema_name: str | None  # None for a Parquet file not written by storage.parquet
    schema_version: int | None


# HOPE's later iterations write data/iterationK/<stage>/<table>.parquet: view iterationK_<stage>.<table>.
PATTERNS = ("*/*.parquet", "iteration*/*/*.parquet")


def stage_of(path: Path) -> str:
    """The catalog's stage name of a table file: its folder, prefixed by an iteration's."""
    parent = Path(path).parent
    return f"{parent.parent.name}_{parent.name}" if parent.parent.name.startswith("iteration") else parent.name


def list_tables(data_dir: Path) -> list[TableInfo]:
    """Every `<stage>/<table>.parquet` under data_dir (and each iteration's), with facts read from its footer only."""
    paths = sorted(p for pattern in PATTERNS for p in Path(data_dir).glob(pattern))
    return [
        table_info(path, stage=stage_of(path), table=path.stem)
        for path in paths
        if not path.name.startswith(".") and not any(part.startswith(".") for part in path.relative_to(data_dir).parts[:-1]) and path.is_file()
    ]


def table_info(path: Path, stage: str, table: str) -> TableInfo:
    try:
        footer = pq.read_metadata(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{stage}/{table}.parquet ({path}): not a readable Parquet file: {e}") from None
    meta = footer.metadata or {}
    version = meta.get(META_VERSION)
    return TableInfo(
        stage=stage,
        table=table,
        path=path,
        rows=footer.num_rows,
        schema_name=meta[META_NAME].decode() if META_NAME in meta else None,
        schema_version=int(version) if version is not None and version.isdigit() else None,
    )


def open_catalog(data_dir: Path | None = None, infos: list[TableInfo] | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with one schema per stage and one view per table.

    A table name that only one stage writes is also a plain view (`summaries`), which spares
    quoting stage names that are SQL keywords (`"summarize".summaries`).
    """
    con = duckdb.connect(":memory:")
    if infos is None:
        infos = list_tables(data_dir)
    names = [info.table for info in infos]
    for info in infos:
        stage, table = quote_ident(info.stage), quote_ident(info.table)
        con.execute(f"CREATE SCHEMA IF NOT EXISTS {stage}")
        con.execute(f"CREATE VIEW {stage}.{table} AS SELECT * FROM read_parquet({quote_literal(str(info.path.resolve()))})")
        if names.count(info.table) == 1:
            con.execute(f"CREATE VIEW main.{table} AS SELECT * FROM {stage}.{table}")
    return con


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"
