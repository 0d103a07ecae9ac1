"""Real stages with their LLM role on the `openai` backend against a faulty API (tests/fault_double.py):
transient faults are retried and end ok, persistent ones end as failed rows naming the fault,
no row is lost, the failure rate decides whether the stage passes, the response cache holds
exactly the successful responses, and a rerun against a healthy API sends only what failed.
Also: a writer killed with SIGKILL mid-transaction leaves the response cache whole."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import ROOT, tiny_params
from fault_double import FAULTS, PERSISTENT, REASON, TRANSIENT, running, write_logged_games
from models.cache import ResponseCache
from tasks.params import Params
from tasks.roles import RoleFailure

MAX_TURNS = 6
KEY_ENV, KEY = "RETROSIGHT_FAULTS_KEY", "sk-faults-0123456789abcdef"
TIMEOUT = 1.0  # per attempt; the double hangs for 3 s
RETRIED = {"500", "hang", "truncated"}  # persistent faults the SDK retries (max_retries times)


@pytest.fixture(scope="module")
def games(tmp_path_factory) -> tuple[Path, Path, list[dict]]:
    """150 logged games (75 tasks x 2) and their oracle summaries."""
    from tasks.summarize import run_summarize

    work = tmp_path_factory.mktemp("games")
    rows = write_logged_games(work / "trajectories.parquet", 75, MAX_TURNS)
    run_summarize(Params.model_validate(tiny_params({"env": {"max_turns": MAX_TURNS}})), work / "trajectories.parquet", work / "oracle")
    return work / "trajectories.parquet", work / "oracle/summaries.parquet", rows


def _params(role_name: str, url: str, cache: Path, max_failure_rate: float) -> Params:
    role = {
        "backend": "openai", "model": "roles", "base_url": url, "api_key_env": KEY_ENV,
        "timeout": TIMEOUT, "max_retries": 1, "concurrency": 32, "parse_attempts": 1,
        "max_failure_rate": max_failure_rate, "sampling": {"max_new_tokens": 128},
    }  # fmt: skip
    return Params.model_validate(tiny_params({
        "env": {"max_turns": MAX_TURNS},
        "roles": {role_name: role},
        "relabel": {"k": 2, "t": 1, "n": 1, "window": [0.0, 1.0]},
        "cache": {"path": str(cache)},
    }))


@dataclass(frozen=True)
class Stage:
    name: str
    role: str
    table: str
    run: Callable[[Params, tuple, Path], dict]
    row_key: Callable[[dict], object]  # what makes a row one input's
    inputs: Callable[[list[dict], dict], int]  # how many rows must come out
    output: Callable[[dict], object]  # an ok row's output...
    stored: Callable[[str], object]  # ...and what a cached response becomes in the row


def _summarize(params, games, out):
    from tasks.summarize import run_summarize

    return run_summarize(params, games[0], out)


def _label(params, games, out):
    from tasks.label import run_label

    return run_label(params, [games[0]], out)


def _relabel(params, games, out):
    from tasks.relabel import run_relabel

    return run_relabel(params, games[0], games[1], out)


STAGES = [
    Stage("summarize", "summarizer", "summaries.parquet", _summarize, lambda r: r["trajectory_id"], lambda g, m: len(g),
          lambda r: r["summary"], lambda text: " ".join(text.split())),
    Stage("label", "labeler", "labels.parquet", _label, lambda r: r["trajectory_id"], lambda g, m: len(g),
          lambda r: r["reward"], lambda text: float(text.removeprefix("Reward: "))),
    # One counterfactual per chosen timestep (n = 1): one row per site, ok or failed.
    Stage("relabel", "proposer", "relabels.parquet", _relabel, lambda r: (r["trajectory_id"], r["branch_turn"]), lambda g, m: m["timesteps"],
          lambda r: r["rationale"], lambda text: json.loads(text.strip("`\njson"))[0]["teacher_reason"]),
]  # fmt: skip


def _fault_named(reason: str) -> str:
    named = [fault for fault, words in REASON.items() if words in reason]
    assert len(named) == 1, reason
    return named[0]


def _cached_texts(path: Path) -> list[str]:
    db = sqlite3.connect(path)
    try:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        return [text for (text,) in db.execute("SELECT text FROM responses")]
    finally:
        db.close()


@pytest.mark.parametrize("stage", STAGES, ids=[s.name for s in STAGES])
def test_a_stage_on_a_faulty_api(stage: Stage, games, tmp_path, monkeypatch, faults):
    monkeypatch.setenv(KEY_ENV, KEY)
    cache = tmp_path / "responses.sqlite"
    with running(hang_seconds=3 * TIMEOUT) as double:
        double.inject(FAULTS, slots=16)  # 9 faults in 16 slots: 5/16 of the requests fail for good
        m = stage.run(_params(stage.role, double.url, cache, 0.5), games, tmp_path / "first")
        rows = pq.read_table(tmp_path / "first" / stage.table).to_pylist()
        calls, api = m["calls"], m["calls"]["openai_stats"]
        n = calls["requests"]

        # Rows in = rows out: one row per input, ok or failed.
        assert len(rows) == len({stage.row_key(r) for r in rows}) == stage.inputs(games[2], m) == n > 100
        drawn = dict(double.drawn)
        assert set(drawn.values()) == set(FAULTS), "a fault kind drew no request: change the double's salt"
        persistent = {d for d, f in drawn.items() if f in PERSISTENT}
        transient = {d for d, f in drawn.items() if f in TRANSIENT}

        # Transient faults: retried once each, then answered; persistent ones: retried where the
        # SDK retries, never answered.
        assert transient <= set(double.replies) and not persistent & set(double.replies)
        retries = len(transient) + sum(drawn[d] in RETRIED for d in persistent)
        assert api == {"requests": n, "attempts": n + retries, "retries": retries, "failures": len(persistent)}
        assert sum(double.hits.values()) == api["attempts"] > n

        # Persistent faults end as failed rows whose reason names the fault.
        failed = [r for r in rows if r["status"] != "ok"]
        assert {r["status"] for r in failed} == {"failed"}
        assert Counter(_fault_named(r["reason"]) for r in failed) == Counter(drawn[d] for d in persistent)
        assert calls["failed"] == len(persistent) and calls["invalid"] == 0 and calls["ok"] == n - len(persistent)
        assert not any(KEY in (r["reason"] or "") for r in failed)  # the 401's echo of the key is redacted
        faults(LLM_fault_responses=sum(double.faults_sent.values()), LLM_retries=api["retries"], LLM_rows_failed=len(failed), rows_lost=n - len(rows))

        # The cache holds exactly the successful responses, each the text its row was made from.
        texts = _cached_texts(cache)
        assert len(texts) == calls["ok"]
        assert Counter(stage.stored(t) for t in texts) == Counter(stage.output(r) for r in rows if r["status"] == "ok")

        # Over its max_failure_rate the stage fails, naming the count; the cache answers what
        # succeeded, so only the failed requests reach the API again.
        double.reset()
        p = len(persistent)
        message = rf"{stage.name}: the {stage.role} role failed on {p} of {n} requests \(0 unparseable, {p} with no answer from the backend\), over its max_failure_rate 0.1"
        with pytest.raises(RoleFailure, match=message):
            stage.run(_params(stage.role, double.url, cache, 0.1), games, tmp_path / "strict")
        assert {d for _, d in double.hits} == persistent

        # Against a healthy API a rerun sends each failed request once, and nothing else.
        double.reset()
        double.heal()
        again = stage.run(_params(stage.role, double.url, cache, 0.5), games, tmp_path / "healed")
        assert {d for _, d in double.hits} == persistent and sum(double.hits.values()) == p
        healed = pq.read_table(tmp_path / "healed" / stage.table).to_pylist()
        assert {r["status"] for r in healed} == {"ok"} and {stage.row_key(r) for r in healed} == {stage.row_key(r) for r in rows}
        assert again["calls"]["cache"]["hits"] == n - p and len(_cached_texts(cache)) == n


# --- the cache under SIGKILL ------------------------------------------------------------------

BATCH, BODY = 400, 6000  # a 2.4 MB transaction: past SQLite's 2 MB page cache, so it spills into the WAL before COMMIT

WRITER = f"""
import hashlib, sys
from models.cache import ResponseCache

cache, run = ResponseCache(sys.argv[1]), sys.argv[2]
for batch in range(10_000):
    rows = []
    for i in range({BATCH}):
        body = hashlib.sha256(f"{{run}}-{{batch}}-{{i}}".encode()).hexdigest() * ({BODY} // 64)
        rows.append((f"{{run}}-{{batch}}-{{i}}", "openai", "m", body + "|" + hashlib.sha256(body.encode()).hexdigest()))
    print("begin", batch, flush=True)
    cache.put_many(rows)
    print("commit", batch, flush=True)
"""


def _kill_inside_a_transaction(path: Path, run: str) -> int:
    """Start a writer; once it has committed a batch, stop it (SIGSTOP) partway into a later one
    and prove it is inside its transaction (it holds SQLite's write lock: another connection's
    BEGIN IMMEDIATE is refused), then SIGKILL it. Returns the batches it committed."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), run], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    lines, write_seconds, started = [], None, 0.0
    try:
        for line in proc.stdout:
            lines.append(line.split())
            word, batch = lines[-1][0], int(lines[-1][1])
            if word == "commit":
                write_seconds = time.monotonic() - started
            elif word == "begin":
                started = time.monotonic()
                if write_seconds is None:
                    continue
                time.sleep(write_seconds / 3)
                proc.send_signal(signal.SIGSTOP)
                probe = sqlite3.connect(path, timeout=0, isolation_level=None)
                try:
                    probe.execute("BEGIN IMMEDIATE")
                    probe.execute("ROLLBACK")  # not inside one: the write was quicker; try the next batch sooner
                    write_seconds /= 2
                    assert batch < 30, "never caught the writer inside a transaction"
                    proc.send_signal(signal.SIGCONT)
                except sqlite3.OperationalError as e:
                    assert "locked" in str(e)
                    # Closed first: the last connection to close checkpoints the WAL and deletes it,
                    # and the probe must not be that one (the killed writer's WAL is to be left).
                    probe.close()
                    proc.send_signal(signal.SIGKILL)
                    break
                finally:
                    probe.close()
    finally:
        proc.kill()
        lines += [line.split() for line in proc.stdout.read().splitlines()]
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return sum(word == "commit" for word, _ in lines)


@pytest.mark.system
def test_a_writer_killed_mid_transaction_leaves_a_whole_cache(tmp_path, faults):
    import hashlib

    path, total = tmp_path / "responses.sqlite", 0
    for round_ in range(3):
        committed = _kill_inside_a_transaction(path, f"r{round_}")
        assert path.with_name(path.name + "-wal").stat().st_size > 0  # left for the next opener to recover
        db = sqlite3.connect(path)
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        per_batch = Counter(key.rsplit("-", 1)[0] for (key,) in db.execute("SELECT key FROM responses WHERE key LIKE ?", (f"r{round_}-%",)))
        # Whole batches only (a transaction lands whole or not at all): every committed one, and at
        # most the one in flight besides. Under load the probe can also find the lock held by the
        # checkpoint that follows a COMMIT, before the writer has said "commit": that batch is whole.
        landed = len(per_batch)
        assert committed <= landed <= committed + 1, (committed, landed)
        assert per_batch == {f"r{round_}-{b}": BATCH for b in range(landed)}
        total += landed
        for (text,) in db.execute("SELECT text FROM responses"):
            body, digest = text.rsplit("|", 1)
            assert len(body) == BODY // 64 * 64 and hashlib.sha256(body.encode()).hexdigest() == digest
        db.close()
    assert len(ResponseCache(path)) == total * BATCH  # and the cache itself opens it and reads on
    faults(sigkills=3)


# A paid API's answers are committed as they arrive: a run killed while some requests still hang
# has kept every answer it got, and its rerun sends only the others.
API_RUN = """
import sys
from models.base import SamplingParams
from models.cache import CachedGenerator, ResponseCache
from models.openai import OpenAIGenerator
url, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
gen = CachedGenerator(OpenAIGenerator("ok", base_url=url, api_key_env=None, concurrency=n, timeout=120, max_retries=0), ResponseCache(path))
gen.generate([[{"role": "user", "content": f"question {i}"}] for i in range(n)], SamplingParams(), list(range(n)))
"""


@pytest.mark.system
def test_an_api_run_killed_mid_batch_keeps_every_answer_it_was_paid_for(tmp_path, faults):
    n, path = 24, tmp_path / "responses.sqlite"
    with running(hang_seconds=120) as double:
        double.inject(("hang",), slots=3)  # about a third of the requests never answer in time
        proc = subprocess.Popen([sys.executable, "-c", API_RUN, double.url, str(path), str(n)], cwd=ROOT)
        try:
            deadline = time.monotonic() + 60
            # Wait until every request has reached the double and every answerable one is answered.
            while sum(double.hits.values()) < n or len(double.replies) < n - len(double.drawn):
                assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled"
                time.sleep(0.05)
            answered = set(double.replies)
            while len(ResponseCache(path)) < len(answered) and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)  # mid-batch: the hanging requests are still open
            proc.wait()
        finally:
            proc.kill()
        assert 0 < len(answered) < n and double.drawn
        assert len(ResponseCache(path)) == len(answered)  # every answer paid for is kept

        double.heal()
        double.reset()
        from models.base import SamplingParams
        from models.cache import CachedGenerator
        from models.openai import OpenAIGenerator

        gen = CachedGenerator(OpenAIGenerator("ok", base_url=double.url, api_key_env=None, concurrency=n, timeout=10, max_retries=0), ResponseCache(path))
        out = gen.generate([[{"role": "user", "content": f"question {i}"}] for i in range(n)], SamplingParams(), list(range(n)))
        assert all(c.ok for c in out)
        assert sum(double.hits.values()) == n - len(answered)  # only the ones that never answered
        assert not answered & set(double.hits)
    faults(sigkills=1, runs_resumed=1, LLM_calls_paid_twice=len(answered & set(double.hits)))
