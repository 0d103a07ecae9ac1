"""The response cache every role shares: a finished call is never made (or paid for) twice.

Keyed by (backend, model, sampling parameters, seed, messages). It lives in one SQLite file in
WAL mode: readers never block, concurrent writers (threads, or two stages in two processes)
serialise on SQLite's own lock, and a killed writer leaves the last committed state. Misses are
committed as they finish (an API's answer by answer, a local model's batch by batch), so what a
killed run finished is its checkpoint. Only successful completions are stored, so a request that
failed is tried again on the next run.
"""
from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from dataclasses import asdict
from pathlib import Path

from models.base import Completion, Generator, Message, SamplingParams

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    key TEXT PRIMARY KEY,
    backend TEXT NOT NULL,
    model TEXT NOT NULL,
    text TEXT NOT NULL,
    created REAL NOT NULL
)
"""
COMMIT_EVERY = 256  # requests per committed chunk on a backend that cannot stream its answers


def request_key(backend: str, model: str, sampling: SamplingParams, seed: int, messages: list[Message]) -> str:
    blob = json.dumps(
        {"backend": backend, "model": model, "sampling": asdict(sampling), "seed": seed, "messages": messages},
        sort_keys=True,
        ensure_ascii=False,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


class ResponseCache:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        with self._conn() as db:
            db.execute(SCHEMA)

    def _conn(self) -> sqlite3.Connection:
        # One connection per thread: sqlite3 connections must not cross threads.
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=60, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            self._local.db = db
        return db

    def get_many(self, keys: list[str]) -> dict[str, str]:
        found: dict[str, str] = {}
        db = self._conn()
        for start in range(0, len(keys), 500):  # under SQLite's bound-parameter limit
            chunk = keys[start : start + 500]
            marks = ",".join("?" * len(chunk))
            found.update(db.execute(f"SELECT key, text FROM responses WHERE key IN ({marks})", chunk).fetchall())
        return found

    def put_many(self, rows: list[tuple[str, str, str, str]]) -> None:
        """rows of (key, backend, model, text); one transaction, so a batch lands whole or not at all."""
        if not rows:
            return
        db, now = self._conn(), time.time()
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany(
                "INSERT OR IGNORE INTO responses (key, backend, model, text, created) VALUES (?, ?, ?, ?, ?)",
                [(*row, now) for row in rows],
            )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def __len__(self) -> int:
        return self._conn().execute("SELECT count(*) FROM responses").fetchone()[0]


class CachedGenerator:
    """Any backend behind the cache: hits are served from disk, only misses reach the backend
    (in one batch), and successful misses are stored before they are returned."""

    def __init__(self, inner: Generator, cache: ResponseCache):
        self.inner, self.cache = inner, cache
        self.backend, self.model_id = inner.backend, inner.model_id
        self.cache_stats = {"hits": 0, "misses": 0, "failures": 0, "backend_seconds": 0.0}

    def generate(self, conversations: list[list[Message]], sampling: SamplingParams, seeds: list[int]) -> list[Completion]:
        if len(seeds) != len(conversations):
            raise ValueError(f"{len(conversations)} conversations but {len(seeds)} seeds")
        keys = [request_key(self.backend, self.model_id, sampling, s, c) for c, s in zip(conversations, seeds)]
        found = self.cache.get_many(keys)
        out: list[Completion | None] = [Completion(found[k]) if k in found else None for k in keys]
        todo = [i for i, c in enumerate(out) if c is None]
        self.cache_stats["hits"] += len(keys) - len(todo)
        self.cache_stats["misses"] += len(todo)
        if todo and getattr(self.inner, "streams_results", False):
            self._generate_streamed(conversations, sampling, seeds, keys, todo, out)
            return out  # type: ignore[return-value]
        # A backend that cannot report answers as they finish (vLLM's offline engine) gets the
        # misses a chunk at a time, each committed as it returns: a run killed mid-call loses at
        # most the chunk in flight.
        for start in range(0, len(todo), COMMIT_EVERY):
            chunk = todo[start : start + COMMIT_EVERY]
            t0 = time.perf_counter()
            fresh = self.inner.generate([conversations[i] for i in chunk], sampling, [seeds[i] for i in chunk])
            self.cache_stats["backend_seconds"] += time.perf_counter() - t0
            self.cache.put_many([(keys[i], self.backend, self.model_id, c.text) for i, c in zip(chunk, fresh) if c.ok])
            for i, c in zip(chunk, fresh, strict=True):
                out[i] = c
                self.cache_stats["failures"] += not c.ok
        return out  # type: ignore[return-value]

    def _generate_streamed(self, conversations, sampling, seeds, keys, todo, out) -> None:
        # Each answer is committed the moment the backend has it (an API's one by one, hf's a
        # batch at a time), so a killed run loses none. One call keeps the backend's own batching.
        def keep(j: int, c: Completion) -> None:
            if c.ok:
                self.cache.put_many([(keys[todo[j]], self.backend, self.model_id, c.text)])

        t0 = time.perf_counter()
        fresh = self.inner.generate([conversations[i] for i in todo], sampling, [seeds[i] for i in todo], on_result=keep)
        self.cache_stats["backend_seconds"] += time.perf_counter() - t0
        for i, c in zip(todo, fresh, strict=True):
            out[i] = c
            self.cache_stats["failures"] += not c.ok

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # backend extras (hf's prompt-token stats) stay reachable
