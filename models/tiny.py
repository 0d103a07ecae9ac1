"""The embedded default model: a BPE tokenizer and a small Llama trained from scratch.

No pretrained weights can be downloaded on a fresh CPU machine, so the bootstrap stage builds
its own. The chat template marks assistant turns with {% generation %} so that
`return_assistant_tokens_mask` yields the training mask (checked loudly in tasks/sft.py).
"""
from __future__ import annotations

import random
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, END = "<|pad|>", "<|end|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [PAD, END, *ROLE_TOKENS.values()]
IGNORE = -100  # no loss at this position (the HF convention)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{% else %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, split_digits: bool = False) -> PreTrainedTokenizerFast:
    """Byte-level BPE, so any text (an unseen object name, a user's log) still encodes.

    split_digits: every digit its own token, as Llama's and Qwen's tokenizers have it. Merged,
    "$57000" in a tool's result and " 57000" in the reply that copies it are unrelated tokens
    the model must pair one price at a time; split, the copy is the same digits in order."""
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]) if split_digits else byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=END,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS.values()),
        chat_template=CHAT_TEMPLATE,
        padding_side="left",  # generation appends on the right
        model_max_length=4096,
    )


def make_model(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    intermediate_size: int,
    max_length: int,
) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=head_dim,
        max_position_embeddings=max_length,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def copy_drills(tokenizer: PreTrainedTokenizerFast, n: int, length: int, seed: int) -> list[dict]:
    """n sequences that teach copying from the context, as pretraining teaches an LLM: random
    tokens of the vocabulary in which a span comes again after a gap of any length, the loss on
    the copy only. The varying gap is what makes it induction (find where the current token was
    before, write what followed it) rather than "copy from k tokens back". A tiny model trained
    from scratch on a few thousand dialogues never learns to copy (docs/environments.md,
    CarDealer). Each sequence is at most `length` tokens; the same seed gives the same drills."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    examples = []
    for _ in range(n):
        span = rng.choices(vocab, k=rng.randint(8, length // 3))
        gap = rng.choices(vocab, k=rng.randint(0, length - 2 * len(span)))
        ids = span + gap + span
        # the copy's first token cannot be foreseen; the rest can
        examples.append({"input_ids": ids, "labels": [IGNORE] * (len(span) + len(gap) + 1) + span[1:]})
    return examples
