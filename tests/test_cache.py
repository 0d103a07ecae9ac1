"""The response cache: a finished call is never made twice, failures are not stored, and two
processes writing at once lose nothing."""
import multiprocessing as mp

from models.base import Completion, SamplingParams
from models.cache import CachedGenerator, ResponseCache, request_key
from models.hf import HFGenerator

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=6)


def _convs(n: int) -> list[list[dict]]:
    return [[{"role": "system", "content": "Play."}, {"role": "user", "content": f"Turn {i} of 20."}] for i in range(n)]


class Counting:
    """Counts the requests that reach the real backend."""

    def __init__(self, inner):
        self.inner, self.backend, self.model_id, self.requests = inner, inner.backend, inner.model_id, 0

    def generate(self, convs, sampling, seeds):
        self.requests += len(convs)
        return self.inner.generate(convs, sampling, seeds)


def test_a_rerun_makes_no_backend_call_and_gets_the_same_texts(tiny_model_dir, tmp_path):
    backend = Counting(HFGenerator(tiny_model_dir, batch_size=8))
    cache = ResponseCache(tmp_path / "cache.sqlite")
    gen = CachedGenerator(backend, cache)
    convs, seeds = _convs(4), [1, 2, 3, 4]
    first = gen.generate(convs, SAMPLING, seeds)
    assert backend.requests == 4 and gen.cache_stats["misses"] == 4 and len(cache) == 4

    again = CachedGenerator(backend, ResponseCache(tmp_path / "cache.sqlite"))  # a new run, same file
    assert again.generate(convs, SAMPLING, seeds) == first
    assert backend.requests == 4 and again.cache_stats == {**again.cache_stats, "hits": 4, "misses": 0}

    # Half cached, half new, in a new order: only the new ones are generated, each text the one
    # it would have had anyway (per-request seeds), in the caller's order.
    mixed = again.generate([convs[2], _convs(6)[5], convs[0]], SAMPLING, [3, 9, 1])
    assert backend.requests == 5
    assert mixed[0] == first[2] and mixed[2] == first[0]
    assert mixed[1] == HFGenerator(tiny_model_dir).generate([_convs(6)[5]], SAMPLING, [9])[0]


def test_the_key_covers_model_sampling_seed_and_messages():
    base = request_key("hf", "m@1", SAMPLING, 0, _convs(1)[0])
    assert base == request_key("hf", "m@1", SamplingParams(temperature=1.0, max_new_tokens=6), 0, _convs(1)[0])
    assert len({
        base,
        request_key("vllm", "m@1", SAMPLING, 0, _convs(1)[0]),
        request_key("hf", "m@2", SAMPLING, 0, _convs(1)[0]),
        request_key("hf", "m@1", SamplingParams(temperature=0.5, max_new_tokens=6), 0, _convs(1)[0]),
        request_key("hf", "m@1", SAMPLING, 1, _convs(1)[0]),
        request_key("hf", "m@1", SAMPLING, 0, _convs(2)[1]),
    }) == 6


class FailsOnce:
    """A backend whose first call fails for every request (a hosted API having a bad minute)."""

    backend, model_id = "openai", "flaky"

    def __init__(self):
        self.calls = 0

    def generate(self, convs, sampling, seeds):
        self.calls += 1
        if self.calls == 1:
            return [Completion("", error="HTTP 503 after 4 attempts") for _ in convs]
        return [Completion(f"answer {s}") for s in seeds]


def test_failures_are_returned_and_not_cached(tmp_path):
    backend = FailsOnce()
    gen = CachedGenerator(backend, ResponseCache(tmp_path / "c.sqlite"))
    out = gen.generate(_convs(2), SAMPLING, [5, 6])
    assert [c.ok for c in out] == [False, False] and gen.cache_stats["failures"] == 2
    assert [c.text for c in gen.generate(_convs(2), SAMPLING, [5, 6])] == ["answer 5", "answer 6"]
    assert backend.calls == 2 and gen.cache_stats["hits"] == 0
    gen.generate(_convs(2), SAMPLING, [5, 6])
    assert backend.calls == 2 and gen.cache_stats["hits"] == 2


def _writer(path: str, worker: int) -> None:
    cache = ResponseCache(path)
    for batch in range(20):
        cache.put_many([(f"{worker}-{batch}-{i}", "openai", "m", f"text {worker} {batch} {i}") for i in range(50)])
        cache.get_many([f"{1 - worker}-{batch}-{i}" for i in range(50)])


def test_concurrent_writers_lose_nothing(tmp_path):
    path = str(tmp_path / "shared.sqlite")
    ResponseCache(path)
    procs = [mp.get_context("spawn").Process(target=_writer, args=(path, w)) for w in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    cache = ResponseCache(path)
    assert len(cache) == 2 * 20 * 50
    assert cache.get_many(["1-19-49"]) == {"1-19-49": "text 1 19 49"}
