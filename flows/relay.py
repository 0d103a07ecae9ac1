"""The stage process's side of the stage server (flows/preload.py): `retrosight run` starts the
server (stage_server), and the process DVC starts for a stage hands its command to it (relay)
instead of importing the stage's modules itself."""
from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

SERVER_ENV = "RETROSIGHT_STAGE_SERVER"  # the server's socket path, for the stage processes DVC starts
STARTED_ENV = "RETROSIGHT_STAGE_STARTED"  # when the process DVC started began, for the stage's timings
HEADER = struct.Struct("!Q")  # the request's length; then the request (argv, cwd, environment) as JSON


def started(default: float) -> float:
    """When this stage's process began: the relaying process's start when the server forked it."""
    return float(os.environ.pop(STARTED_ENV, default))


def relay(started_at: float) -> int | None:
    """Run this process's command in a child of the stage server, and return its exit status;
    None when there is no server to ask (the caller runs the stage itself)."""
    path = os.environ.get(SERVER_ENV)
    if not path:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        request = json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ), "started": started_at}).encode()
        socket.send_fds(conn, [HEADER.pack(len(request))], [0, 1, 2])
        conn.sendall(request)
        reader = conn.makefile("rb")
        reply = json.loads(reader.readline() or b"{}")
    except (OSError, ValueError):
        conn.close()
        return None
    if "pid" not in reply:
        conn.close()
        return None
    pid = reply["pid"]

    def forward(sig: int, _frame) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    # Ctrl-C reaches the child from the terminal (the run's process group); SIGTERM and SIGHUP
    # sent to this process alone are passed on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    done = json.loads(reader.readline() or b"{}")
    if "status" not in done:
        print(f"error: the stage server ended before stage process {pid} did", file=sys.stderr)
        return 1
    status = done["status"]
    return status if status >= 0 else 128 - status  # killed by a signal: the shell's convention


@contextmanager
def stage_server(env: dict[str, str]) -> Iterator[dict[str, str]]:
    """Start the server for a run's stages; yields the environment entry that points them at it."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="retrosight-server-") as tmp:
        path = str(Path(tmp) / "stages.sock")
        proc = subprocess.Popen([sys.executable, "-m", "flows.preload", path], stdin=subprocess.PIPE, env={**os.environ, **env})
        deadline = time.time() + 30
        while not os.path.exists(path) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        try:
            yield {SERVER_ENV: path} if proc.poll() is None and os.path.exists(path) else {}
        finally:
            proc.stdin.close()  # its cue to end
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


