"""The vllm and openai backends on real components: vLLM's engine in process, a `vllm serve`
subprocess behind the OpenAI SDK, and, for the faults a hosted API can throw at us, a small HTTP
double on loopback."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from fault_double import running
from models.base import Completion, SamplingParams
from models.openai import OpenAIGenerator

BIN = Path(sys.executable).parent
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=8)
KV_CACHE_BYTES = 64 << 20  # on CPU, sized explicitly: the fraction-of-RAM rule counts the whole process
MAX_LEN = 1024  # the tiny model's positions; a role's prompt (rules, a whole game) runs to ~600 tokens


def _conversation(n: int) -> list[dict]:
    return [{"role": "system", "content": "Play twenty questions."}, {"role": "user", "content": "Turn 1 of 20. " * n}]


CONVS = [_conversation(n) for n in (1, 2, 3, 5)]


@pytest.fixture(scope="module")
def model_dir(untied_model_dir) -> Path:
    return untied_model_dir


@pytest.fixture(scope="module")
def vllm_gen(model_dir):
    # The engine in this process: about 10 s to start here, against about 30 s for the default,
    # which spawns an engine process and a worker (it works under pytest too). The server below
    # runs the default.
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from models.vllm import VLLMGenerator

    try:
        yield VLLMGenerator(model_dir, dtype="float32", max_model_len=MAX_LEN, enforce_eager=True, kv_cache_memory_bytes=KV_CACHE_BYTES)
    finally:
        if old is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


# --- vLLM in process -------------------------------------------------------------------------


@pytest.mark.system
def test_vllm_greedy_matches_the_hf_backend(vllm_gen, model_dir):
    from models.hf import HFGenerator

    hf = HFGenerator(model_dir, batch_size=8)
    ours = vllm_gen.generate(CONVS, GREEDY, [0, 1, 2, 3])
    assert all(c.ok for c in ours) and len({c.text for c in ours}) > 1
    assert ours == hf.generate(CONVS, GREEDY, [0, 1, 2, 3])
    assert ours == vllm_gen.generate(CONVS, GREEDY, [7, 7, 7, 7])  # greedy ignores the seed
    assert vllm_gen.backend == "vllm" and vllm_gen.model_id == hf.model_id


@pytest.mark.system
def test_vllm_a_requests_text_does_not_depend_on_its_batch(vllm_gen):
    seeds = [11, 12, 13, 14]
    together = vllm_gen.generate(CONVS, SAMPLED, seeds)
    alone = [vllm_gen.generate([c], SAMPLED, [s])[0] for c, s in zip(CONVS, seeds)]
    reordered = vllm_gen.generate(CONVS[::-1], SAMPLED, seeds[::-1])[::-1]
    assert together == alone == reordered and all(c.ok for c in together)
    assert vllm_gen.generate(CONVS, SAMPLED, [21, 22, 23, 24]) != together
    # The same conversation twice in one batch with two seeds: two draws, each its seed's.
    twice = vllm_gen.generate([CONVS[0], CONVS[0]], SAMPLED, [11, 31])
    assert twice[0] == together[0] and twice[1] != twice[0]


@pytest.mark.system
def test_vllm_a_failing_request_fails_alone(vllm_gen):
    too_long = [{"role": "user", "content": "Turn 1 of 20. " * 600}]  # far past max_model_len
    before = dict(vllm_gen.stats)
    out = vllm_gen.generate([CONVS[0], too_long, CONVS[1]], GREEDY, [0, 0, 0])
    assert not out[1].ok and f"max_model_len is {MAX_LEN}" in out[1].error and out[1].text == ""
    assert [out[0], out[2]] == vllm_gen.generate([CONVS[0], CONVS[1]], GREEDY, [0, 0])
    assert vllm_gen.stats["failures"] - before["failures"] == 1
    with pytest.raises(ValueError, match="2 seeds"):
        vllm_gen.generate(CONVS[:1], GREEDY, [0, 1])


# --- a real OpenAI-compatible server: vLLM's ----------------------------------------------


@pytest.fixture(scope="module")
def vllm_server(model_dir, tmp_path_factory):
    """vLLM's OpenAI-compatible server on the tiny model, on loopback, started with the command
    docs/roles.md gives (tests/vllm_server.py reads it from there)."""
    from vllm_server import serving

    with serving(model_dir, tmp_path_factory.mktemp("vllm-serve") / "serve.log") as server:
        yield server.url


def _settled(completions: list[Completion]) -> list[str]:
    """Texts without a trailing incomplete UTF-8 character: an untrained byte-level model often
    stops mid-character, and the server's incremental detokenizer holds those bytes back where
    a full decode shows U+FFFD."""
    return [c.text.rstrip("\ufffd").strip() for c in completions]


@pytest.mark.system
def test_openai_backend_on_vllm_serve(vllm_server, vllm_gen):
    gen = OpenAIGenerator("tiny", base_url=vllm_server, api_key_env=None, concurrency=4, timeout=60, max_retries=1)
    assert gen.backend == "openai" and gen.model_id == "tiny@127.0.0.1"
    greedy = gen.generate(CONVS, GREEDY, [0, 1, 2, 3])
    assert all(c.ok for c in greedy) and len({c.text for c in greedy}) > 1
    # Same engine, weights and chat template: the offline engine's greedy texts, and with the
    # same seeds its sampled texts too.
    assert _settled(greedy) == _settled(vllm_gen.generate(CONVS, GREEDY, [0, 1, 2, 3]))
    seeds = [11, 12, 13, 14]
    together = gen.generate(CONVS, SAMPLED, seeds)
    assert _settled(together) == _settled(vllm_gen.generate(CONVS, SAMPLED, seeds))
    alone = [gen.generate([c], SAMPLED, [s])[0] for c, s in zip(CONVS, seeds)]
    assert together == alone and all(c.ok for c in together)
    assert gen.generate(CONVS, SAMPLED, [21, 22, 23, 24]) != together
    assert gen.stats == {"requests": 16, "attempts": 16, "retries": 0, "failures": 0}
    # The server's own refusal (an unknown model: 404) is a failed completion, not an exception.
    wrong = OpenAIGenerator("no-such-model", base_url=vllm_server, api_key_env=None, max_retries=1).generate(CONVS[:1], GREEDY, [0])
    assert not wrong[0].ok and "HTTP 404" in wrong[0].error and "after 1 attempt(s)" in wrong[0].error


# --- faults: an HTTP double on loopback -------------------------------------------------------


@pytest.fixture
def double():
    with running() as server:
        yield server


def _gen(double, model: str, **kw) -> OpenAIGenerator:
    return OpenAIGenerator(model, base_url=double.url, api_key_env=None, **{"timeout": 5.0, "max_retries": 2, **kw})


def test_openai_sends_sampling_and_seed_and_keeps_order(double):
    gen = _gen(double, "ok", concurrency=3)
    out = gen.generate(CONVS, SamplingParams(temperature=0.7, max_new_tokens=5), [4, 3, 2, 1])
    assert [c.text for c in out] == [f"seed {s} temperature 0.7 max_tokens 5" for s in (4, 3, 2, 1)]
    assert gen.stats == {"requests": 4, "attempts": 4, "retries": 0, "failures": 0}


@pytest.mark.parametrize("model", ["429-then-ok", "500-then-ok"])
def test_openai_retries_then_recovers(double, model):
    gen = _gen(double, model)
    t0 = time.monotonic()
    [out] = gen.generate(CONVS[:1], GREEDY, [5])
    assert out.ok and out.text.startswith("seed 5")
    assert gen.stats == {"requests": 1, "attempts": 2, "retries": 1, "failures": 0}
    assert time.monotonic() - t0 < 3


def test_openai_exhausted_retries_give_a_failed_completion(double):
    gen = _gen(double, "always-503", max_retries=2)
    t0 = time.monotonic()
    out = gen.generate(CONVS[:2], GREEDY, [0, 1])
    assert time.monotonic() - t0 < 3
    for c in out:
        assert c.text == "" and "HTTP 503" in c.error and "scripted failure 3" in c.error and "after 3 attempt(s)" in c.error
    assert gen.stats == {"requests": 2, "attempts": 6, "retries": 4, "failures": 2}
    # A client error is not retried.
    bad = _gen(double, "bad-request")
    [c] = bad.generate(CONVS[:1], GREEDY, [0])
    assert "HTTP 400" in c.error and "after 1 attempt(s)" in c.error and bad.stats["retries"] == 0


def test_openai_a_hanging_server_times_out(double):
    gen = _gen(double, "hang", timeout=0.3, max_retries=1)
    t0 = time.monotonic()
    [c] = gen.generate(CONVS[:1], GREEDY, [0])
    assert time.monotonic() - t0 < 2.5  # two 0.3 s attempts and one backoff, not the 3 s hang
    assert not c.ok and "timed out" in c.error and "after 2 attempt(s)" in c.error


@pytest.mark.parametrize(
    "model, reason",
    [
        ("truncated", "connection error"),  # read short of Content-Length: retried as a transport fault
        ("malformed", "malformed response: JSONDecodeError"),
        ("empty-body", "malformed response: JSONDecodeError"),
        ("html", "malformed response"),
        ("no-choices", "no choices"),
        ("null-content", "no message content (finish_reason='content_filter')"),
    ],
)
def test_openai_broken_bodies_give_a_failed_completion(double, model, reason):
    gen = _gen(double, model, max_retries=1)
    t0 = time.monotonic()
    [c] = gen.generate(CONVS[:1], GREEDY, [0])
    assert not c.ok and c.text == "" and reason in c.error, c.error
    assert gen.stats["failures"] == 1 and time.monotonic() - t0 < 3


def test_openai_concurrency_is_limited(double):
    gen = _gen(double, "slow", concurrency=2)
    convs = [_conversation(n) for n in range(1, 7)]
    out = gen.generate(convs, GREEDY, list(range(6)))
    assert [c.text for c in out] == [f"seed {s}" for s in range(6)]
    assert double.max_in_flight == 2


def test_openai_a_failure_stays_with_its_request(double):
    gen = _gen(double, "ok", max_retries=1)
    convs = [CONVS[0], [{"role": "user", "content": "[fail]"}], CONVS[1]]
    out = gen.generate(convs, GREEDY, [0, 1, 2])
    assert out[0].text.startswith("seed 0") and out[2].text.startswith("seed 2")
    assert not out[1].ok and "HTTP 503" in out[1].error and "after 2 attempt(s)" in out[1].error
    assert gen.stats == {"requests": 3, "attempts": 4, "retries": 1, "failures": 1}


def test_openai_sends_a_tool_calls_arguments_as_json_text(double):
    """A CarDealer seller's game carries its calls' arguments as objects (chat templates take them
    so); the API takes them as JSON text, and answers 400 otherwise."""
    from envs import registry
    from tasks.rollout import ScriptedAgent, new_episode, play

    env = registry.make("car_dealer", {})
    ep = new_episode(env, env.task("1_Volkswagen_van_65000"), 0)
    play([ep], ScriptedAgent(lambda rng: env.policies({"p_random": 0.15, "p_repeat": 0.1, "p_early_guess": 0.1})["expert"]), 0, "test")
    assert isinstance(ep.messages[2]["tool_calls"][0]["function"]["arguments"], dict)
    [out] = _gen(double, "ok", max_retries=0).generate([ep.messages], GREEDY, [0])
    assert out.ok, out.error
    assert isinstance(ep.messages[2]["tool_calls"][0]["function"]["arguments"], dict)  # the game's messages are left as they were


def test_openai_api_key_comes_from_the_named_variable(double, monkeypatch):
    monkeypatch.delenv("RETROSIGHT_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="RETROSIGHT_TEST_KEY"):
        OpenAIGenerator("ok", base_url=double.url, api_key_env="RETROSIGHT_TEST_KEY")
    monkeypatch.setenv("RETROSIGHT_TEST_KEY", "sk-test-secret")
    gen = OpenAIGenerator("ok", base_url=double.url, api_key_env="RETROSIGHT_TEST_KEY")
    assert gen.generate(CONVS[:1], GREEDY, [0])[0].ok
    assert double.auth == ["Bearer sk-test-secret"]
    assert "sk-test-secret" not in repr(vars(gen))  # the generator keeps only the variable's name
    failing = OpenAIGenerator("always-503", base_url=double.url, api_key_env="RETROSIGHT_TEST_KEY", max_retries=0)
    assert "sk-test-secret" not in failing.generate(CONVS[:1], GREEDY, [0])[0].error


# --- every role on one LLM backend, end to end ---------------------------------------------------


def _run_short_pipeline(params, policy_model, work: Path) -> dict:
    """collect (policy and simulator), summarize, relabel, regenerate (forward model), label:
    every role on the LLM backend."""
    from tasks.collect import run_collect
    from tasks.label import run_label
    from tasks.regenerate import run_regenerate
    from tasks.relabel import run_relabel
    from tasks.summarize import run_summarize

    trajs = work / "collect/trajectories.parquet"
    return {
        "collect": run_collect(params, policy_model, work / "collect"),
        "summarize": run_summarize(params, trajs, work / "summarize"),
        "relabel": run_relabel(params, trajs, work / "summarize/summaries.parquet", work / "relabel"),
        "regenerate": run_regenerate(params, trajs, work / "relabel/relabels.parquet", policy_model, work / "regenerate"),
        "label": run_label(params, [trajs, work / "regenerate/trajectories.parquet"], work / "label"),
    }


def _backend_calls(metrics: dict, what: str = "misses") -> int:
    """Requests that reached the backend (cache misses), over every stage and role; with
    what="failures", those of them that failed (not cached, so sent again next time)."""
    total = 0
    for stage in metrics.values():
        for key in ("cache", "calls", "simulator_calls", "forward_calls"):
            node = stage.get(key)
            if isinstance(node, dict):
                total += node["cache"][what] if "cache" in node else node[what]
    return total


@pytest.mark.system
@pytest.mark.parametrize("backend", ["hf", "vllm", "openai"])
def test_every_role_on_an_llm_backend_end_to_end(backend, model_dir, tmp_path, request):
    """The plumbing, not the text (the model is untrained): every role runs on the backend,
    every request is accounted for, and a second run is served from the cache alone."""
    import pyarrow.parquet as pq

    from conftest import tiny_params
    from tasks.params import Params

    role: dict = {"backend": backend, "model": str(model_dir), "sampling": {"max_new_tokens": 8}, "parse_attempts": 1, "max_failure_rate": 1.0}
    policy_model: str | Path = model_dir
    if backend == "vllm":
        from tasks import roles as roles_module

        role |= {"dtype": "float32", "max_model_len": MAX_LEN, "enforce_eager": True, "kv_cache_memory_bytes": KV_CACHE_BYTES}
        # The roles share the module's engine (tasks.roles keeps one per model and settings in a
        # process) rather than starting a second engine beside it.
        key = (str(model_dir), "float32", 0.5, MAX_LEN, 1, KV_CACHE_BYTES, True)
        roles_module._ENGINES.setdefault(key, request.getfixturevalue("vllm_gen"))
    if backend == "openai":
        role |= {"model": "tiny", "base_url": request.getfixturevalue("vllm_server")}
        policy_model = "tiny"  # the served name stands for the model directory
    roles = {name: dict(role) for name in ("policy", "simulator", "summarizer", "proposer", "forward", "labeler")}
    params = Params.model_validate(tiny_params({
        "env": {"max_turns": 4},
        "roles": roles,
        "collect": {"splits": ["train"], "m": 2, "limit_tasks": 2, "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8}},
        "relabel": {"k": 2, "t": 1, "n": 1, "window": [0.0, 1.0]},
    }))
    first = _run_short_pipeline(params, policy_model, tmp_path / "first")
    assert _backend_calls(first) > 0
    c = first["collect"]
    assert c["trajectories"] == 4 and c["simulator_calls"]["requests"] == round(c["train"]["mean_turns"] * 4)
    s, r = first["summarize"], first["relabel"]
    assert s["trajectories"] == s["calls"]["requests"] == s["summaries"] + s["not_summarized"] == 4
    # The untrained model's text may have no words: such a trajectory gets no summary, and
    # relabel skips it, naming why.
    assert r["calls"]["requests"] == r["timesteps"] == s["summaries"] > 0
    assert r["skipped_no_summary"] == s["not_summarized"]
    assert first["label"]["calls"]["requests"] == first["label"]["labels"] == 4 + first["regenerate"]["regenerations"]
    for name, m in first.items():
        for key in ("calls", "simulator_calls", "forward_calls"):
            if key in m:
                assert m[key]["ok"] + m[key]["invalid"] + m[key]["failed"] == m[key]["requests"], (name, key)

    again = _run_short_pipeline(params, policy_model, tmp_path / "again")
    # Only answers are cached: the second run sends what failed in the first (on the API, where
    # an error reply can happen), and nothing else.
    resent = {name: _backend_calls({name: m}) for name, m in again.items()}
    failed = {name: _backend_calls({name: m}, "failures") for name, m in first.items()}
    assert resent == failed, (resent, failed)
    if backend != "openai":
        assert not any(failed.values())
    for table in ("collect/trajectories", "summarize/summaries", "relabel/relabels", "regenerate/trajectories", "label/labels"):
        assert pq.read_table(tmp_path / "first" / f"{table}.parquet").equals(pq.read_table(tmp_path / "again" / f"{table}.parquet")), table
