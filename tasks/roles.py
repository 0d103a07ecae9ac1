"""Roles on backends: build a role's generator (behind the shared response cache), call it with
parsing and retries, and account for every call.

A role's output that does not parse is sampled again with a new seed, up to `parse_attempts`
in all; a request the backend gave up on is not retried here (the backend has its own retries).
Each request ends as ok, invalid (never parsed) or failed (no text), with its reason, and a
stage fails when more than `max_failure_rate` of its requests did not end ok. A reply whose
parser says the dialogue did not finish (envs.base.Unfinished: a forward model's continuation
that stops short, a labeler's "unfinished") ends as unfinished at once: an answer, not a fault,
so it is neither sampled again nor counted as a failure.
"""
from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Literal, TypeVar

from envs.base import Request, Unfinished
from models.base import Completion, Generator, Message, SamplingParams
from models.cache import CachedGenerator, ResponseCache
from tasks.params import Params, RoleParams
from tasks.rollout import derive_seed

T = TypeVar("T")


class RoleFailure(RuntimeError):
    """A stage's role failed on more requests than its max_failure_rate allows."""


# One vLLM engine per (model, settings) in a process: roles that name the same model share it
# (an engine takes most of a GPU, or a minute to start on CPU). hf models are small here and
# load per stage; their kept keys and values belong to one role's dialogues.
_ENGINES: dict[tuple, Generator] = {}


def make_generator(role: RoleParams, cache_path: str | Path | None, model: str | Path | None = None, batch_size: int | None = None) -> Generator:
    """The role's backend, behind the response cache (None: uncached). `model` overrides the
    role's model (evaluate plays each trained checkpoint with the policy role's backend)."""
    path = str(model or role.model)
    if role.backend == "vllm":
        key = (path, role.dtype, role.gpu_memory_utilization, role.max_model_len, role.tensor_parallel_size, role.kv_cache_memory_bytes, role.enforce_eager)
        if key not in _ENGINES:
            _ENGINES[key] = _backend(role, path, batch_size)
        gen = _ENGINES[key]
    else:
        gen = _backend(role, path, batch_size)
    return CachedGenerator(gen, ResponseCache(cache_path)) if cache_path else gen


def _backend(role: RoleParams, path: str, batch_size: int | None) -> Generator:
    if role.backend == "hf":
        from models.hf import HFGenerator

        gen: Generator = HFGenerator(path, batch_size=batch_size or role.batch_size, dtype=role.dtype)
    elif role.backend == "vllm":
        from models.vllm import VLLMGenerator

        gen = VLLMGenerator(
            path,
            dtype=role.dtype,
            max_model_len=role.max_model_len,
            gpu_memory_utilization=role.gpu_memory_utilization,
            tensor_parallel_size=role.tensor_parallel_size,
            kv_cache_memory_bytes=role.kv_cache_memory_bytes,
            enforce_eager=role.enforce_eager,
        )
    elif role.backend == "openai":
        from models.openai import OpenAIGenerator

        gen = OpenAIGenerator(
            model=path,
            base_url=role.base_url,
            api_key_env=role.api_key_env,
            concurrency=role.concurrency,
            timeout=role.timeout,
            max_retries=role.max_retries,
        )
    else:
        raise ValueError(f"backend {role.backend!r} does not generate text")
    return gen


def check_api_keys(params: Params, roles: Iterable[str]) -> None:
    """Before any work: MissingAPIKey, in one line naming each variable and the role that reads it,
    when one of `roles` is on the openai backend and its api_key_env names a variable not set.
    (The backend says the same when built, but it knows no role's name and a stage meets it late.)"""
    missing = [
        f"roles.{name} reads its API key for {role.base_url} from the environment variable {role.api_key_env}, which is not set: "
        f"export {role.api_key_env}, or name the variable that holds the key in roles.{name}.api_key_env"
        for name in roles
        if (role := getattr(params.roles, name)).backend == "openai" and role.api_key_env and not os.environ.get(role.api_key_env)
    ]
    if missing:
        from models.openai import MissingAPIKey  # here: the SDK is imported only when a key is missing

        raise MissingAPIKey("; ".join(missing))


def role_sampling(role: RoleParams) -> SamplingParams:
    return SamplingParams(**role.sampling.model_dump())


@dataclass(frozen=True)
class Outcome(Generic[T]):
    status: Literal["ok", "invalid", "failed", "unfinished"]
    value: T | None  # the parsed output when ok
    text: str  # the last raw output ("" when the backend gave up)
    attempts: int
    reason: str | None  # why it is not ok


def call_parsed(
    gen: Generator,
    prompts: list[list[Message]],
    seeds: list[int],
    parse: Callable[[str], T] | list[Callable[[str], T]],
    sampling: SamplingParams,
    attempts: int,
) -> list[Outcome[T]]:
    """One outcome per prompt, in order. `parse` (one for all prompts, or one per prompt) raises
    ValueError, with a message saying what is wrong, on output it cannot use."""
    parsers = parse if isinstance(parse, list) else [parse] * len(prompts)
    out: list[Outcome[T] | None] = [None] * len(prompts)
    last: dict[int, tuple[str, str]] = {}
    pending = list(range(len(prompts)))
    for attempt in range(attempts):
        if not pending:
            break
        # Attempt 0 uses the request's own seed, so the first answer is the cached one.
        tries = [seeds[i] if attempt == 0 else derive_seed(seeds[i], "attempt", attempt) for i in pending]
        completions: list[Completion] = gen.generate([prompts[i] for i in pending], sampling, tries)
        still = []
        for i, c in zip(pending, completions, strict=True):
            if not c.ok:
                out[i] = Outcome("failed", None, "", attempt + 1, c.error)
                continue
            try:
                out[i] = Outcome("ok", parsers[i](c.text), c.text, attempt + 1, None)
            except Unfinished as e:
                out[i] = Outcome("unfinished", None, c.text, attempt + 1, str(e))
            except ValueError as e:
                last[i] = (c.text, str(e))
                still.append(i)
        pending = still
    for i in pending:
        text, why = last[i]
        out[i] = Outcome("invalid", None, text, attempts, f"unparseable after {attempts} attempts: {why}")
    return out  # type: ignore[return-value]


def call_requests(gen: Generator, requests: list[Request[T]], seeds: list[int], role: RoleParams) -> list[Outcome[T]]:
    """call_parsed for an environment's role requests, at the role's sampling and attempts."""
    return call_parsed(gen, [r.messages for r in requests], seeds, [r.parse for r in requests], role_sampling(role), role.parse_attempts)


def account(outcomes: list[Outcome], gen: Generator | None = None) -> dict:
    """Counts for a stage's metrics: how the requests ended, attempts, cache hits and misses, and
    the commonest reasons of those that failed, as [count, reason]. Unfinished answers are
    counted (when there are any) and are not failures."""
    n = len(outcomes)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("ok", "invalid", "failed")}
    if unfinished := sum(o.status == "unfinished" for o in outcomes):
        counts["unfinished"] = unfinished
    bad = counts["invalid"] + counts["failed"]
    stats = {"requests": n, **counts, "attempts": sum(o.attempts for o in outcomes), "failure_rate": round(bad / n, 4) if n else 0.0}
    reasons = Counter((o.reason or "")[:REASON_CHARS] for o in outcomes if o.status in ("invalid", "failed"))
    if reasons:
        stats["top_reasons"] = [[count, reason] for reason, count in reasons.most_common(TOP_REASONS)]
    if gen is not None:
        stats.update(generation_stats(gen))
    return stats


def sum_stats(stats: list[dict]) -> dict:
    """Adds up counters key by key (nested dicts too): the accounting of work split among processes."""
    out: dict = {}
    for s in stats:
        for k, v in s.items():
            out[k] = sum_stats([out.get(k, {}), v]) if isinstance(v, dict) else round(out.get(k, 0) + v, 2) if isinstance(v, float) else out.get(k, 0) + v
    return out


TOP_REASONS, REASON_CHARS = 3, 200
# Where a stage keeps each failed request of a role, with its status and reason: a query to paste.
FAILED_ROWS = {
    ("summarize", "summarizer"): "SELECT trajectory_id, status, reason FROM summaries WHERE status <> 'ok'",
    ("relabel", "proposer"): "SELECT trajectory_id, branch_turn, status, reason FROM relabels WHERE status <> 'ok'",
    ("label", "labeler"): "SELECT trajectory_id, status, reason FROM labels WHERE status <> 'ok'",
    ("regenerate", "forward"): "SELECT relabel_id, forward_model, status, reason FROM dropped",
}


def check_failure_rate(stage: str, role_name: str, role: RoleParams, stats: dict, query: str | None = None) -> None:
    """RoleFailure past the role's max_failure_rate, in one line: how many failed, the commonest
    reasons with their counts, and where the failed rows are (`query`: the SQL that lists them,
    for a stage not in FAILED_ROWS)."""
    n, bad = stats["requests"], stats["invalid"] + stats["failed"]
    if not n or stats["failure_rate"] <= role.max_failure_rate:
        return
    top = stats.get("top_reasons", [])
    reasons = "; ".join(f"{count} × {reason}" for count, reason in top)
    if (others := bad - sum(count for count, _ in top)) > 0:
        reasons += f"; {others} for other reasons"
    if query or (stage, role_name) in FAILED_ROWS:
        where = f'the rows: retrosight inspect --sql "{query or FAILED_ROWS[stage, role_name]}"'
    else:  # the simulator: a failed answer is heard as "unknown" in the game
        where = f"the counts are under simulator_calls in data/{stage}/metrics.json"
    raise RoleFailure(
        f"{stage}: the {role_name} role failed on {bad} of {n} requests ({stats['invalid']} unparseable, {stats['failed']} "
        f"with no answer from the backend), over its max_failure_rate {role.max_failure_rate}: {reasons}; {where}"
    )


def policy_generator(params: Params, model: str | Path | None = None, batch_size: int | None = None) -> Generator:
    return make_generator(params.roles.policy, params.cache.path, model, batch_size)


def generation_stats(gen: Generator) -> dict:
    """What a stage reports of its generator: cache hits and misses, and the hf backend's reuse
    of prompt tokens between turns and prompts longer than the model's positions."""
    out = {}
    if isinstance(gen, CachedGenerator):
        out["cache"] = {k: round(v, 2) if isinstance(v, float) else v for k, v in gen.cache_stats.items()}
        gen = gen.inner
    if gen.backend == "hf":
        out["prompt_tokens"] = dict(gen.stats)
    elif hasattr(gen, "stats"):
        out[f"{gen.backend}_stats"] = dict(gen.stats)  # vllm: requests, prompt tokens; openai: attempts, retries
    return out

