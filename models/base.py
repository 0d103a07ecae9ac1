"""The one generation interface every backend implements: chat requests in, texts out."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

Message = dict[str, str]  # {"role": ..., "content": ...}, the OpenAI/TRL chat format


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64


class Generator(Protocol):
    model_id: str

    def generate(
        self, conversations: list[list[Message]], sampling: SamplingParams, seed: int
    ) -> list[str]:
        """One completion per conversation, in order. Same inputs and seed give the same texts."""
        ...
