"""`openai` backend: any OpenAI-compatible chat endpoint (a hosted API, `vllm serve`, ...).

Requests go out concurrently up to a limit, each with its own seed and timeout. Retries are the
official SDK's: exponential backoff with jitter (0.5 s doubling, at most 8 s), or the server's
Retry-After when it sends one, on 408/409/429, 5xx, timeouts and connection errors. Every
attempt is counted (an httpx hook sees each one the SDK sends), so a failed Completion says how
many attempts it took and what the last one got.

A server that cannot be reached is not a per-request fault: the endpoint is checked when the
generator is built (one GET of /models; any HTTP answer, a 401 or 404 included, means someone
is there), and a request refused a connection after that (the server went away) stops the call
once it has run out of retries: the requests not yet sent are not sent, and BackendUnavailable
names the server. Answers received until then have already been handed to `on_result`.

The API key is read from the environment variable that `api_key_env` names, handed to the SDK
client and kept nowhere else. Servers echo the key they were sent in their errors ("Incorrect API
key provided: sk-..."), and an error becomes a row's reason in a stage's table, so every error
is redacted before it leaves this module.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
import contextvars
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import openai

from models.base import BackendUnavailable, Completion, Message, SamplingParams

PREFLIGHT_TIMEOUT = 10.0  # seconds for the reachability check, at most (the role's timeout if shorter)

# Attempts made for the request in flight: the hook below runs in the task that sent it.
_attempts: contextvars.ContextVar[list[int]] = contextvars.ContextVar("attempts")


async def _count_attempt(request: httpx.Request) -> None:
    counter = _attempts.get(None)
    if counter is not None:
        counter[0] += 1


class MissingAPIKey(ValueError):
    """The variable a role's `api_key_env` names is not set: an expected failure, said in one line
    naming the variable (and, where the role is known, the role: tasks.roles.check_api_keys)."""


class OpenAIGenerator:
    backend = "openai"
    streams_results = True  # generate() reports each answer as it arrives (on_result)

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        api_key_env: str | None = "OPENAI_API_KEY",
        concurrency: int = 8,
        timeout: float = 60.0,
        max_retries: int = 4,
    ):
        """`model` is the served model name. `api_key_env` names the variable holding the key;
        None for a local server that needs none. `timeout` bounds each attempt (seconds),
        `max_retries` the attempts after the first."""
        self.model = model
        self.base_url = base_url
        if api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", api_key_env):
            # Said without the value: it may be the key itself, pasted where its variable's name belongs.
            raise ValueError("api_key_env must be the name of an environment variable (letters, digits, _), not the key itself")
        self.api_key_env = api_key_env
        self._api_key()  # a missing key is a setup error: said now, not once per request
        self.model_id = f"{model}@{urlparse(base_url).hostname if base_url else 'api.openai.com'}"
        self.concurrency, self.timeout, self.max_retries = concurrency, timeout, max_retries
        self.stats = {"requests": 0, "attempts": 0, "retries": 0, "failures": 0}
        self.answers = 0  # requests the server answered (any HTTP status), over this generator's life
        self._check_reachable()

    @property
    def url(self) -> str:
        """The endpoint requests go to (the SDK's own default when base_url is None)."""
        return self.base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1"

    def _check_reachable(self) -> None:
        """Refuse an endpoint nobody answers at, before a stage sends anything. No key is sent:
        a hosted API's 401 says it is there just as well."""
        timeout = min(self.timeout, PREFLIGHT_TIMEOUT)
        try:
            httpx.get(f"{self.url.rstrip('/')}/models", timeout=timeout)
        except httpx.TimeoutException:
            raise BackendUnavailable(f"openai: cannot reach {self.url} (no answer within {timeout:g} s); nothing was sent") from None
        except httpx.TransportError as e:
            raise BackendUnavailable(f"openai: cannot reach {self.url} ({_transport_reason(e)}); nothing was sent") from None

    def _api_key(self) -> str:
        if self.api_key_env is None:
            return "unused"  # the SDK insists on a key; a server that checks none ignores it
        key = os.environ.get(self.api_key_env)
        if not key:
            raise MissingAPIKey(f"environment variable {self.api_key_env} is not set: it must hold the API key for {self.base_url or 'the OpenAI API'}")
        return key

    def generate(
        self, conversations: list[list[Message]], sampling: SamplingParams, seeds: list[int], on_result: Callable[[int, Completion], None] | None = None
    ) -> list[Completion]:
        """`on_result(i, completion)` is called as each request ends, so the response cache can
        keep an answer the moment it is paid for, whatever happens to the rest of the batch."""
        if len(seeds) != len(conversations):
            raise ValueError(f"{len(conversations)} conversations but {len(seeds)} seeds")
        coro = self._generate_all(conversations, sampling, seeds, on_result)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coro)
        # Called from inside an event loop (an async caller): run ours on a thread of its own.
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, coro).result()

    async def _generate_all(self, conversations, sampling, seeds, on_result) -> list[Completion]:
        # A client per call: its connection pool belongs to this call's event loop.
        http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [_count_attempt]})
        key = self._api_key()
        secret = key if self.api_key_env is not None else None
        call = _Call()
        async with openai.AsyncOpenAI(api_key=key, base_url=self.base_url, timeout=self.timeout, max_retries=self.max_retries, http_client=http) as client:
            limit = asyncio.Semaphore(self.concurrency)
            out = list(await asyncio.gather(*(self._one(client, limit, call, c, sampling, s, secret, i, on_result) for i, (c, s) in enumerate(zip(conversations, seeds)))))
        if call.gone is not None:
            raise BackendUnavailable(
                f"openai: the server at {self.url} stopped answering ({call.gone} after {self.answers} answers); "
                f"{call.not_sent} of {len(conversations)} requests not sent"
            )
        return out

    async def _one(self, client: openai.AsyncOpenAI, limit: asyncio.Semaphore, call: _Call, conversation, sampling: SamplingParams, seed: int, secret: str | None, index: int, on_result) -> Completion:
        async with limit:
            if call.gone is not None:
                call.not_sent += 1
                return Completion("", error="openai: not sent (the server stopped answering)")
            counter = [0]
            _attempts.set(counter)  # this task's own context: gather runs each request in a task
            try:
                response = await client.chat.completions.create(
                    model=self.model,
                    messages=[wire_message(m) for m in conversation],
                    seed=seed,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    max_tokens=sampling.max_new_tokens,
                )
                self.answers += 1
                completion = _parse(response)
            except openai.APIStatusError as e:
                self.answers += 1
                completion = Completion("", error=f"openai: HTTP {e.status_code} {type(e).__name__}: {e.message}")
            except openai.APITimeoutError:
                completion = Completion("", error=f"openai: timed out (no response within {self.timeout} s)")
            except openai.APIConnectionError as e:
                cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
                completion = Completion("", error=f"openai: connection error{cause}")
                # Refused (or otherwise not connected) through every retry, after the endpoint had
                # answered: the server is gone, and every request still to send would only repeat this.
                if isinstance(e.__cause__, httpx.ConnectError) and call.gone is None:
                    call.gone = _transport_reason(e.__cause__)
            except (ValueError, AttributeError, TypeError, KeyError) as e:  # a body that is not JSON, or not a chat completion
                completion = Completion("", error=f"openai: malformed response: {type(e).__name__}: {e}")
            except Exception as e:
                completion = Completion("", error=f"openai: {type(e).__name__}: {e}")
            if not completion.ok:
                completion = Completion("", error=f"{redact(completion.error, secret)} [after {counter[0]} attempt(s)]")
            self.stats["requests"] += 1
            self.stats["attempts"] += counter[0]
            self.stats["retries"] += max(counter[0] - 1, 0)
            self.stats["failures"] += not completion.ok
            if on_result is not None:
                on_result(index, completion)
            return completion


class _Call:
    """One generate() call's view of the server: why it went away (None while it answers), and
    how many requests were then left unsent."""

    def __init__(self) -> None:
        self.gone: str | None = None
        self.not_sent = 0


def _transport_reason(e: BaseException) -> str:
    # The async transport's message is "All connection attempts failed"; the refusal is below it.
    cause, seen = e, set()
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def redact(text: str, secret: str | None) -> str:
    """`text` with the key taken out: whole, and any stretch of 8 or more of its characters, which
    is what survives of it in a partly masked echo such as "sk-abc123**********wxyz"."""
    if not secret:
        return text
    text = text.replace(secret, "[redacted]")
    return re.sub(r"[A-Za-z0-9_\-]{8,}", lambda m: "[redacted]" if m.group() in secret else m.group(), text)


def wire_message(message: Message) -> Message:
    """A chat message as the API takes it: a tool call's `arguments` is the JSON object as text.
    Messages carry it as the object itself, as transformers' chat templates take it."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {**message, "tool_calls": [
        {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False)}}
        if not isinstance(c["function"]["arguments"], str) else c
        for c in calls
    ]}


def _parse(response) -> Completion:
    """The reply's text, or why a 200 carried none (no choices, no message content)."""
    if not getattr(response, "choices", None):
        return Completion("", error=f"openai: malformed response: no choices in {str(response)[:200]!r}")
    choice = response.choices[0]
    content = choice.message.content
    if not isinstance(content, str):
        return Completion("", error=f"openai: no message content (finish_reason={choice.finish_reason!r})")
    return Completion(content.strip())
