"""The standardize stage at scale: our stage beside a straightforward pandas implementation.

    python bench/data_scale.py [--n 1000000] [--small] [--pandas-arrow] [--workers N]

Generates (once; cached in bench/out/data_scale/n<N>) a synthetic, schema-valid trajectories
table of N trajectories (6-14 turns each, about 10 on average; a few thousand task contexts of
about 250 trajectories each, a third of them regenerations; correct content-hash IDs) as two
files like collect's and regenerate's, and its labels table (a few failed labels, a few
trajectories with no label row). Then times, each in its own subprocess so its peak RSS
(sampled, with its child processes' added: our row checks run in worker processes) is its own:
  ours    tasks.standardize.run_standardize: the row checks (reading included), the label join,
          standardize (z-scores, weights, sort) and the export (train.parquet, export/train.parquet),
          on the inputs as DVC recorded them (the directory's stage `generate`): every row check
          but the content hash, which the writing stage computed (storage.recorded);
  ours-hashed  the same stage on the same bytes, from paths no dvc.lock names: every row's
          content hash computed again, as for a file copied in or edited by hand;
  pandas  pd.read_parquet, merge with the labels, groupby-transform z-scores (the logged rows'
          statistics), return-range weights, sort_values, to_parquet of the training table and the
          export. It checks no rows.
Prints one table (phase, seconds, peak RSS so far, pandas/ours; and the CPU time of each,
which the machine's other load changes less than the wall time) and whether the two training
tables agree (same rows in the same order, same values), and writes bench/out/data_scale.json
(and data_scale_n<N>.json).
--small is 20,000 trajectories.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from storage.parquet import TableWriter
from storage.schema import ID_FIELDS, MESSAGE, TURN, get_schema, trajectory_id

OUT = ROOT / "bench" / "out"
PER_CONTEXT = 250  # trajectories per task context (Swift's m)
DATA_VERSION = 3  # in the cache's name; 2: returns within the environment's range; 3: recorded by DVC
CHUNK = 50_000  # trajectories generated at a time
SMALL = 20_000

SYSTEM = (
    "You are playing twenty questions. Find the secret object by asking yes-no questions, one per turn. "
    "You have 20 turns and the last one must be a guess. Reply in two lines:\nREASON: what you know so far\nQUESTION: your question"
)
REASONS = [f"Ask about {w}." for w in (
    "hand-sized", "outdoor", "large", "can sit on it", "has wheels", "orchestral", "plastic", "furniture", "bedroom",
    "man-related", "fruit", "animal", "metal", "kitchen", "electric", "edible", "alive", "water", "sport", "tool",
)] + [f"Only {w} fits." for w in ("Fork", "Ring", "Ship", "Mango", "Piano", "Chair", "Lion", "Kite")]
ACTIONS = [f"Is it {w}?" for w in (
    "bigger than a person", "made by people", "mostly found or used outdoors", "an animal", "edible", "made of metal",
    "used in a kitchen", "electric", "alive", "found in water", "used for sport", "a tool", "soft", "heavy", "round",
    "a Fork", "a Ring", "a Ship", "a Mango", "a Piano", "a Chair", "a Lion", "a Kite", "red", "expensive",
)] + ["Does it fit in your hand?", "Does it have wheels?", "Can you sit on or in it?", "Does it fly?"]
ANSWERS = ["yes", "no", "unknown"]


# --- the synthetic tables ----------------------------------------------------------------------


def _strings(values: list[str], index: np.ndarray) -> pa.Array:
    return pa.array(values, pa.string()).take(pa.array(index))


def _join(*parts: pa.Array | str) -> pa.Array:
    return pc.binary_join_element_wise(*parts, "")


def _chunk(rng: np.random.Generator, first: int, n: int, contexts: int) -> pa.Table:
    """Trajectories first..first+n-1 with correct IDs: vectorised over rows and messages."""
    k = rng.integers(6, 15, n)  # turns; messages: system, user, then k x (assistant, user)
    task = rng.integers(0, contexts, n)
    regen = rng.random(n) < 1 / 3
    # Flattened turns: trajectory of each turn, and its index within the trajectory.
    owner = np.repeat(np.arange(n), k)
    t = np.arange(len(owner)) - np.repeat(np.cumsum(k) - k, k)
    reason = _strings(REASONS, rng.integers(0, len(REASONS), len(owner)))
    action = _strings(ACTIONS, rng.integers(0, len(ACTIONS), len(owner)))
    answer = _strings(ANSWERS, rng.integers(0, len(ANSWERS), len(owner)))
    turns = pa.StructArray.from_arrays(
        [pa.array(t, pa.int32()), reason, action, answer, pa.array(np.full(len(owner), -1.0))], fields=list(TURN)
    )
    # Messages: per trajectory [system, user0] then per turn [assistant_t, user_t].
    m = 2 + 2 * k
    offsets = np.concatenate([[0], np.cumsum(m)])
    role = np.empty(offsets[-1], dtype=object)
    content: list[pa.Array] = []
    head = offsets[:-1]
    role[head], role[head + 1] = "system", "user"
    turn_at = np.repeat(head + 2, k) + 2 * t  # where each turn's assistant message goes
    role[turn_at], role[turn_at + 1] = "assistant", "user"
    assistant = _join("REASON: ", reason, "\nQUESTION: ", action)
    user = _join("Answer: ", answer, ". Turn ", pc.cast(pa.array(t + 2), pa.string()), " of 20.")
    order = np.argsort(np.concatenate([head, head + 1, turn_at, turn_at + 1]), kind="stable")
    content = pa.concat_arrays([
        _strings([SYSTEM], np.zeros(n, dtype=np.int64)), _strings(["Turn 1 of 20. Ask a yes-no question."], np.zeros(n, dtype=np.int64)),
        assistant.cast(pa.string()), user.cast(pa.string()),
    ]).take(pa.array(order))
    messages = pa.ListArray.from_arrays(
        pa.array(offsets, pa.int32()), pa.StructArray.from_arrays(
            [pa.array(role, pa.string()), content, *(pa.nulls(len(role), f.type) for f in list(MESSAGE)[2:])], fields=list(MESSAGE)
        )
    )
    ids = np.arange(first, first + n)
    hexes = [f"{hashlib.sha256(f'r{i}'.encode()).hexdigest()[:16]}" for i in ids]  # parents and relabels
    success = rng.random(n) < 0.3
    table = pa.table({
        "trajectory_id": pa.array([""] * n),
        "env": pa.array(["twenty_questions"] * n),
        "task_id": pc.binary_join_element_wise("task", pc.utf8_lpad(pc.cast(pa.array(task), pa.string()), 5, "0"), ""),
        "split": _strings(["train"] * 8 + ["val", "test"], task % 10),
        "source": pa.array(np.where(regen, "regeneration", "policy").tolist()),
        "parent_id": pa.array([h if r else None for h, r in zip(hexes, regen)], pa.string()),
        "branch_turn": pa.array(np.where(regen, rng.integers(0, k), 0), pa.int32(), mask=~regen),
        "relabel_id": pa.array([h[::-1] if r else None for h, r in zip(hexes, regen)], pa.string()),
        "policy_id": pa.array(["model@37ccbb3f63b0"] * n),
        "seed": pa.array(ids, pa.int64()),
        "messages": messages,
        "turns": pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(k)]), pa.int32()), turns),
        "return": pa.array(np.where(success, 1.0 - k, -20.0)),  # the environment's: -(turns - 1) for a win, -max_turns for a loss
        "success": pa.array(success),
        "num_turns": pa.array(k, pa.int32()),
    })
    table = table.set_column(0, "trajectory_id", pa.array(_content_ids(table)))
    return table.cast(get_schema("trajectories").schema)


def _content_ids(table: pa.Table) -> list[str]:
    """storage.schema.trajectory_id of every row, from the canonical JSON polars writes (checked
    against trajectory_id itself on a few rows)."""
    messages = pl.col("messages").list.eval(pl.struct(pl.element().struct.field("content"), pl.element().struct.field("role")))
    canonical = pl.from_arrow(table.select(list(ID_FIELDS))).select(
        pl.struct([messages if f == "messages" else pl.col(f) for f in sorted(ID_FIELDS)]).struct.json_encode()
    ).to_series()
    ids = [hashlib.sha256(text.encode()).hexdigest()[:16] for text in canonical]
    for row in range(0, table.num_rows, max(1, table.num_rows // 5)):
        assert ids[row] == trajectory_id(table.slice(row, 1).to_pylist()[0]), "canonical JSON differs from trajectory_id's"
    return ids


def _labels(rng: np.random.Generator, trajs: pa.Table) -> pa.Table:
    """A label row per trajectory, but for 0.1% with none; 0.5% failed (no reward)."""
    n = trajs.num_rows
    labelled = rng.random(n) >= 0.001
    failed = rng.random(n) < 0.005
    ret = trajs.column("return").to_numpy()
    t = trajs.filter(pa.array(labelled))
    failed, ret = failed[labelled], ret[labelled]
    m = t.num_rows
    return pa.table({
        "trajectory_id": t.column("trajectory_id"),
        "task_id": t.column("task_id"),
        "source": t.column("source"),
        "env_reward": t.column("return"),
        "env_success": t.column("success"),
        "reward": pa.array(ret, mask=failed),
        "labeler": pa.array(["oracle"] * m),
        "model": pa.array(["oracle-labeler-v1"] * m),
        "prompt_hash": pa.array(["oracle-labeler-v1"] * m),
        "scores": pa.nulls(m, pa.string()),
        "status": pa.array(np.where(failed, "failed", "ok").tolist()),
        "reason": pa.array(np.where(failed, "labeler gave no answer", "environment return").tolist()),
    })


def generate(n: int, seed: int = 0) -> dict[str, Path]:
    """The synthetic inputs for `n` trajectories, made once and reused (a `done` file marks
    a finished set). The directory is a DVC project whose stage `generate` has the three files
    as outputs, recorded in its dvc.lock as `dvc repro` records a stage's: the stage reads them as
    the pipeline's own outputs (storage.recorded). unrecorded/ holds hard links to the same
    files that no dvc.lock names, read as files from anywhere else."""
    d = OUT / "data_scale" / f"n{n}_s{seed}_v{DATA_VERSION}"
    paths = {"collect": d / "collect.parquet", "regenerate": d / "regenerate.parquet", "labels": d / "labels.parquet"}
    if (d / "done").exists():
        return paths
    rng = np.random.default_rng(seed)
    contexts = max(1, n // PER_CONTEXT)
    with TableWriter(paths["collect"], "trajectories") as collect, TableWriter(paths["regenerate"], "trajectories") as regenerate, \
            TableWriter(paths["labels"], "labels") as labels:
        for first in range(0, n, CHUNK):
            table = _chunk(rng, first, min(CHUNK, n - first), contexts)
            regen = pc.equal(table.column("source"), "regeneration")
            collect.write(table.filter(pc.invert(regen)))
            regenerate.write(table.filter(regen))
            labels.write(_labels(rng, table))
    dvc = str(Path(sys.executable).parent / "dvc")
    for args in (["init", "--no-scm", "-q", "-f"], ["stage", "add", "-q", "-f", "-n", "generate", *[x for p in paths.values() for x in ("-O", p.name)],
                 f"python bench/data_scale.py --n {n} --seed {seed}"], ["commit", "-f", "-q", "generate"]):
        subprocess.run([dvc, *args], cwd=d, check=True, capture_output=True)
    (d / "unrecorded").mkdir(exist_ok=True)
    for p in paths.values():
        (d / "unrecorded" / p.name).unlink(missing_ok=True)
        os.link(p, d / "unrecorded" / p.name)
    (d / "done").write_text(json.dumps({"n": n, "seed": seed}) + "\n")
    return paths


def unrecorded(paths: dict[str, Path]) -> dict[str, Path]:
    return {k: p.parent / "unrecorded" / p.name for k, p in paths.items()}


# --- the two implementations, each run in a child process ----------------------------------------


class _RssSampler:
    """Resident memory every 20 ms in a thread, so each phase's peak can be told afterwards:
    this process's plus its child processes' (the row checks' workers), pages shared between
    them counted once per process, so the sum errs high."""

    def __init__(self) -> None:
        import threading

        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), sum(_rss_pages(pid) for pid in _tree(os.getpid())) * page))
            self._stop.wait(0.02)

    def peak_mb(self) -> float:
        return round(max((rss for _, rss in self.samples), default=0) / 2**20, 1)

    def phase_peaks(self, start: float, phases: list[tuple[str, float]]) -> dict[str, float]:
        """MB: the highest sample within each phase (phases: (name, seconds), back to back)."""
        self._stop.set()
        self._thread.join()
        peaks, t = {}, start
        for name, seconds in phases:
            inside = [rss for at, rss in self.samples if t <= at <= t + seconds]
            peaks[name] = round(max(inside, default=0) / 2**20, 1)
            t += seconds
        return peaks


def _tree(pid: int) -> list[int]:
    """pid and its descendants."""
    out = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [p for child in task.read_text().split() for p in _tree(int(child))]
        except OSError:  # gone meanwhile
            pass
    return out


def _rss_pages(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError):
        return 0


def _peak_mb(sampler: _RssSampler) -> float:
    """The highest of this process's own peak and the sampled peak of it with its children."""
    return max(round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), sampler.peak_mb())  # Linux: KiB


def _cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (the check workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def child_ours(data: dict[str, Path], out: Path, workers: int | None) -> dict:
    from tasks.params import load_params
    from tasks.standardize import run_standardize

    params = load_params(ROOT / "params.yaml")
    sampler = _RssSampler()
    phases: dict[str, float] = {}
    start = time.perf_counter()
    cpu = _cpu_seconds()
    metrics = run_standardize(params, [data["collect"], data["regenerate"]], data["labels"], out, phases=phases, workers=workers)
    total = time.perf_counter() - start
    cpu = _cpu_seconds() - cpu
    order = [(p, phases[p]) for p in ("read_check", "join", "standardize", "export")]
    return {
        "seconds": {**{p: s for p, s in order}, "check": phases["check"], "total": total}, "cpu_seconds": cpu, "workers": workers,
        "peak_mb": {**sampler.phase_peaks(start, order), "total": _peak_mb(sampler)},
        "rows_out": metrics["rows_out"], "rows_in": metrics["rows_in"],
        "quarantined": sum(v["quarantined"] for v in metrics["inputs"].values()),
    }


def child_pandas(data: dict[str, Path], out: Path, backend: str | None) -> dict:
    """The same work as the stage, written as one would in pandas; no row checks."""
    import pandas as pd

    from tasks.params import load_params

    params = load_params(ROOT / "params.yaml")
    s = params.standardize
    kw = {"dtype_backend": backend} if backend else {}
    sampler = _RssSampler()
    seconds: dict[str, float] = {}
    start = t = time.perf_counter()
    cpu = _cpu_seconds()

    def lap(name: str) -> None:
        nonlocal t
        seconds[name] = time.perf_counter() - t
        t = time.perf_counter()

    columns = ["trajectory_id", "env", "task_id", "split", "source", "parent_id", "relabel_id", "messages"]
    trajs = pd.concat([pd.read_parquet(data[k], columns=columns, **kw) for k in ("collect", "regenerate")], ignore_index=True)
    labels = pd.read_parquet(data["labels"], columns=["trajectory_id", "reward", "status"], **kw)
    lap("read_check")
    trajs = trajs[trajs["split"].isin(s.splits)]
    df = trajs.merge(labels, on="trajectory_id", how="inner")
    lap("join")
    r = df["reward"]
    g = r.where(df["source"] != "regeneration").groupby([df["env"], df["task_id"]])  # stats: logged
    n, mean, std = g.transform("count"), g.transform("mean"), g.transform("std")
    df["group_size"], df["group_mean"], df["group_std"] = n, mean, std
    df["standardized_reward"] = ((r - mean) / std).where((n >= 2) & (std != 0), 0.0).where(r.notna())
    df["standardize_status"] = np.select([r.isna(), n < 2, std == 0], ["no_reward", "singleton", "tied"], "ok")
    lo, hi = params.env.environment().reward_range
    df["weight"] = (r - lo) / (hi - lo)  # weight: return_range
    df = df.sort_values(["task_id", "trajectory_id"])
    lap("standardize")
    training = ["trajectory_id", "task_id", "split", "source", "parent_id", "relabel_id", "messages", "reward",
                "standardized_reward", "weight", "group_size", "group_mean", "group_std", "standardize_status"]
    (out / "export").mkdir(parents=True, exist_ok=True)
    # The stage's file settings (zstd level 3, 10,000-row groups), so both write the same format.
    fmt = {"index": False, "compression": "zstd", "compression_level": 3, "row_group_size": 10_000}
    df[training].to_parquet(out / "train.parquet", **fmt)
    df[["messages", "reward", "standardized_reward", "weight", "trajectory_id", "task_id", "source"]].to_parquet(out / "export" / "train.parquet", **fmt)
    lap("export")
    total = time.perf_counter() - start
    return {
        "seconds": {**seconds, "total": total}, "cpu_seconds": _cpu_seconds() - cpu,
        "peak_mb": {**sampler.phase_peaks(start, list(seconds.items())), "total": _peak_mb(sampler)},
        "rows_out": len(df),
    }


def child_compare(ours: Path, theirs: Path) -> dict:
    """Whether two training tables hold the same rows in the same order with the same values
    (floats to 1e-9 relative; messages by a per-row hash, read streaming)."""
    a, b = pl.scan_parquet(ours), pl.scan_parquet(theirs)
    small = ["trajectory_id", "task_id", "split", "source", "parent_id", "relabel_id", "standardize_status", "group_size"]
    floats = ["reward", "standardized_reward", "weight", "group_mean", "group_std"]
    x = a.select(*small, *floats).collect()
    y = b.select(*small, *floats).collect().with_columns(pl.col("group_size").cast(pl.Int64))
    if x.height != y.height:
        return {"agree": False, "why": f"{x.height} rows against {y.height}"}
    for c in small:
        if not x[c].equals(y[c]):
            return {"agree": False, "why": f"column {c} differs"}
    for c in floats:
        u, v = x[c].to_numpy(), y[c].to_numpy()
        if not np.allclose(u, v, rtol=1e-9, atol=1e-12, equal_nan=True):
            return {"agree": False, "why": f"column {c} differs (max |diff| {np.nanmax(np.abs(u - v))})"}

    def message_hashes(lf: pl.LazyFrame) -> pl.Series:
        m = pl.col("messages").list.eval(pl.concat_str(pl.element().struct.field("role"), pl.element().struct.field("content"), separator="\x1f"))
        return lf.select(m.list.join("\x1e").hash()).collect(engine="streaming").to_series()

    if not message_hashes(a).equals(message_hashes(b)):
        return {"agree": False, "why": "messages differ"}
    return {"agree": True, "rows": x.height}


def _child(args: argparse.Namespace) -> None:
    data = {k: Path(v) for k, v in json.loads(args.data).items()}
    if args.child == "ours":
        result = child_ours(data, Path(args.out), args.workers)
    elif args.child == "compare":
        result = child_compare(Path(args.out) / "ours" / "train.parquet", Path(args.out) / args.against / "train.parquet")
    else:
        result = child_pandas(data, Path(args.out), "pyarrow" if args.child == "pandas-arrow" else None)
    print("RESULT " + json.dumps(result))


def _run_child(kind: str, data: dict[str, Path], out: Path, against: str = "", workers: int | None = None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--data", json.dumps({k: str(v) for k, v in data.items()}),
           "--out", str(out)] + (["--against", against] if against else []) + (["--workers", str(workers)] if workers else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{kind} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


# --- the table -----------------------------------------------------------------------------------

PHASES = [
    ("read_check", "read inputs (ours: + row checks)"),
    ("check", "  of which row checks (ours)"),
    ("join", "label join"),
    ("standardize", "standardize (z, weights, sort)"),
    ("export", "write train + export"),
    ("total", "total"),
    ("total_unchecked", "total without row checks"),
]


def report(n: int, ours: dict, baselines: dict[str, dict], agree: dict[str, dict], generate_s: float) -> str:
    ours["seconds"]["total_unchecked"] = ours["seconds"]["total"] - ours["seconds"]["check"]
    for b in baselines.values():
        b["seconds"]["total_unchecked"] = b["seconds"]["total"] - b["seconds"].get("check", 0.0)
    head = f"{'phase':34s} {'ours s':>8s} {'peak MB':>8s}"
    for name in baselines:
        head += f" {name + ' s':>15s} {'peak MB':>8s} {name + '/ours':>13s}"
    lines = [(f"standardize at scale: {n:,} trajectories ({ours['rows_in']:,} read, {ours['rows_out']:,} written, "
             f"{ours['quarantined']:,} quarantined); inputs generated in {generate_s:.1f} s (cached)"), head]
    for key, label in PHASES:
        s = ours["seconds"].get(key)
        peak = ours["peak_mb"].get(key, ours["peak_mb"]["total"] if key.startswith("total") else None)
        row = f"{label:34s} {s:8.2f} " + (f"{peak:8.0f}" if peak is not None else f"{'':8s}")
        for b in baselines.values():
            bs = b["seconds"].get(key)
            bpeak = b["peak_mb"].get(key, b["peak_mb"]["total"] if key.startswith("total") else None)
            if bs is None:
                row += f" {'-':>15s} {'':8s} {'':13s}"
            else:
                row += f" {bs:15.2f} " + (f"{bpeak:8.0f}" if bpeak is not None else f"{'':8s}") + f" {bs / s:12.1f}x"
        lines.append(row)
    row = f"{'CPU time, all processes (user+sys)':34s} {ours['cpu_seconds']:8.2f} {'':8s}"
    for b in baselines.values():
        row += f" {b['cpu_seconds']:15.2f} {'':8s} {b['cpu_seconds'] / ours['cpu_seconds']:12.1f}x"
    lines.append(row)
    for name, a in agree.items():
        lines.append(f"outputs agree with {name}: {'yes' if a['agree'] else 'NO'} ({a.get('rows', a.get('why'))})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="trajectories")
    ap.add_argument("--small", action="store_true", help=f"--n {SMALL:,} (CI)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pandas-arrow", action="store_true", help="also pandas with dtype_backend='pyarrow'")
    ap.add_argument("--workers", type=int, help="our row-check processes (default: up to 2, one per core; 1: in-process)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--against", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    n = SMALL if args.small else args.n
    t = time.perf_counter()
    data = generate(n, args.seed)
    generate_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory(prefix="data-scale-") as work:
        work = Path(work)
        ours = _run_child("ours", data, work / "ours", workers=args.workers)
        kinds = ["pandas"] + (["pandas-arrow"] if args.pandas_arrow else [])
        baselines = {k: _run_child(k, data, work / k) for k in kinds}
        # The same stage on the same bytes outside the DVC project: every row's content hash is
        # computed again, as for a file copied in or edited by hand.
        baselines["ours-hashed"] = _run_child("ours", unrecorded(data), work / "ours-hashed", workers=args.workers)
        agree = {k: _run_child("compare", data, work, against=k) for k in [*kinds, "ours-hashed"]}
    text = report(n, ours, baselines, agree, generate_s)
    print(text)
    OUT.mkdir(parents=True, exist_ok=True)
    record = json.dumps({
        "command": " ".join(["python", "bench/data_scale.py", *sys.argv[1:]]), "n": n, "seed": args.seed,
        "load_average_1m_5m_15m": os.getloadavg(), "cpus": os.cpu_count(),
        "ours": ours, **baselines, "agree": agree, "table": text,
    }, indent=2) + "\n"
    for name in ("data_scale.json", f"data_scale_n{n}.json"):  # the latest run, and the latest at this size
        (OUT / name).write_text(record)


if __name__ == "__main__":
    main()
