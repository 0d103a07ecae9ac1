"""`hf` backend: transformers in process, batched with left padding.

Multi-turn rollouts call `generate` once per turn with every live dialogue, each one the previous
call's dialogue plus the reply and a new observation. Encoding the whole dialogue again at every
turn made prefill cost grow with the square of the turns (24 s of a 35 s step at turn 18 of
TwentyQuestions, 2 CPU cores). So the generator keeps the attention keys and values of the last
call's dialogues, keyed by their exact tokens, and a dialogue that extends one of them encodes
only its new tokens. A dialogue whose tokens do not extend a kept one (a reply cut at
max_new_tokens, a reply that re-tokenizes differently) is simply encoded in full. (Continuing it
from its prompt's state instead was 10% faster, but a continued encode is not bit-identical to a
full one, and a resumed run, whose earlier turns come from the response cache, encodes in full
where the uninterrupted run continued: the resumed table differed.) Rows that have ended their
reply leave the batch once half of it has (48 TwentyQuestions games of a weak policy, 20 turns at
T = 0.7: 72.4 s before, 55.4 s after, one thread, load 3).
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StaticCache

import models.ilql  # noqa: F401  registers ILQL's model type, so AutoModelForCausalLM plays its extracted policy
from models.base import Completion, Message, SamplingParams


def model_fingerprint(path: str | Path) -> str:
    """Content hash of a model directory's weights: the id of the policy that generated a row."""
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def native_bf16() -> bool:
    """True where bfloat16 runs in hardware: CUDA GPUs that support it, CPUs with AMX or
    AVX512-BF16. Elsewhere PyTorch emulates it, and on an AVX-512 CPU without BF16 it was
    measured 2x slower than float32 for training and 1.3x slower for generation."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(dtype: str) -> str:
    """'auto' is bfloat16 where the hardware runs it natively, float32 elsewhere."""
    if dtype == "auto":
        return "bfloat16" if native_bf16() else "float32"
    return dtype


@dataclass
class _Kept:
    """One dialogue's cached state: per layer (keys, values) of its L tokens, [heads, L, head_dim],
    padding removed, and the position id its next token gets."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    next_pos: int

    @property
    def length(self) -> int:
        return self.kv[0][0].shape[1]


def sample(logits: torch.Tensor, sampling: SamplingParams, rngs: list[random.Random]) -> torch.Tensor:
    """One token per row from [B, V] logits: greedy at temperature 0, else temperature and top-p,
    drawn by inverse CDF with one uniform from each row's own generator (so a row's tokens do not
    depend on the rows beside it)."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p > sampling.top_p  # keeps at least the top token
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(outside, 0.0))
    cdf = probs.cumsum(-1)
    u = torch.tensor([[r.random()] for r in rngs], dtype=cdf.dtype) * cdf[:, -1:]
    # The first token whose CDF exceeds u has positive probability (zeroed tokens add nothing).
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


class HFGenerator:
    streams_results = True  # generate() reports each batch's rows as the batch finishes (on_result)
    backend = "hf"

    def __init__(self, path: str | Path, batch_size: int = 64, dtype: str = "float32", reuse_prefix: bool = True):
        self.path = Path(path)
        if not (self.path / "config.json").exists():
            raise FileNotFoundError(f"{self.path}: not a Hugging Face model directory (no config.json)")
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=getattr(torch, resolve_dtype(dtype))).eval()
        self.batch_size = batch_size
        self.model_id = f"{self.path.name}@{model_fingerprint(self.path)}"
        self.reuse_prefix = reuse_prefix
        self._kept: dict[tuple[int, ...], _Kept] = {}
        # prompts_over_positions: prompts longer than the model's max_position_embeddings, which it
        # reads whole, past the positions it was trained on (a CarDealer dialogue on the tiny model)
        self.stats = {"prompt_tokens": 0, "prompt_tokens_reused": 0, "prompts_over_positions": 0}

    @classmethod
    def in_memory(cls, model, tokenizer, model_id: str, batch_size: int = 64) -> HFGenerator:
        """A generator over a model being trained in this process (NLAC's roles at the current
        weights). It keeps no dialogue's keys and values between calls: the weights change."""
        gen = cls.__new__(cls)
        gen.path, gen.tokenizer, gen.model, gen.batch_size, gen.model_id, gen.reuse_prefix = None, tokenizer, model, batch_size, model_id, False
        gen._kept, gen.stats = {}, {"prompt_tokens": 0, "prompt_tokens_reused": 0, "prompts_over_positions": 0}
        return gen

    def _ids(self, conversation: list[Message], generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=generation_prompt, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _lookup(self, conversation: list[Message], ids: list[int]) -> tuple[int, ...] | None:
        """The kept dialogue this one extends: the previous prompt plus the reply, which is this
        conversation up to its last assistant message."""
        if not self._kept or len(conversation) < 2 or conversation[-2]["role"] != "assistant":
            return None
        key = tuple(self._ids(conversation[:-1], generation_prompt=False))
        return key if key in self._kept and tuple(ids[: len(key)]) == key else None

    @torch.inference_mode()
    def generate(
        self, conversations: list[list[Message]], sampling: SamplingParams, seeds: list[int], on_result: Callable[[int, Completion], None] | None = None
    ) -> list[Completion]:
        """`on_result(i, completion)` is called for each row as its batch finishes, so the response
        cache keeps a finished batch whatever happens to the next."""
        if len(seeds) != len(conversations):
            raise ValueError(f"{len(conversations)} conversations but {len(seeds)} seeds")
        items = []
        for c in conversations:
            ids = self._ids(c, generation_prompt=True)
            key = self._lookup(c, ids) if self.reuse_prefix else None
            items.append((ids, key))
            self.stats["prompt_tokens"] += len(ids)
            self.stats["prompt_tokens_reused"] += len(key) if key else 0
            self.stats["prompts_over_positions"] += len(ids) > self.model.config.max_position_embeddings
        # Dialogues that continue a kept one (a few new tokens each) and dialogues encoded in
        # full never share a batch, and within each, similar lengths do: less padding. The order
        # never changes a text: each row samples from its own seed.
        new_len = [len(ids) - (len(key) if key else 0) for ids, key in items]
        batches = []
        for continued in (True, False):
            group = sorted((i for i in range(len(items)) if (items[i][1] is not None) == continued), key=lambda i: (new_len[i], len(items[i][0]), i))
            batches += [group[s : s + self.batch_size] for s in range(0, len(group), self.batch_size)]
        out: list[str] = [""] * len(items)
        kept: dict[tuple[int, ...], _Kept] = {}
        for idx in batches:
            rngs = [random.Random(seeds[i]) for i in idx]
            texts, states = self._generate_batch([items[i] for i in idx], sampling, rngs)
            for i, text, (tokens, state) in zip(idx, texts, states):
                out[i] = text
                kept[tokens] = state
                if on_result is not None:
                    on_result(i, Completion(text))
        self._kept = kept if self.reuse_prefix else {}
        return [Completion(text) for text in out]

    def _prefill(self, items: list[tuple[list[int], tuple[int, ...] | None]], room: int):
        """Encodes each row's new tokens after its kept state. Returns the cache (with `room`
        free columns), the attention mask, the last position's logits and the next position ids."""
        pad = self.tokenizer.pad_token_id
        prev = [self._kept[key] if key else None for _, key in items]
        new = [ids[len(key) if key else 0 :] for ids, key in items]
        B, W = len(items), max(map(len, new))
        P = max((p.length for p in prev if p is not None), default=0)
        # Past keys and values, left-padded to P; new tokens left-padded to W, so every row's
        # next token lands in the same column. Padding is masked out; position ids skip it. The
        # cache is preallocated: growing it by concatenation copied all of it at every token.
        total = P + W + room
        past = StaticCache(config=self.model.config, max_cache_len=total)
        mask = torch.zeros(B, total, dtype=torch.long)
        input_ids = torch.full((B, W), pad, dtype=torch.long)
        positions = torch.zeros(B, W, dtype=torch.long)
        if P:
            ref = next(p for p in prev if p is not None).kv[0][0]
            shape = (B, ref.shape[0], P, ref.shape[2])
            for layer in range(self.model.config.num_hidden_layers):
                k, v = ref.new_zeros(shape), ref.new_zeros(shape)
                for r, p in enumerate(prev):
                    if p is not None:
                        k[r, :, P - p.length :], v[r, :, P - p.length :] = p.kv[layer]
                past.layers[layer].update(k, v)
            for r, p in enumerate(prev):
                if p is not None:
                    mask[r, P - p.length : P] = 1
        for r, (tokens, p) in enumerate(zip(new, prev)):
            n, start = len(tokens), p.next_pos if p else 0
            input_ids[r, W - n :] = torch.tensor(tokens)
            mask[r, P + W - n : P + W] = 1
            positions[r, W - n :] = torch.arange(start, start + n)
        logits = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True, logits_to_keep=1).logits
        return past, mask, logits, positions[:, -1] + 1

    def _generate_batch(self, items: list[tuple[list[int], tuple[int, ...] | None]], sampling: SamplingParams, rngs: list[random.Random]):
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        past, mask, logits, next_pos = self._prefill(items, sampling.max_new_tokens)
        B, start = len(items), mask.shape[1] - sampling.max_new_tokens
        generated: list[list[int]] = [[] for _ in range(B)]
        states: list[tuple[tuple[int, ...], _Kept] | None] = [None] * B
        rows = torch.arange(B)  # the item each batch row holds
        live = torch.ones(B, dtype=torch.bool)

        def keep(finished: list[int]) -> None:
            """The finished batch rows' states: their dialogue and reply, padding removed."""
            for b in finished:
                r = int(rows[b])
                real = mask[b, : start + len(generated[r])].bool().nonzero().flatten()
                kv = [(layer.keys[b].index_select(1, real), layer.values[b].index_select(1, real)) for layer in past.layers]
                states[r] = (tuple(items[r][0] + generated[r]), _Kept(kv=kv, next_pos=int(next_pos[b])))

        for step in range(sampling.max_new_tokens):
            token = sample(logits[:, -1].float(), sampling, [rngs[r] for r in rows.tolist()]).masked_fill(~live, pad)
            for b in live.nonzero().flatten().tolist():
                generated[int(rows[b])].append(int(token[b]))
            # Every sampled token is fed back, so the kept state covers the reply through its
            # end-of-turn token; rows already finished feed masked padding.
            mask[:, start + step] = live.long()
            logits = self.model(input_ids=token.unsqueeze(1), attention_mask=mask, position_ids=next_pos.unsqueeze(1), past_key_values=past, use_cache=True).logits
            next_pos = next_pos + live.long()
            live &= token != eos
            if not live.any():
                break
            # A few long replies would otherwise keep every finished row in each step's forward
            # pass: once half the rows are done, they are kept and dropped from the batch. A row's
            # tokens come from its own generator, so its text does not depend on this.
            if 2 * int(live.sum()) <= len(rows) and len(rows) >= 8:
                keep((~live).nonzero().flatten().tolist())
                at = live.nonzero().flatten()
                for layer in past.layers:
                    layer.keys, layer.values = layer.keys.index_select(0, at), layer.values.index_select(0, at)
                rows, mask, logits, next_pos, live = rows[at], mask[at], logits[at], next_pos[at], live[at]
        keep(list(range(len(rows))))
        texts = [self.tokenizer.decode(g, skip_special_tokens=True).strip() for g in generated]
        return texts, states
