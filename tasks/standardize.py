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

import hashlib
import json
import tempfile
import time
from collections import deque
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
from storage.schema import to_table
from storage.validate import CheckPool, StageInputs, read_rows, row_json
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
# table but messages, which the check workers spill to disk for the rows to be written.
KEY_COLUMNS = ["trajectory_id", "env", "task_id", "split", "source", "parent_id", "relabel_id"]
EXPORT_COLUMNS = ["messages", "reward", "standardized_reward", "weight", "trajectory_id", "task_id", "source", "tools"]
# About this many output rows' messages are put in order in memory at a time: a block is a run
# of whole task contexts (the table's first sort key), so memory follows this (or the largest
# context), not the table.
SORT_BLOCK_ROWS = 50_000
WRITE_ROWS = 20_000  # rows turned into one Arrow table for the writers at a time
# lz4: the spill is the kept rows' messages, about the input's size uncompressed, and writing
# that much to disk cost more than compressing it (1M trajectories: 18.1 s against 14.6 s).
SPILL_OPTIONS = pa.ipc.IpcWriteOptions(compression="lz4")
EXPORT_QUEUE = 3  # pieces the export's writer may lag behind the training table's


def run_standardize(
    params, trajectory_files: list[Path], labels: Path, out_dir: Path, phases: dict | None = None, workers: int | None = None
) -> dict:
    """Joins trajectories with their labels; writes train.parquet (the training table),
    export/train.parquet (for datasets / TRL), metrics.json and the histograms
    plots/standardized_reward.json and plots/weight.json.

    Streams, so memory follows SORT_BLOCK_ROWS and the small columns, not the tables: inputs
    are row-checked a batch at a time, keeping only the columns the join and the statistics
    need. The messages are decoded once, in the checks: each checked batch's rows that may be
    written go to a spill file (Arrow IPC) cut by output block, a run of task contexts, so the
    writes then read each block's messages back, put them in training-table order with one
    gather and write them WRITE_ROWS at a time. The files are byte for byte what one write of
    the whole table gives. `phases`, when given, gets the seconds of each phase (read_check, of
    which check; join; standardize; export). Input files of POOL_MIN_ROWS rows or more are
    row-checked in `workers` processes (default: up to 2, one per core; 1: in-process)."""
    t0 = time.time()
    clock = _Phases(phases)
    s = params.standardize
    inputs = StageInputs()
    frames = []
    unlabelled_raw: dict[str, dict[int, str]] = {}
    spilled: dict[str, list[tuple[str, dict[int, int]]]] = {}
    blocks = _Blocks.of_files(trajectory_files)
    with tempfile.TemporaryDirectory(prefix="retrosight-standardize-") as spill:
        hook = _SpillTrajectories(_label_ids(labels), s.splits, blocks, spill)
        with CheckPool({"trajectories": hook}, workers) as pool:
            for path in trajectory_files:
                kept, rows, hooked = inputs.read_columns(path, "trajectories", KEY_COLUMNS, pool)
                unlabelled_raw[str(path)] = {row: raw for raws, _ in hooked for row, raw in raws.items()}
                spilled.setdefault(str(path), []).extend(part for _, part in hooked if part is not None)
                frames.append(pl.from_arrow(kept).with_columns(_file=pl.lit(str(path)), _row=pl.Series(rows, dtype=pl.Int64)))
            lab = pl.from_arrow(inputs.read_columns(labels, "labels", ["trajectory_id", "reward", "status"], pool)[0])
        metrics = _standardize_and_write(params, inputs, frames, lab, labels, unlabelled_raw, spilled, blocks, out_dir, clock)
    metrics["seconds"] = round(time.time() - t0, 1)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    clock.lap("export")
    return metrics


def _standardize_and_write(params, inputs: StageInputs, frames: list[pl.DataFrame], lab: pl.DataFrame, labels: Path,
                           unlabelled_raw: dict, spilled: dict, blocks: _Blocks, out_dir: Path, clock: _Phases) -> dict:
    s = params.standardize
    trajs = pl.concat(frames, how="vertical")
    frames.clear()  # what is not needed is let go before the writes, whose blocks then reuse it
    rows_in = trajs.height
    trajs = trajs.filter(pl.col("split").is_in(s.splits))
    rows_taken = trajs.height
    clock.lap("read_check", check=inputs.check_seconds)
    joined = trajs.join(lab, on="trajectory_id", how="left", maintain_order="left")
    del trajs
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
    del joined
    clock.lap("standardize")
    tools = env.tools()
    _write_tables(out, spilled, blocks, out_dir, None if tools is None else json.dumps(tools, separators=(",", ":")))
    for name, hist in weight_histograms(out).items():
        write_plot(hist, out_dir / "plots" / f"{name}.json")
    z = out["standardized_reward"].drop_nulls()
    metrics = {
        "inputs": inputs.write(out_dir),
        "rows_in": rows_in,
        "rows_other_splits": rows_in - rows_taken,
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
    }
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


class _Blocks:
    """Output blocks: runs of whole task contexts in the training table's order (task_id first),
    about SORT_BLOCK_ROWS rows each, cut from every input row's task_id (read unchecked, before
    the checks: the rows written are a subset, so no block is bigger). A context of more rows
    than that is a block of its own."""

    def __init__(self, tasks: pa.Array, block: np.ndarray) -> None:
        self.tasks, self.block = tasks, block  # task IDs, sorted, and the block of each
        self.count = int(block[-1]) + 1 if len(block) else 0

    @classmethod
    def of_files(cls, paths: list[Path]) -> _Blocks:
        parts = []
        for path in paths:
            try:
                parts.append(pl.from_arrow(pq.ParquetFile(path).read(columns=["task_id"]).column(0)))
            except (pa.ArrowException, OSError, KeyError):
                pass  # its checked read reports it
        if not parts:
            return cls(pa.array([], pa.string()), np.zeros(0, dtype=np.int64))
        sizes = pl.concat(parts).alias("task_id").value_counts(sort=False).sort("task_id")
        before = np.cumsum(sizes["count"].to_numpy()) - sizes["count"].to_numpy()
        steps = np.diff(before // SORT_BLOCK_ROWS, prepend=0) > 0  # a context that crosses a multiple starts a block
        return cls(sizes["task_id"].to_arrow().cast(pa.string()), np.cumsum(steps))

    def of(self, task_ids: pa.Array | pa.ChunkedArray) -> np.ndarray:
        at = pc.index_in(task_ids, value_set=self.tasks)
        if at.null_count:
            raise RuntimeError("standardize: a task_id changed between the stage's reads of its inputs")
        return self.block[at.to_numpy(zero_copy_only=False)]


class _SpillTrajectories:
    """In the check workers (CheckPool's hook for the trajectories), for each checked batch:
    {row: raw JSON} of the kept rows of the splits taken that no label row names (for the
    quarantine, so they need not be read again), and the messages of the others in a spill file:
    one Arrow IPC record batch per output block, of the rows' numbers in their file and their
    messages. Rows spilled but not written (a quarantined label, a duplicate found later, a hash
    collision) are left out when the blocks are read back."""

    def __init__(self, label_hashes: np.ndarray, splits: list[str], blocks: _Blocks, spill: str) -> None:
        self.label_hashes, self.splits, self.blocks, self.spill = label_hashes, pa.array(splits, pa.string()), blocks, spill

    def __call__(self, path: str, start: int, batch: pa.RecordBatch, keep: np.ndarray) -> tuple[dict[int, str], tuple[str, dict[int, int]] | None]:
        taken = keep & pc.is_in(batch.column("split"), value_set=self.splits).to_numpy(zero_copy_only=False)
        h = _id_hashes(batch.column("trajectory_id"))
        at = np.minimum(np.searchsorted(self.label_hashes, h), max(len(self.label_hashes) - 1, 0))
        labelled = self.label_hashes[at] == h if len(self.label_hashes) else np.zeros(len(h), dtype=bool)
        unlabelled = np.flatnonzero(taken & ~labelled).tolist()
        raws = dict(zip((start + r for r in unlabelled), row_json(pa.Table.from_batches([batch]), unlabelled)))
        rows = np.flatnonzero(taken & labelled)
        if not len(rows):
            return raws, None
        block = self.blocks.of(batch.column("task_id").take(pa.array(rows)))
        order = np.argsort(block, kind="stable")
        rows, block = rows[order], block[order]
        messages = _take_lists(batch.column("messages"), rows)  # in block order: each block a slice
        cuts = np.flatnonzero(np.diff(block)) + 1
        file = Path(self.spill) / f"{hashlib.sha1(path.encode()).hexdigest()[:12]}-{start}.arrow"
        index = {}
        schema = pa.schema([("row", pa.int64()), ("messages", messages.type)])
        with pa.OSFile(str(file), "wb") as sink, pa.ipc.new_file(sink, schema, options=SPILL_OPTIONS) as writer:
            for i, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, len(rows)])):
                writer.write_batch(pa.record_batch([pa.array(rows[lo:hi] + start), messages.slice(lo, hi - lo)], schema=schema))
                index[int(block[lo])] = i
        return raws, (str(file), index)


def _id_hashes(ids: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return pl.Series(ids).hash(seed=0).to_numpy()


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


def _write_tables(out: pl.DataFrame, spilled: dict[str, list[tuple[str, dict[int, int]]]], blocks: _Blocks, out_dir: Path, tools: str | None) -> None:
    """train.parquet and export/train.parquet: `out` (in order, without messages; _file and
    _row name each row's trajectory) with the messages of those trajectories, from the spill
    files, and in the export the environment's tools (JSON text) on every row. The export is
    written in a second thread, beside the training table."""
    with TableWriter(out_dir / "train.parquet", "training") as train, TableWriter(out_dir / "export" / "train.parquet", "export") as export, \
            ThreadPoolExecutor(1) as pool:
        pending: deque = deque()  # the export's writes, in order (one thread); a few may queue, so neither writer waits on the other's every piece
        for start, messages in _messages_in_order(out, spilled, blocks):
            for i in range(0, len(messages), WRITE_ROWS):
                part = messages.slice(i, WRITE_ROWS)
                block = out.slice(start + i, len(part)).drop("_file", "_row").to_arrow().append_column("messages", part)
                block = block.append_column("tools", pa.array([tools] * len(part), pa.string()))
                pending.append(pool.submit(export.write, block.select(EXPORT_COLUMNS)))
                train.write(block.select(TRAINING_COLUMNS))
                while len(pending) > EXPORT_QUEUE or (pending and pending[0].done()):
                    pending.popleft().result()
        while pending:
            pending.popleft().result()


def _messages_in_order(out: pl.DataFrame, spilled: dict[str, list[tuple[str, dict[int, int]]]], blocks: _Blocks) -> Iterator[tuple[int, pa.Array]]:
    """(first row, messages) of `out`'s rows, block by block in `out`'s order: each block's
    spilled messages read back and put in order with one gather."""
    where = {path: np.full(pq.ParquetFile(path).metadata.num_rows, -1, dtype=np.int64) for path in spilled}
    for (path,), rows in out.with_row_index("_at").group_by("_file"):
        where[path][rows["_row"].to_numpy()] = rows["_at"].to_numpy()
    sizes = np.bincount(blocks.of(out["task_id"].to_arrow()), minlength=blocks.count) if out.height else np.zeros(0, dtype=np.int64)
    firsts = np.cumsum(sizes) - sizes
    for b in np.flatnonzero(sizes):
        yield int(firsts[b]), _block_in_order(int(b), [
            (where[path], _spilled_batch(file, index[b])) for path, entries in spilled.items() for file, index in entries if b in index
        ], int(firsts[b]), int(sizes[b]))


def _spilled_batch(file: str, i: int) -> pa.RecordBatch:
    """Record batch i of a spill file: opened for it and closed (a big table has more spill files
    than a process may hold open), read rather than mapped, so memory is the block's alone."""
    with pa.OSFile(file) as source:
        return pa.ipc.open_file(source).get_batch(i)


def _block_in_order(b: int, parts: list[tuple[np.ndarray, pa.RecordBatch]], first: int, n: int) -> pa.Array:
    """The messages of output rows first..first+n-1 from block b's spilled batches, each with
    its file's output row of each file row (-1: not written)."""
    pos = np.concatenate([where[batch.column(0).to_numpy()] for where, batch in parts]) if parts else np.zeros(0, dtype=np.int64)
    written = np.flatnonzero(pos >= 0)
    order = written[np.argsort(pos[written])]
    if not np.array_equal(pos[order], np.arange(first, first + n)):
        raise RuntimeError(f"standardize: block {b} holds {len(order)} of its rows' messages, expected rows {first}..{first + n - 1}")
    messages = pa.concat_arrays([batch.column(1) for _, batch in parts])
    parts.clear()  # held once, in order, while they are written
    return _take_lists(messages, order)


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
    fields = [values.field(i) for i in range(values.type.num_fields)]
    taken = [pa.nulls(len(child), f.type) if f.null_count == len(f) else f.take(child) for f in fields]  # an unused optional key: nothing to gather
    struct = pa.StructArray.from_arrays(taken, fields=list(values.type))
    return pa.ListArray.from_arrays(pa.array(new), struct, type=lists.type)
