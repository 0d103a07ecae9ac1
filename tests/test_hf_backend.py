"""The hf backend: a dialogue continued from its kept keys and values gives what a full encode gives."""
import torch

from models.base import SamplingParams
from models.hf import HFGenerator, sample

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def _conversation(n: int) -> list[dict]:
    return [{"role": "system", "content": "Play twenty questions."}, {"role": "user", "content": "Turn 1 of 20. " * n}]


def test_a_continued_dialogue_matches_a_full_encode(tiny_model_dir):
    gen = HFGenerator(tiny_model_dir, batch_size=8)
    first = [_conversation(n) for n in (1, 3, 2)]
    gen.generate(first, GREEDY, 0)  # replies cut at 6 tokens: kept under prompt + reply tokens
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
    continued, _ = gen._generate_batch(items, GREEDY, torch.Generator().manual_seed(0))
    full, _ = fresh._generate_batch([(ids, None) for ids, _ in items], GREEDY, torch.Generator().manual_seed(0))
    assert continued == full and any(continued)


def test_single_turn_greedy_matches_transformers_generate(tiny_model_dir):
    gen = HFGenerator(tiny_model_dir, batch_size=8)
    convs = [_conversation(n) for n in (1, 4)]
    ours = gen.generate(convs, GREEDY, 0)
    tok = gen.tokenizer
    tok.padding_side = "left"
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
    batch = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    out = gen.model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    theirs = [tok.decode(row[batch["input_ids"].shape[1]:], skip_special_tokens=True).strip() for row in out]
    assert ours == theirs


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    rng = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, SamplingParams(temperature=1.0, top_p=0.7), rng)) for _ in range(200)}
    assert draws == {0, 1}
    assert int(sample(logits, SamplingParams(temperature=0.0), rng)) == 0
