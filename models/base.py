"""The one generation interface every backend implements: chat requests in, completions out.

Every request carries its own seed, so a request's text does not depend on what else shares its
batch: a rerun that finds half its requests in the response cache and generates the rest gets
the same texts as a run that generated them all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

Message = dict  # {"role": ..., "content": ...}, the OpenAI/TRL chat format; a tool call and its result add tool_calls, tool_call_id, name


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64


@dataclass(frozen=True)
class Completion:
    """One request's outcome: its text, or why there is none (the backend gave up after its
    retries). A failed request is recorded by the stage that made it, never dropped."""

    text: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class BackendUnavailable(RuntimeError):
    """The backend cannot be reached (an endpoint refused at a stage's start, or a server that
    had answered went away): an expected failure, said in one line naming the server."""


class Generator(Protocol):
    backend: str  # hf | vllm | openai
    model_id: str  # names the weights: the cache key and a row's policy_id

    def generate(self, conversations: list[list[Message]], sampling: SamplingParams, seeds: list[int]) -> list[Completion]:
        """One completion per conversation, in order; the same conversation, sampling and seed
        give the same text."""
        ...
