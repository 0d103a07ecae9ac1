"""The stage server: the imports every stage process pays, paid once per `retrosight run`.

A stage process (`retrosight stage NAME`, which DVC starts) spent seconds importing torch,
transformers, TRL and Prefect before its first line of work, more than the work of most stages.
`retrosight run` starts this server beside its stages (`runtime.preload: true`): it imports every
stage's flow module once and waits on a Unix socket. The stage process DVC starts finds it through
SERVER_ENV and hands over its argv, working directory, environment and stdin, stdout and stderr;
the server forks a child that runs the stage exactly as that process would have, writing to the
same terminal or pipe; the stage process waits and exits with the child's status (that side, and
starting the server, are flows/relay.py). DVC sees one process that ran the stage, as before.

Why forking is sound here: the server forks from its one Python thread before any stage work,
torch's OpenMP pool and polars' thread pool start lazily in each child, and the child takes the
caller's environment (Prefect's settings reread from it). Without the server, or when it cannot be
reached, the stage runs in its own process as before.

The child stays in the run's process group, so killing the run's group kills it; if the process DVC
started dies, the server kills its child; if `retrosight run` ends (the server's stdin closes), the
server ends, killing any child still running.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys

from flows.relay import HEADER, SERVER_ENV, STARTED_ENV


def _stage_modules() -> list[str]:
    from flows.cli import STAGE_FLOWS

    return sorted({spec.partition(":")[0] for spec in STAGE_FLOWS.values()})


def serve(path: str) -> None:
    """Bind `path`, import every stage's flow module, then fork a child per request until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the stages in the run's group; the run ends us
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)  # bound before the imports: a stage that comes early waits for them, not imports again
    import importlib

    from tasks.runtime import apply_from_file

    apply_from_file()  # torch's threads and wait policy from this run's params.yaml, before torch loads
    for module in _stage_modules():
        importlib.import_module(module)
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # its wakeup byte is what counts
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "parent")
    sel.register(wakeup_r, selectors.EVENT_READ, "child")
    running: dict[int, socket.socket] = {}  # child pid: the connection of the process waiting for it
    while True:
        for key, _ in sel.select():
            if key.data == "parent" and not os.read(sys.stdin.fileno(), 4096):
                for pid in running:
                    _kill(pid)
                return
            if key.data == "accept":
                conn, _ = listener.accept()
                # what the child must not hold: the server's sockets and pipes, other stages' connections
                pid = _fork_stage(conn, [listener, sel, wakeup_r, wakeup_w, *running.values()])
                if pid is not None:
                    running[pid] = conn
                    sel.register(conn, selectors.EVENT_READ, pid)
            elif key.data == "child":
                os.read(wakeup_r, 4096)
                _reap(running, sel)
            elif isinstance(key.data, int) and key.data in running:  # the waiting process went away
                _kill(key.data)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(running: dict[int, socket.socket], sel: selectors.BaseSelector) -> None:
    while running:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = running.pop(pid, None)
        if conn is None:
            continue
        sel.unregister(conn)
        try:
            conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        except OSError:
            pass
        conn.close()


def _fork_stage(conn: socket.socket, server_side: list) -> int | None:
    fds: list[int] = []
    try:
        header, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
        while len(header) < HEADER.size and (more := conn.recv(HEADER.size - len(header))):
            header += more
        (size,) = HEADER.unpack(header)
        data = bytearray()
        while len(data) < size and (more := conn.recv(min(1 << 16, size - len(data)))):
            data += more
        request = json.loads(data)
        if len(fds) != 3:
            raise ValueError(f"3 file descriptors expected, got {len(fds)}")
    except (OSError, ValueError, struct.error) as e:
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"refused": str(e)}).encode() + b"\n")
        conn.close()
        return None
    pid = os.fork()
    if pid == 0:
        for thing in [*server_side, conn]:
            thing.close() if hasattr(thing, "close") else os.close(thing)
        _run_child(request, fds)  # never returns
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return pid


def _run_child(request: dict, fds: list[int]) -> None:
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL if sig == signal.SIGCHLD else signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for stream in (sys.stdout, sys.stderr):  # a terminal now, perhaps, where the server had a pipe
            stream.reconfigure(line_buffering=stream.isatty())
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.pop(SERVER_ENV, None)  # the child is the stage: it runs it, it does not ask again
        os.environ[STARTED_ENV] = repr(request["started"])
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()  # Prefect read its settings from the server's environment
        sys.argv = request["argv"]
        from flows.cli import main

        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 -- what an uncaught exception would print, then its status
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 -- a closed pipe: nothing more to say
                pass
        os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1])
