"""vLLM on CPU under an LLM stage's load, and an OpenAI-compatible server that is not there.

Long seeded prompts, many at a time (the summarize stage's workload: about 600 tokens each, more
of them than one engine step takes) make vLLM split a prompt's prefill over steps (chunked
prefill); it then rewinds the request's seeded generator, which a CPU generator cannot do, and
the engine dies ("CPU Generator does not use offset"). Run here on the in-process engine
(models/vllm.py) and on vLLM's server started as docs/roles.md says; both must answer every request,
each with the text it gets alone.

The `openai` backend refuses an endpoint nobody answers at before anything is sent, and stops a
call whose server went away (connection refused after it had answered) in one line, keeping the
answers it got in the response cache.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import ROOT, free_port, tiny_params
from fault_double import running, write_logged_games
from models.base import BackendUnavailable, SamplingParams
from models.cache import CachedGenerator, ResponseCache
from models.openai import OpenAIGenerator

MAX_LEN = 1024  # the tiny model's positions
SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=8)


def long_conversation(i: int) -> list[dict]:
    """About 600 tokens with the tiny model's tokenizer, different from the first token on, so
    no two share a prefix the engine could reuse instead of prefilling it."""
    rng = random.Random(i)
    turns = [f"Q{k}: is it a {rng.choice(['cat', 'dog', 'lamp', 'car', 'tree', 'chair'])}? A: {rng.choice(['yes', 'no'])}." for k in range(30)]
    return [{"role": "system", "content": f"Summarize game {i}."}, {"role": "user", "content": " ".join(turns)}]


LONG = [long_conversation(i) for i in range(16)]
SEEDS = list(range(100, 116))


@pytest.fixture(scope="module")
def model_dir(untied_model_dir) -> Path:
    return untied_model_dir


# --- in process -----------------------------------------------------------------------------

# The engine runs in a child process: without the fix, the engine's error leaves it hung (seen
# here: no progress for 10 minutes), which a timeout can end only from outside.
IN_PROCESS = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: fast to start
from models.base import SamplingParams
from models.vllm import VLLMGenerator

if __name__ == "__main__":
    convs, seeds, sampling = json.loads(sys.argv[2])
    sampling = SamplingParams(**sampling)
    gen = VLLMGenerator(sys.argv[1], dtype="float32", max_model_len=1024, enforce_eager=True, kv_cache_memory_bytes=64 << 20)
    scheduler = gen.llm.llm_engine.vllm_config.scheduler_config
    together = gen.generate(convs, sampling, seeds)
    alone = [gen.generate([c], sampling, [s])[0] for c, s in zip(convs, seeds)]
    print(json.dumps({
        "prompt_tokens": [len(gen._ids(c)) for c in convs],
        "step_tokens": scheduler.max_num_batched_tokens,
        "chunked_prefill": scheduler.enable_chunked_prefill,
        "together": [[c.text, c.error] for c in together],
        "alone": [[c.text, c.error] for c in alone],
    }))
"""


@pytest.mark.system
def test_in_process_engine_answers_long_seeded_prompts_as_it_does_one_at_a_time(model_dir, tmp_path):
    script = tmp_path / "in_process.py"
    script.write_text(IN_PROCESS)
    try:
        job = json.dumps([LONG, SEEDS, asdict(SAMPLED)])
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, str(script), str(model_dir), job], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        said = b"".join(x or b"" for x in (e.stdout, e.stderr)).decode(errors="replace")
        died = "CPU Generator does not use offset" in said
        pytest.fail(f"the in-process engine hung on long seeded prompts ({'after' if died else 'without'} 'CPU Generator does not use offset')")
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    # The batch does not fit one engine step, so vLLM's default would have split a prefill.
    assert all(500 < n < MAX_LEN for n in out["prompt_tokens"]) and sum(out["prompt_tokens"]) > out["step_tokens"]
    assert "CPU Generator does not use offset" not in done.stderr
    assert [e for _, e in out["together"]] == [None] * len(LONG), out["together"]
    assert out["together"] == out["alone"]  # seeds exact: a request's text does not depend on its batch
    assert len({t for t, _ in out["together"]}) > len(LONG) // 2
    assert out["chunked_prefill"] is False


# --- vLLM's server, as docs/roles.md starts it ------------------------------------------------


@pytest.mark.system
def test_readme_server_runs_the_summarize_stage_and_keeps_seeds_exact(model_dir, tmp_path):
    from tasks.params import Params
    from tasks.summarize import run_summarize
    from vllm_server import serving

    games = tmp_path / "trajectories.parquet"
    write_logged_games(games, 12, 6)  # 24 games: summary prompts of about 600 tokens
    with serving(model_dir, tmp_path / "serve.log") as server:
        role = {
            "backend": "openai", "model": "tiny", "base_url": server.url, "concurrency": 16, "max_retries": 1,
            "parse_attempts": 1, "max_failure_rate": 1.0, "sampling": {"max_new_tokens": 16},
        }  # fmt: skip
        params = Params.model_validate(tiny_params({"env": {"max_turns": 6}, "roles": {"summarizer": role}}))
        calls = run_summarize(params, games, tmp_path / "summarize")["calls"]
        # Every request answered (the untrained model's text need not parse as a summary).
        assert calls["requests"] == 24 and calls["failed"] == 0, calls

        gen = OpenAIGenerator("tiny", base_url=server.url, api_key_env=None, concurrency=16, timeout=60, max_retries=1)
        together = gen.generate(LONG, SAMPLED, SEEDS)
        assert all(c.ok for c in together), [c.error for c in together if not c.ok][:3]
        alone = [gen.generate([c], SAMPLED, [s])[0] for c, s in zip(LONG, SEEDS)]
        assert together == alone and len({c.text for c in together}) > len(LONG) // 2
        assert server.proc.poll() is None
        log = server.tail(10**7)
    assert "CPU Generator does not use offset" not in log
    assert "enable_chunked_prefill=False" in log  # the engine as started


@pytest.mark.system
def test_a_server_killed_mid_call_is_named_in_one_line_and_its_answers_are_kept(model_dir, tmp_path):
    from vllm_server import serving

    convs = [[{"role": "user", "content": f"question {i}"}] for i in range(40)]
    with serving(model_dir, tmp_path / "serve.log") as server:

        class KilledAfterThreeMore(ResponseCache):
            # The kill rides on the third answer's commit: a thread that polled the cache for it
            # lost the race on a busy machine (all 36 answered before it looked).
            def put_many(self, rows):
                super().put_many(rows)
                if len(self) == 4 + 3:
                    server.stop(signal.SIGKILL)

        cache = KilledAfterThreeMore(tmp_path / "responses.sqlite")
        # A generous timeout: a fresh server's first answers can take long on a busy machine, and a
        # killed server refuses at once, so the wait below does not depend on it.
        gen = CachedGenerator(OpenAIGenerator("tiny", base_url=server.url, api_key_env=None, concurrency=2, timeout=180, max_retries=2), cache)
        first = gen.generate(convs[:4], SAMPLED, list(range(4)))
        assert all(c.ok for c in first), [c.error for c in first]
        t0 = time.monotonic()
        with pytest.raises(BackendUnavailable) as gone:
            gen.generate(convs[4:], SAMPLED, list(range(4, 40)))
        seconds = time.monotonic() - t0
    message = str(gone.value)
    answered = len(cache) - 4  # answers of the second call, each committed as it arrived
    assert "\n" not in message
    assert f"the server at {server.url} stopped answering (connection refused after {4 + answered} answers)" in message
    # At most the requests in flight at the kill failed; the rest were never sent.
    not_sent = int(message.split("; ")[-1].split(" of ")[0])
    assert 36 - answered - 2 <= not_sent <= 36 - answered and message.endswith(f"{not_sent} of 36 requests not sent")
    assert answered >= 3
    stats = gen.inner.stats
    assert stats["attempts"] <= 4 + answered + 2 * 3  # the requests in flight retried, no others
    print(f"dead server named after {seconds:.1f} s: {message}")


# --- an endpoint nobody answers at ----------------------------------------------------------


def test_an_unreachable_endpoint_is_refused_before_anything_is_sent(tmp_path):
    from tasks.params import Params
    from tasks.summarize import run_summarize

    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailable, match=rf"^openai: cannot reach {url} \(connection refused\); nothing was sent$"):
        OpenAIGenerator("m", base_url=url, api_key_env=None)
    assert time.monotonic() - t0 < 2
    # A stage refuses at its start: no request, no output.
    games = tmp_path / "trajectories.parquet"
    write_logged_games(games, 2, 4)
    params = Params.model_validate(tiny_params({"roles": {"summarizer": {"backend": "openai", "model": "m", "base_url": url}}}))
    with pytest.raises(BackendUnavailable, match=url):
        run_summarize(params, games, tmp_path / "out")
    assert not (tmp_path / "out" / "summaries.parquet").exists()


def test_an_endpoint_that_accepts_but_never_answers_is_refused_after_the_role_timeout():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)  # connections complete in the backlog; nothing ever reads them
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        t0 = time.monotonic()
        with pytest.raises(BackendUnavailable, match=rf"^openai: cannot reach {url} \(no answer within 0.5 s\)"):
            OpenAIGenerator("m", base_url=url, api_key_env=None, timeout=0.5)
        assert time.monotonic() - t0 < 2


class _Hosted(BaseHTTPRequestHandler):
    """What a hosted API says to a request without a key, or at a path it does not serve."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.server.paths.append((self.path, self.headers.get("Authorization")))
        status = 401 if self.path.startswith("/v1/") else 404
        body = json.dumps({"error": {"message": "no key", "type": "invalid_request_error"}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.parametrize("path, status", [("/v1", 401), ("/api", 404)])
def test_an_endpoint_that_answers_with_an_error_is_reachable(path, status, monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hosted)
    server.paths = []
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("RETROSIGHT_HOSTED_KEY", "sk-hosted-secret")
        gen = OpenAIGenerator("m", base_url=f"http://127.0.0.1:{server.server_address[1]}{path}", api_key_env="RETROSIGHT_HOSTED_KEY")
        assert gen.answers == 0
        # One look at /models, without the key: the check needs none.
        assert server.paths == [(f"{path}/models", None)]
    finally:
        server.shutdown()
        server.server_close()


def test_a_double_that_goes_away_mid_call_is_named_and_its_answers_kept(tmp_path):
    """The same on the fault double (fast tier): it answers some requests slowly, then closes."""
    cache = ResponseCache(tmp_path / "responses.sqlite")
    convs = [[{"role": "user", "content": f"question {i}"}] for i in range(30)]
    with running() as double:
        gen = CachedGenerator(OpenAIGenerator("slow", base_url=double.url, api_key_env=None, concurrency=2, timeout=5, max_retries=1), cache)

        def close_after_four():
            while len(cache) < 4:
                time.sleep(0.01)
            double.shutdown()
            double.server_close()  # the port refuses from now on

        closer = threading.Thread(target=close_after_four, daemon=True)
        closer.start()
        t0 = time.monotonic()
        with pytest.raises(BackendUnavailable) as gone:
            gen.generate(convs, SamplingParams(), list(range(30)))
        closer.join(5)
        assert time.monotonic() - t0 < 10
    message = str(gone.value)
    answered = len(cache)
    assert message.startswith(f"openai: the server at {double.url} stopped answering (connection refused after {answered} answers); ")
    not_sent = int(message.split("; ")[-1].split(" of ")[0])
    assert 30 - answered - 2 <= not_sent <= 30 - answered and answered >= 4
