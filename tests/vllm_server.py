"""vLLM's OpenAI-compatible server, started the way the docs tell a user to start it.

The command is read out of README.md and docs/*.md (the one indented block, in docs/roles.md,
that runs `python -m vllm.entrypoints.openai.api_server`), so the tests and the docs cannot drift:
an option the docs need on CPU is one the tests run with. Only the model directory and the port
are replaced, and `TEST_OPTIONS` appended (float32 weights, to compare with the in-process engine;
no compilation, for a fast start). Its own process group, so its engine and worker processes go
down with it.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from conftest import ROOT, free_port

ENTRY = "python -m vllm.entrypoints.openai.api_server"
TEST_OPTIONS = ["--dtype", "float32", "--enforce-eager"]


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def docs_command() -> list[str]:
    """The docs' server command, as argv (continuation lines joined): the one indented block
    that starts it, over README.md and every page of docs/."""
    starts = [(lines, i) for lines in (p.read_text().splitlines() for p in DOCS)
              for i, line in enumerate(lines) if line.startswith("    ") and line.strip().startswith(ENTRY)]
    if len(starts) != 1:
        raise AssertionError(f"README.md and docs/*.md: expected one indented `{ENTRY} ...` block, found {len(starts)}")
    (lines, i), text = starts[0], ""
    while True:
        line = lines[i].strip()
        text += " " + line.removesuffix("\\")
        if not line.endswith("\\"):
            return shlex.split(text)
        i += 1


def _option(argv: list[str], name: str) -> int:
    """The index of an option's value."""
    if argv.count(name) != 1:
        raise AssertionError(f"the docs' server command must give {name} once: {shlex.join(argv)}")
    return argv.index(name) + 1


def server_command(model_dir: Path, port: int) -> list[str]:
    argv = docs_command()
    overlap = [o for o in TEST_OPTIONS if o.startswith("--") and o in argv]
    if overlap:
        raise AssertionError(f"the docs' server command already sets {overlap}: drop them from TEST_OPTIONS")
    argv[_option(argv, "--model")] = str(model_dir)
    argv[_option(argv, "--port")] = str(port)
    assert argv[0] == "python"
    return [sys.executable, *argv[1:], *TEST_OPTIONS]


@dataclass
class Server:
    url: str  # the OpenAI base URL, .../v1
    proc: subprocess.Popen
    log: Path

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@contextmanager
def serving(model_dir: Path, log_path: Path, start_timeout: float = 300) -> Iterator[Server]:
    """The docs' server on `model_dir`, on a free loopback port, healthy; stopped on exit.
    Started with this interpreter's environment minus VLLM_ENABLE_V1_MULTIPROCESSING (the
    server runs vLLM's default: an engine process beside the API process)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(server_command(model_dir, port), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}/v1", proc, log_path)
    try:
        t0 = time.monotonic()
        deadline = t0 + start_timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"the vLLM server exited with {proc.returncode}:\n{server.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"the vLLM server was not healthy after {start_timeout:.0f} s:\n{server.tail()}")
            time.sleep(1)
        print(f"vLLM server healthy after {time.monotonic() - t0:.0f} s")
        yield server
    finally:
        server.stop()
