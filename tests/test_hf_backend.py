"""The hf backend: a dialogue continued from its kept keys and values gives what a full encode gives."""
import random
from pathlib import Path

import pytest
import torch

from conftest import save_variant
from models.base import SamplingParams
from models.hf import HFGenerator, sample

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def _conversation(n: int) -> list[dict]:
    return [{"role": "system", "content": "Play twenty questions."}, {"role": "user", "content": "Turn 1 of 20. " * n}]


def test_a_continued_dialogue_matches_a_full_encode(tiny_model_dir):
    gen = HFGenerator(tiny_model_dir, batch_size=8)
    first = [_conversation(n) for n in (1, 3, 2)]
    gen.generate(first, GREEDY, [0, 1, 2])  # replies cut at 6 tokens: kept under prompt + reply tokens
    keys = sorted(gen._kept, key=len)
    assert len(keys) == 3
    extra = gen.tokenizer("<|end|><|user|>Answer: no. Turn 2 of 20.<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
    # Rows of different kept lengths and different new lengths share one batch (padding in both).
    items = [(list(k) + extra[: len(extra) - i], k) for i, k in enumerate(keys)]
    fresh = HFGenerator(tiny_model_dir, batch_size=8, reuse_prefix=False)
    _, _, logits_continued, pos_continued = gen._prefill(items, room=0)
    _, _, logits_full, pos_full = fresh._prefill([(ids, None) for ids, _ in items], room=0)
    assert torch.equal(pos_continued, pos_full)
    torch.testing.assert_close(logits_continued, logits_full, atol=1e-4, rtol=1e-4)
    continued, _ = gen._generate_batch(items, GREEDY, [random.Random(0)] * 3)
    full, _ = fresh._generate_batch([(ids, None) for ids, _ in items], GREEDY, [random.Random(0)] * 3)
    assert continued == full and any(continued)


def test_single_turn_greedy_matches_transformers_generate(tiny_model_dir):
    gen = HFGenerator(tiny_model_dir, batch_size=8)
    convs = [_conversation(n) for n in (1, 4)]
    ours = [c.text for c in gen.generate(convs, GREEDY, [0, 0])]
    tok = gen.tokenizer
    tok.padding_side = "left"
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
    batch = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    out = gen.model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    theirs = [tok.decode(row[batch["input_ids"].shape[1]:], skip_special_tokens=True).strip() for row in out]
    assert ours == theirs


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    rngs = [random.Random(0)]
    draws = [int(sample(logits, SamplingParams(temperature=1.0, top_p=0.7), rngs)) for _ in range(2000)]
    assert set(draws) == {0, 1}
    # Renormalised over the kept set: 0.5 / 0.8 of the draws are token 0.
    assert abs(draws.count(0) / len(draws) - 0.625) < 0.04
    assert int(sample(logits, SamplingParams(temperature=0.0), rngs)) == 0


def test_a_requests_text_does_not_depend_on_its_batch(tiny_model_dir):
    """Per-request seeds: the same request gives the same text alone, in a batch, in any order."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    convs = [_conversation(n) for n in (1, 2, 3, 4)]
    together = HFGenerator(tiny_model_dir, batch_size=8).generate(convs, sampling, [11, 12, 13, 14])
    alone = [HFGenerator(tiny_model_dir, batch_size=8).generate([c], sampling, [s])[0] for c, s in zip(convs, [11, 12, 13, 14])]
    reordered = HFGenerator(tiny_model_dir, batch_size=2).generate(convs[::-1], sampling, [14, 13, 12, 11])[::-1]
    assert together == alone == reordered
    other_seeds = HFGenerator(tiny_model_dir, batch_size=8).generate(convs, sampling, [21, 22, 23, 24])
    assert other_seeds != together


@pytest.fixture(scope="module")
def ending_model_dir(untied_model_dir, tmp_path_factory) -> Path:
    """The untied tiny model with a larger end-of-turn row in its head: its sampled replies end
    after a few tokens or run on, as a trained policy's short questions and long guesses do."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(untied_model_dir)
    model.lm_head.weight.data[model.config.eos_token_id] *= 3.0
    return save_variant(model, untied_model_dir, tmp_path_factory.mktemp("ending") / "model")


def test_finished_rows_leave_the_batch_and_change_no_text_or_kept_state(ending_model_dir):
    """Once half a batch has ended its replies, those rows are dropped from the forward passes:
    the texts are those generated alone, and the dropped rows' kept states continue as a full
    encode does."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=48)
    convs = [_conversation(n) for n in range(1, 13)]
    seeds = list(range(100, 112))
    gen = HFGenerator(ending_model_dir, batch_size=16)
    widths, forward = [], gen.model.forward
    gen.model.forward = lambda *a, **k: widths.append(k["input_ids"].shape[0]) or forward(*a, **k)
    together = gen.generate(convs, sampling, seeds)
    assert widths[0] == 12 and min(widths) <= 6  # half the rows were dropped
    alone = [HFGenerator(ending_model_dir, batch_size=1).generate([c], sampling, [s])[0] for c, s in zip(convs, seeds)]
    assert together == alone
    # Each row's kept keys and values (dropped rows' included) continue as a full encode does.
    extra = gen.tokenizer("<|user|>Answer: no. Turn 2 of 20.<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
    items = [(list(k) + extra, k) for k in gen._kept]
    assert len(items) == 12
    fresh = HFGenerator(ending_model_dir, batch_size=16, reuse_prefix=False)
    continued, _ = gen._generate_batch(items, GREEDY, [random.Random(0)] * 12)
    full, _ = fresh._generate_batch([(ids, None) for ids, _ in items], GREEDY, [random.Random(0)] * 12)
    assert continued == full
