"""standardize: turn labelled rewards into training weights.

Swift (per-context): over the m trajectories of one context x (a task), z = (r - mean) / std
with the unbiased (m - 1) standard deviation. The paper's m are independent samples of the
context, which the logged trajectories are and the regenerations are not (each shares a logged
prefix). So with `stats: logged` (the default) a context's mean and std come from its logged
rows alone, and every row of the context, regenerations included, is scored against them: a
regeneration's z says how much better or worse it did than the logging policy does from that
context. `stats: pooled` takes the statistics over every row of the context instead.
Two cases the paper leaves open are decided here, on the rows the statistics come from:
- std = 0 (every such trajectory got the same reward): no trajectory is better than another,
  so each row of the context gets z = 0 and status "tied" (as GRPO does), rather than
  dividing by ~0. With `stats: logged` a regeneration of a tied context gets 0 too: there is
  no scale to measure it by.
- fewer than 2 such trajectories: the sample standard deviation is undefined; z = 0 and
  status "singleton".
group_size, group_mean and group_std are the statistics used.

Refit's weight is the reward itself in [0, 1] (the paper's Overall/10), through a fixed map
that depends on the reward and the environment only, never on which rows are in the table, so
every arm weighs a trajectory alike (`weight`):
- return_range: an environment return r in the environment's reward range [lo, hi] weighs
  (r - lo) / (hi - lo). In TwentyQuestions, [-max_turns, 0]: a failed game returns -max_turns,
  so weight 0; a win at turn j returns -(j - 1), so weight 1 - (j - 1) / max_turns.
- identity: the reward is already in [0, 1] (a rubric judge's Overall / 10).
A reward outside the map's range is an error naming the rows: it means the labeler's scale
and this knob disagree. Rows without a reward (labelling failed) keep a null weight with
status "no_reward" and are left out of every statistic. Also global z-scores and min-max
scaling of the standardized reward, and optional clipping.
"""
from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc
import pyarrow.parquet as pq

from storage.parquet import TableWriter
from storage.schema import get_schema, to_table
from storage.validate import BATCH_ROWS, CheckPool, StageInputs, read_rows, row_json
from tasks.plots import histogram, write_plot

Mode = Literal["per_context", "global", "min_max"]
Stats = Literal["logged", "pooled"]
WeightMap = Literal["return_range", "identity"]


def standardize(
    df: pl.DataFrame,
    mode: Mode = "per_context",
    reward: str = "reward",
    group_by: tuple[str, ...] = ("env", "task_id"),
    clip: float | None = None,
    stats: Stats = "logged",
) -> pl.DataFrame:
    """`df` plus group_size, group_mean, group_std, standardized_reward and standardize_status.
    stats: logged takes the statistics over the rows whose source is not "regeneration"."""
    needed = [reward] + (["source"] if stats == "logged" else [])
    if missing := [c for c in needed if c not in df.columns]:
        raise ValueError(f"standardize: no column {missing[0]!r} (columns: {', '.join(df.columns)})")
    if clip is not None and clip <= 0:
        raise ValueError(f"standardize: clip must be > 0, got {clip}")
    r = pl.col(reward)
    present = r.is_not_null()
    sample = pl.when(pl.col("source") != "regeneration").then(r) if stats == "logged" else r  # null: not a sample
    over = list(group_by) if mode == "per_context" else None

    def window(e: pl.Expr) -> pl.Expr:
        return e.over(over) if over else e

    n = window(sample.is_not_null().sum()).cast(pl.Int64)
    mean = window(sample.mean())
    std = window(sample.std(ddof=1))
    if mode == "min_max":
        lo, hi = sample.min(), sample.max()
        value = pl.when(hi > lo).then((r - lo) / (hi - lo)).otherwise(0.0)
        status = pl.when(hi > lo).then(pl.lit("ok")).otherwise(pl.lit("tied"))
    else:
        value = pl.when(n < 2).then(0.0).when(std == 0).then(0.0).otherwise((r - mean) / std)
        status = pl.when(n < 2).then(pl.lit("singleton")).when(std == 0).then(pl.lit("tied")).otherwise(pl.lit("ok"))
    if clip is not None:
        value = value.clip(-clip, clip)
    return df.with_columns(
        group_size=n,
        group_mean=mean,
        group_std=std,
        standardized_reward=pl.when(present).then(value).otherwise(None),
        standardize_status=pl.when(present).then(status).otherwise(pl.lit("no_reward")),
    )


def counts(df: pl.DataFrame) -> dict[str, int]:
    """How many rows fell in each case, for the stage's report."""
    return dict(df.group_by("standardize_status").len().sort("standardize_status").iter_rows())


def refit_weight(df: pl.DataFrame, weight: WeightMap, reward_range: tuple[float, float], reward: str = "reward") -> pl.DataFrame:
    """`df` plus Refit's `weight` (null without a reward): the rewards `weight` maps onto [0, 1]
    linearly, lowest to 0, highest to 1 (return_range: the environment's `reward_range`).
    ValueError naming the rows whose reward is outside the map's range."""
    lo, hi = reward_range if weight == "return_range" else (0.0, 1.0)
    r = pl.col(reward)
    outside = df.filter(r.is_not_null() & ((r < lo) | (r > hi)))
    if outside.height:
        rows = ", ".join(f"{t} ({v:g})" for t, v in outside.select("trajectory_id", reward).head(5).iter_rows())
        other = "identity (rewards in [0, 1])" if weight == "return_range" else f"return_range (the environment's returns, in [{reward_range[0]:g}, {reward_range[1]:g}])"
        raise ValueError(
            f"standardize: {outside.height} reward(s) outside [{lo:g}, {hi:g}], the range of standardize.weight: {weight}"
            f": {rows}{', ...' if outside.height > 5 else ''}; does the labeler's scale want weight: {other}?"
        )
    return df.with_columns(weight=(r - lo) / (hi - lo))


TRAINING_COLUMNS = [
    "trajectory_id", "task_id", "split", "source", "parent_id", "relabel_id", "messages", "reward",
    "standardized_reward", "weight", "group_size", "group_mean", "group_std", "standardize_status",
]


def weight_histograms(df: pl.DataFrame) -> dict[str, list[dict]]:
    """The training weights as DVC plots: Swift's standardized reward (bins of 0.25 around 0)
    and Refit's weight (bins of 0.05 over [0, 1]); rows without a reward are left out."""
    return {
        "standardized_reward": histogram(df["standardized_reward"].to_numpy(), "standardized_reward", 0.25, -1.0, 1.0),  # nulls: NaN
        "weight": histogram(df["weight"].to_numpy(), "weight", 0.05, 0.0, 1.0),
    }


# What the join, the statistics and the sort need of a trajectory: everything in the training
# table but messages, which is read again (alone) for the rows that are written.
KEY_COLUMNS = ["trajectory_id", "env", "task_id", "split", "source", "parent_id", "relabel_id"]
EXPORT_COLUMNS = ["messages", "reward", "standardized_reward", "weight", "trajectory_id", "task_id", "source", "tools"]
# Output rows whose messages are put in order in memory at a time; past one such block they
# are first spilled to disk, one file per block, so memory follows this, not the table.
SORT_BLOCK_ROWS = 50_000
WRITE_ROWS = 20_000  # rows turned into one Arrow table for the writers at a time


def run_standardize(
    params, trajectory_files: list[Path], labels: Path, out_dir: Path, phases: dict | None = None, workers: int | None = None
) -> dict:
    """Joins trajectories with their labels; writes train.parquet (the training table),
    export/train.parquet (for datasets / TRL), metrics.json and the histograms
    plots/standardized_reward.json and plots/weight.json.

    Streams, so memory follows SORT_BLOCK_ROWS and the small columns, not the tables: inputs
    are row-checked a batch at a time, keeping only the columns the join and the statistics
    need; messages are read again for the rows written, put in training-table order
    SORT_BLOCK_ROWS at a time (spilled to a temporary directory past one block) and written
    WRITE_ROWS at a time. The files are byte for byte what one write of the whole table gives.
    `phases`, when given, gets the seconds of each phase (read_check, of which check; join;
    standardize; export). Input files of POOL_MIN_ROWS rows or more are row-checked in
    `workers` processes (default: up to 2, one per core; 1: in-process)."""
    t0 = time.time()
    clock = _Phases(phases)
    s = params.standardize
    inputs = StageInputs()
    frames = []
    unlabelled_raw: dict[str, dict[int, str]] = {}
    with CheckPool({"trajectories": _RawsOfUnlabelled(_label_ids(labels), s.splits)}, workers) as pool:
        for path in trajectory_files:
            kept, rows, raws = inputs.read_columns(path, "trajectories", KEY_COLUMNS, pool)
            unlabelled_raw[str(path)] = {row: raw for part in raws for row, raw in part.items()}
            frames.append(pl.from_arrow(kept).with_columns(_file=pl.lit(str(path)), _row=pl.Series(rows, dtype=pl.Int64)))
        lab = pl.from_arrow(inputs.read_columns(labels, "labels", ["trajectory_id", "reward", "status"], pool)[0])
    trajs = pl.concat(frames, how="vertical")
    rows_in = trajs.height
    trajs = trajs.filter(pl.col("split").is_in(s.splits))
    clock.lap("read_check", check=inputs.check_seconds)
    joined = trajs.join(lab, on="trajectory_id", how="left", maintain_order="left")
    # A trajectory whose label row is missing or was quarantined has no reward to standardize.
    unlabelled = joined.filter(pl.col("status").is_null())
    for (path,), rows in unlabelled.group_by("_file", maintain_order=True):
        raws = _raws(path, rows["_row"].to_list(), unlabelled_raw[path])
        inputs.add(path, to_table([
            {"source_file": path, "row": row, "field": "trajectory_id", "reason": f"no usable label row in {labels} (missing, or quarantined there)", "raw": raw}
            for row, raw in zip(rows["_row"], raws)
        ], "quarantine"))
    joined = joined.filter(pl.col("status").is_not_null())
    clock.lap("join")
    out = standardize(joined, mode=s.mode, group_by=("env", "task_id"), clip=s.clip, stats=s.stats)
    columns = [c for c in TRAINING_COLUMNS if c != "messages"]
    env = params.env.environment()
    out = refit_weight(out, s.weight, env.reward_range).select(*columns, "_file", "_row").sort("task_id", "trajectory_id")
    clock.lap("standardize")
    tools = env.tools()
    _write_tables(out, [str(p) for p in trajectory_files], out_dir, None if tools is None else json.dumps(tools, separators=(",", ":")))
    for name, hist in weight_histograms(out).items():
        write_plot(hist, out_dir / "plots" / f"{name}.json")
    z = out["standardized_reward"].drop_nulls()
    metrics = {
        "inputs": inputs.write(out_dir),
        "rows_in": rows_in,
        "rows_other_splits": rows_in - trajs.height,
        "rows_out": out.height,
        "mode": s.mode,
        "stats": s.stats,
        "weight": s.weight,
        "clip": s.clip,
        "by_source": dict(sorted(out.group_by("source").len().iter_rows())),
        "status": counts(out),
        "contexts": out["task_id"].n_unique(),
        "contexts_with_variance": out.filter(pl.col("standardize_status") == "ok")["task_id"].n_unique(),
        "standardized_reward": {"min": z.min(), "max": z.max(), "mean": z.mean()} if len(z) else None,
        "seconds": round(time.time() - t0, 1),
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    clock.lap("export")
    return metrics


def _label_ids(labels: Path) -> np.ndarray:
    """Hashes of the trajectory IDs the labels file names, sorted, unchecked (the checks come
    later, in the stage's order); empty when it cannot be read, which its checked read will
    then report. Hashes, as they are small to hold and to send to the check workers."""
    try:
        ids = pq.ParquetFile(labels).read(columns=["trajectory_id"]).column(0)  # pq.read_table would import pyarrow.dataset (0.2 s)
    except (pa.ArrowException, OSError, KeyError):
        return np.zeros(0, dtype=np.uint64)
    return np.sort(_id_hashes(ids))


def _id_hashes(ids: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return pl.Series(ids).hash(seed=0).to_numpy()


class _RawsOfUnlabelled:
    """While the trajectories are checked (in CheckPool's workers): {row: raw JSON} (for the
    quarantine) of each kept row of the splits taken that no label row names, so it need not
    be read again. A hash collision only leaves a raw to be read again (_raws)."""

    def __init__(self, label_hashes: np.ndarray, splits: list[str]) -> None:
        self.label_hashes, self.splits = label_hashes, pa.array(splits, pa.string())

    def __call__(self, start: int, batch: pa.RecordBatch, keep: np.ndarray) -> dict[int, str]:
        taken = keep & pc.is_in(batch.column("split"), value_set=self.splits).to_numpy(zero_copy_only=False)
        h = _id_hashes(batch.column("trajectory_id"))
        at = np.minimum(np.searchsorted(self.label_hashes, h), max(len(self.label_hashes) - 1, 0))
        labelled = self.label_hashes[at] == h if len(self.label_hashes) else np.zeros(len(h), dtype=bool)
        rows = np.flatnonzero(taken & ~labelled).tolist()
        return dict(zip((start + r for r in rows), row_json(pa.Table.from_batches([batch]), rows)))


def _raws(path: str, rows: list[int], known: dict[int, str]) -> list[str]:
    """The raw JSON of rows of a trajectory file: as remembered, or read again (a trajectory
    whose label row exists but was quarantined)."""
    missing = [r for r in rows if r not in known]
    if missing:
        known = {**known, **dict(zip(missing, row_json(read_rows(path, missing), list(range(len(missing))))))}
    return [known[r] for r in rows]


class _Phases:
    def __init__(self, into: dict | None) -> None:
        self.into = into if into is not None else {}
        self.t = time.perf_counter()

    def lap(self, name: str, **parts: float) -> None:
        now = time.perf_counter()
        self.into[name] = now - self.t
        self.into.update(parts)
        self.t = now


def _write_tables(out: pl.DataFrame, files: list[str], out_dir: Path, tools: str | None) -> None:
    """train.parquet and export/train.parquet: `out` (in order, without messages; _file and
    _row name each row's trajectory) with the messages of those trajectories, and in the export
    the environment's tools (JSON text) on every row. The export is written in a second thread,
    beside the training table."""
    with TableWriter(out_dir / "train.parquet", "training") as train, TableWriter(out_dir / "export" / "train.parquet", "export") as export, \
            ThreadPoolExecutor(1) as pool:
        pending = None
        for start, messages in _messages_in_order(out, files):
            for i in range(0, len(messages), WRITE_ROWS):
                part = messages.slice(i, WRITE_ROWS)
                block = out.slice(start + i, len(part)).drop("_file", "_row").to_arrow().append_column("messages", part)
                train.write(block.select(TRAINING_COLUMNS))
                if pending is not None:
                    pending.result()
                block = block.append_column("tools", pa.array([tools] * len(part), pa.string()))
                pending = pool.submit(export.write, block.select(EXPORT_COLUMNS))
        if pending is not None:
            pending.result()


def _messages_in_order(out: pl.DataFrame, files: list[str]) -> Iterator[tuple[int, pa.Array]]:
    """(first row, messages) of `out`'s rows, block by block in `out`'s order: each file's
    messages are read once, in file order, and sent to the block of their output row."""
    n = out.height
    blocks = max(1, -(-n // SORT_BLOCK_ROWS))
    where = {path: np.full(pq.ParquetFile(path).metadata.num_rows, -1, dtype=np.int64) for path in dict.fromkeys(files)}
    for (path,), rows in out.with_row_index("_at").group_by("_file"):
        where[path][rows["_row"].to_numpy()] = rows["_at"].to_numpy()
    with tempfile.TemporaryDirectory(prefix="retrosight-standardize-") as spill:
        sinks = [_Block(Path(spill) / f"{b}.arrow", spilled=blocks > 1) for b in range(blocks)]
        for path, at in where.items():
            start = 0
            for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS, columns=["messages"]):
                pos = at[start : start + batch.num_rows]
                start += batch.num_rows
                taken = np.flatnonzero(pos >= 0)
                block = pos[taken] // SORT_BLOCK_ROWS
                for b in np.unique(block):
                    rows = taken[block == b]
                    sinks[b].add(pos[rows], batch.column(0) if len(rows) == batch.num_rows else _take_lists(batch.column(0), rows))
        for b, sink in enumerate(sinks):
            pos, messages = sink.read()
            order = np.argsort(pos)
            first = b * SORT_BLOCK_ROWS
            expected = np.arange(first, min(first + SORT_BLOCK_ROWS, n))
            if not np.array_equal(pos[order], expected):
                raise RuntimeError(f"standardize: block {b} holds {len(pos)} rows, expected rows {first}..{expected[-1] if len(expected) else first}")
            ordered = _take_lists(messages, order)
            del messages  # a block's messages are held once, in order, while they are written
            if len(order):
                yield first, ordered


def _take_lists(lists: pa.Array, rows: np.ndarray) -> pa.Array:
    """lists.take(rows) for a list of structs, as takes of the structs' flat fields, which is
    several times faster than pyarrow's take of nested lists."""
    if lists.null_count or lists.values.null_count:
        return lists.take(pa.array(rows))
    offsets = np.frombuffer(lists.buffers()[1], dtype=np.int32, count=len(lists) + 1, offset=lists.offset * 4)
    starts, lengths = offsets[:-1][rows], np.diff(offsets)[rows]
    new = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=new[1:])
    child = pa.array(np.repeat(starts - new[:-1], lengths) + np.arange(new[-1], dtype=np.int32))
    values = lists.values
    struct = pa.StructArray.from_arrays([values.field(i).take(child) for i in range(values.type.num_fields)], fields=list(values.type))
    return pa.ListArray.from_arrays(pa.array(new), struct, type=lists.type)


class _Block:
    """The messages of one block of output rows, with their output row numbers; in memory, or
    in an Arrow IPC file (lz4) while the others are being filled."""

    def __init__(self, path: Path, spilled: bool) -> None:
        self.path, self.spilled = path, spilled
        self.positions: list[np.ndarray] = []
        self.parts: list[pa.Array] = []
        self.writer = None

    def add(self, pos: np.ndarray, messages: pa.Array) -> None:
        self.positions.append(pos)
        if not self.spilled:
            self.parts.append(messages)
            return
        batch = pa.record_batch([messages], names=["messages"])
        if self.writer is None:
            self.writer = pa.ipc.new_file(str(self.path), batch.schema, options=pa.ipc.IpcWriteOptions(compression="lz4"))
        self.writer.write_batch(batch)

    def read(self) -> tuple[np.ndarray, pa.Array]:
        pos = np.concatenate(self.positions) if self.positions else np.zeros(0, dtype=np.int64)
        if self.writer is not None:
            self.writer.close()
            self.parts = pa.ipc.open_file(str(self.path)).read_all().column(0).chunks
        messages = pa.concat_arrays(self.parts) if self.parts else pa.array([], get_schema("training").schema.field("messages").type)
        self.parts = []
        return pos, messages
