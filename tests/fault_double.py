"""An OpenAI-compatible chat-completions double on loopback, for the faults a hosted API throws.

Two ways to drive it:
- by the request's `model` (the backend's own tests): a script per model name, e.g.
  "429-then-ok", "always-503", "hang", "truncated", "malformed";
- by the prompt (stage tests): any other model gets a reply its role's parser accepts (the role
  is recognised from the system prompt), and `inject(...)` turns on faults for a deterministic
  subset of requests, chosen by a hash of the request (messages and seed). A fault named
  "<kind>-once" is transient (the request's first attempt fails, its retry succeeds); a plain
  "<kind>" is persistent (every attempt fails) until `heal()`.

The double records every request: `hits` per (model, request digest), the Authorization
headers it was sent (`auth`), the fault each request drew and the replies it gave.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# Fault kinds for stage tests. Transient ones end ok after one retry; persistent ones end as
# failed rows (the SDK does not retry a 401 or a 200 whose body is not JSON at all).
TRANSIENT = ("429-once", "500-once", "hang-once", "truncated-once")
PERSISTENT = ("500", "hang", "truncated", "malformed", "401")
FAULTS = TRANSIENT + PERSISTENT

# What a failed row's reason says for each persistent fault (models/openai.py's wording).
REASON = {
    "500": "HTTP 500",
    "hang": "timed out",
    "truncated": "connection error",
    "malformed": "malformed response",
    "401": "HTTP 401",
}

# Questions a proposer reply suggests: none is in the oracle's question set, so none equals a
# scripted player's logged action.
_QUESTIONS = ("Is it heavier than a loaf of bread?", "Would it fit in a shoebox?", "Is it usually kept outdoors?", "Does it need electricity?")


def chat_body(text: str) -> bytes:
    return json.dumps(
        {
            "id": "cmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": "double",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        }
    ).encode()


def request_digest(request: dict) -> str:
    """Names one request: its messages and seed (a role resamples with a new seed)."""
    return hashlib.sha256(json.dumps([request["messages"], request.get("seed")], sort_keys=True).encode()).hexdigest()


def role_reply(messages: list[dict], digest: str) -> str | None:
    """A reply the role's parser accepts (summarizer, few-shot labeler, proposer), or None when
    the prompt is none of theirs. The digest's prefix tags the reply, so a stored text can be
    told from every other."""
    system = messages[0]["content"]
    tag, n = digest[:8], int(digest[:8], 16)
    if system.startswith("You summarize games"):
        return f"The player asked yes-no questions about the secret object; summary {tag}. It should have used its answers sooner."
    if system.startswith("You rate games"):
        return f"Reward: {-(n % 4)}"
    if system.startswith("You are a twenty-questions coach"):
        count = int(re.search(r"exactly (\d+) objects", system).group(1))
        proposals = [
            {"teacher_reason": f"In hindsight this splits the rest well ({tag}).", "question": _QUESTIONS[(n + i) % len(_QUESTIONS)], "player_reason": "The answers so far leave this open."}
            for i in range(count)
        ]
        return "```json\n" + json.dumps(proposals) + "\n```"
    return None


def _not_text_arguments(messages: list[dict]) -> str | None:
    for i, m in enumerate(messages):
        for j, call in enumerate(m.get("tool_calls") or []):
            if not isinstance(call["function"]["arguments"], str):
                return f"messages[{i}].tool_calls[{j}].function.arguments"
    return None


class Handler(BaseHTTPRequestHandler):
    server: FaultDouble

    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes, headers: dict | None = None, content_type: str = "application/json"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server, digest = self.server, request_digest(request)
        with server.lock:
            server.hits[(request["model"], digest)] += 1
            hit = server.hits[(request["model"], digest)]
            server.auth.append(self.headers.get("Authorization"))
            server.in_flight += 1
            server.max_in_flight = max(server.max_in_flight, server.in_flight)
        try:
            fault = server.fault_for(digest)
            if fault is None or (fault.endswith("-once") and hit > 1):
                self._answer(request, digest, hit)
            else:
                with server.lock:
                    server.faults_sent[fault] += 1
                self._fault(fault.removesuffix("-once"), hit)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (a timeout): nothing to answer
        finally:
            with server.lock:
                server.in_flight -= 1

    def _error(self, message: str, kind: str = "server_error", code: str | None = None) -> bytes:
        return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()

    def _fault(self, kind: str, hit: int):
        quick = {"retry-after-ms": "10"}  # the server asks for a short wait; the SDK honours it
        if kind == "429":
            self._send(429, self._error(f"scripted failure {hit}: rate limit reached", "rate_limit_exceeded"), quick)
        elif kind == "500":
            self._send(500, self._error(f"scripted failure {hit}"))  # no Retry-After: the SDK's own backoff
        elif kind == "503":
            self._send(503, self._error(f"scripted failure {hit}"), quick)
        elif kind == "400":
            self._send(400, self._error(f"scripted failure {hit}", "invalid_request_error"))
        elif kind == "401":
            # As real APIs do: the error echoes the key it was given.
            key = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
            self._send(401, self._error(f"Incorrect API key provided: {key}. You can find your API key in your account settings.", "invalid_request_error", "invalid_api_key"))
        elif kind == "hang":
            self.server.closing.wait(self.server.hang_seconds)  # past the client's timeout
            self._send(200, chat_body("too late"))
        elif kind == "truncated":
            body = chat_body("cut")
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:20])  # then the connection closes short of its length
            self.close_connection = True
        elif kind == "malformed":
            self._send(200, b'{"id": "cmpl-1", "choices": [{"mess')
        elif kind == "empty-body":
            self._send(200, b"")
        elif kind == "html":
            self._send(200, b"<html>gateway</html>", content_type="text/html")
        elif kind == "no-choices":
            self._send(200, json.dumps({"id": "cmpl-1", "object": "chat.completion", "choices": []}).encode())
        elif kind == "null-content":
            body = json.loads(chat_body(""))
            body["choices"][0]["message"]["content"] = None
            body["choices"][0]["finish_reason"] = "content_filter"
            self._send(200, json.dumps(body).encode())
        else:
            raise ValueError(f"unknown fault {kind!r}")

    def _answer(self, request: dict, digest: str, hit: int):
        model = request["model"]
        wrong = _not_text_arguments(request["messages"])
        if wrong:  # as OpenAI's API answers a tool call whose arguments are not a string
            self._send(400, self._error(f"Invalid type for '{wrong}': expected a string, but got an object instead.", "invalid_request_error"))
            return
        scripted = {"429-then-ok": "429", "500-then-ok": "500"}
        if scripted.get(model) and hit == 1:
            self._fault(scripted[model], hit)
        elif model == "always-503" or request["messages"][-1]["content"] == "[fail]":
            self._fault("503", hit)
        elif model == "bad-request":
            self._fault("400", hit)
        elif model in ("hang", "truncated", "malformed", "empty-body", "html", "no-choices", "null-content"):
            self._fault(model, hit)
        elif model == "slow":
            self.server.closing.wait(0.2)
            self._send(200, chat_body(f"seed {request['seed']}"))
        else:
            text = role_reply(request["messages"], digest)
            if text is None:
                text = f"seed {request['seed']} temperature {request['temperature']} max_tokens {request['max_tokens']}"
            with self.server.lock:
                self.server.replies[digest] = text
            self._send(200, chat_body(text))


class FaultDouble(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's default backlog of 5 drops connections a burst of concurrent requests opens,
    # and a dropped SYN is resent after 1 s: a client with a short timeout would see a hang.
    request_queue_size = 128

    def __init__(self, hang_seconds: float = 3.0):
        super().__init__(("127.0.0.1", 0), Handler)
        self.lock, self.closing = threading.Lock(), threading.Event()
        self.hang_seconds = hang_seconds
        self.url = f"http://127.0.0.1:{self.server_address[1]}/v1"
        self.faults: tuple[str, ...] = ()
        self.slots, self.salt = 1, ""
        self.reset()

    def reset(self) -> None:
        """Forget what was sent and answered (fault assignments stay as they are)."""
        with self.lock:
            self.hits: Counter = Counter()
            self.auth: list[str | None] = []
            self.faults_sent: Counter = Counter()
            self.drawn: dict[str, str] = {}  # request digest -> the fault it drew
            self.replies: dict[str, str] = {}  # request digest -> the last 200 reply's text
            self.in_flight = self.max_in_flight = 0

    def inject(self, faults: tuple[str, ...] = FAULTS, slots: int = 20, salt: str = "") -> None:
        """Request h (a hash of messages and seed) draws faults[h % slots], or none when
        h % slots >= len(faults): each fault hits about 1/slots of the requests."""
        if len(faults) > slots:
            raise ValueError(f"{len(faults)} faults in {slots} slots")
        self.faults, self.slots, self.salt = tuple(faults), slots, salt

    def heal(self) -> None:
        self.faults = ()

    def fault_for(self, digest: str) -> str | None:
        if not self.faults:
            return None
        slot = int(hashlib.sha256((self.salt + digest).encode()).hexdigest()[:8], 16) % self.slots
        fault = self.faults[slot] if slot < len(self.faults) else None
        if fault is not None:
            with self.lock:
                self.drawn[digest] = fault
        return fault


@contextmanager
def running(hang_seconds: float = 3.0) -> Iterator[FaultDouble]:
    server = FaultDouble(hang_seconds)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.closing.set()  # hanging handlers return at once
        server.shutdown()
        server.server_close()


def write_logged_games(path: Path, n_tasks: int, max_turns: int, per_task: int = 2, split: str = "train") -> list[dict]:
    """Scripted, noisy games on the first n_tasks tasks of a split: a stage's input in seconds."""
    from envs.twenty_questions.kb import load_kb
    from envs.twenty_questions.env import Scripted
    from envs.twenty_questions.policies import NoisyPolicy
    from storage.parquet import write_table
    from storage.schema import to_table
    from conftest import twenty_questions
    from tasks.rollout import ScriptedAgent, new_episode, play

    kb = load_kb()
    eps = [new_episode(twenty_questions(max_turns), task, k) for task in kb.split(split)[:n_tasks] for k in range(per_task)]
    play(eps, ScriptedAgent(lambda rng: Scripted(NoisyPolicy(0.4, 0.2, 0.1))), 0, "logged")
    rows = [e.to_row() for e in eps]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_table(to_table(rows, "trajectories"), path, "trajectories")
    return rows
