"""Packed batches (train.padding_free, the default) against padded ones, trainer by trainer: each
trainer's own compute_loss on the same examples gives the same loss and the same gradients, to
float tolerance, whether the batch is one packed row (attention per sequence) or right-padded.
A packed batch that mixed two sequences' attention, counted a sequence's first label, or read a
score or a log-probability at the wrong position fails here."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from tasks.train import online_dpo
from tasks.train.critic import CriticTrainer, load_critic
from tasks.train.refit import RewardWeightedTrainer
from tasks.train.sft import PACKED_ATTENTION, PadCollator, tokenize_chats

STATE = [{"role": "system", "content": "You play twenty questions."}, {"role": "user", "content": "Turn 1 of 20."}]


def chat(*questions: str) -> list[dict]:
    msgs = list(STATE[:1])
    for i, q in enumerate(questions):
        msgs += [{"role": "user", "content": f"Turn {i + 1} of 20."}, {"role": "assistant", "content": f"REASON: Ask.\nQUESTION: {q}"}]
    return msgs + [{"role": "user", "content": "Answer: no. Game over."}]


# agent turns of different lengths and counts, so rows differ in length and padding matters
CHATS = [chat("Is it an animal?"), chat("Is it a fruit?", "Is it red and round and sweet?"), chat("Is it big?", "Is it Apple?", "Is it Pear?")]


def loss_and_grads(trainer_cls, model, collate, examples, tmp_path, **kwargs) -> tuple[float, torch.Tensor]:
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = trainer_cls(model=model, args=args, **kwargs)
    model.zero_grad()
    loss = trainer.compute_loss(model, collate(examples))
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def assert_packed_is_padded(trainer_cls, model, collator_cls, examples, tmp_path, **kwargs):
    pad = model.config.pad_token_id
    packed_model = copy.deepcopy(model)
    packed_model.set_attn_implementation(PACKED_ATTENTION)
    packed = collator_cls(pad, padding_free=True)(examples)
    assert packed["input_ids"].shape[0] == 1 and "attention_mask" not in packed  # one row, no padding
    padded_loss, padded_grads = loss_and_grads(trainer_cls, model, collator_cls(pad), examples, tmp_path / "padded", **kwargs)
    packed_loss, packed_grads = loss_and_grads(trainer_cls, packed_model, collator_cls(pad, padding_free=True), examples, tmp_path / "packed", **kwargs)
    assert packed_loss == pytest.approx(padded_loss, rel=1e-5)
    assert padded_grads.abs().sum() > 0 and torch.allclose(packed_grads, padded_grads, rtol=1e-4, atol=1e-6)


@pytest.fixture
def policy(tiny_model_dir):
    torch.manual_seed(0)
    return AutoTokenizer.from_pretrained(tiny_model_dir), AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def test_sft_rft_and_filtered_bc(policy, tmp_path):
    """The HF Trainer's own causal-LM loss: SFT's, and so RFT's and filtered BC's (SFT on a selection)."""
    tok, model = policy
    examples = tokenize_chats(tok, CHATS, 1024).examples
    assert_packed_is_padded(Trainer, model, PadCollator, examples, tmp_path)


@pytest.mark.parametrize("norm", ["sequences", "tokens"])
def test_refit(policy, tmp_path, norm):
    tok, model = policy
    examples = [dict(ex, weight=w) for ex, w in zip(tokenize_chats(tok, CHATS, 1024).examples, (1.0, 0.5, 0.25))]
    assert_packed_is_padded(RewardWeightedTrainer, model, PadCollator, examples, tmp_path, norm=norm)


def test_swift(policy, tmp_path):
    """Standardized weights of both signs, a below-average trajectory pushed down to the floor."""
    tok, model = policy
    examples = [dict(ex, weight=w) for ex, w in zip(tokenize_chats(tok, CHATS, 1024).examples, (1.2, -0.5, -0.7))]
    assert_packed_is_padded(RewardWeightedTrainer, model, PadCollator, examples, tmp_path, norm="sequences", push_down_floor=1e-3)


def test_dpo_family(policy, tmp_path):
    """DPOTrainer: HOPE's actor, StepAgent-Implicit, ETO and DPO; a batch of pairs is its chosen
    rows then its rejected ones, each pair's log-probabilities against the reference's."""
    tok, model = policy
    actions = ["REASON: Ask.\nQUESTION: Is it an animal?", "REASON: Guess.\nGUESS: Pear", "QUESTION: Is it red and round and sweet?"]
    pairs = [(online_dpo.encode(tok, STATE, {"role": "assistant", "content": a}, 1024)[0],
              online_dpo.encode(tok, STATE[:1] + STATE[1:] * k, {"role": "assistant", "content": b}, 1024)[0])
             for k, (a, b) in enumerate(zip(actions, actions[1:] + actions[:1]), start=1)]
    reference = copy.deepcopy(model)
    with torch.no_grad():  # a reference away from the policy, so the margin and its gradient are not those at zero
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rows = online_dpo.pair_rows(reference, tok, pairs)
    assert_packed_is_padded(online_dpo.DPOTrainer, model, online_dpo.PairCollator, rows, tmp_path, beta=0.1)


def test_dpo_packed_log_probabilities_are_each_sequences(policy):
    tok, model = policy
    encoded = [online_dpo.encode(tok, STATE, {"role": "assistant", "content": a}, 1024)[0] for a in ("QUESTION: Is it big?", "GUESS: Apple")]
    padded, packed = PadCollator(tok.pad_token_id)(encoded), PadCollator(tok.pad_token_id, padding_free=True)(encoded)
    packed_model = copy.deepcopy(model)
    packed_model.set_attn_implementation(PACKED_ATTENTION)
    with torch.no_grad():
        a = online_dpo.sequence_logps(model, padded["input_ids"], padded["attention_mask"], padded["labels"])
        b = online_dpo.sequence_logps(packed_model, packed["input_ids"], None, packed["labels"],
                                      **{k: packed[k] for k in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")})
    assert b.shape == (2,) and torch.allclose(a, b, rtol=1e-5)


def test_critic(tiny_model_dir, tmp_path):
    """HOPE's critic: soft BCE on the scalar head, read at each sequence's last token."""
    torch.manual_seed(0)
    model, tok = load_critic(str(tiny_model_dir), base=True)
    model.score.weight.data.normal_(0, 0.5)  # a head that scores, so its gradient reaches the body
    seqs = [online_dpo.encode(tok, STATE[:1] + STATE[1:] * k, {"role": "assistant", "content": c.strip()}, 1024)[0]["input_ids"]
            for k, c in enumerate(("QUESTION: Is it big?", "GUESS: Apple", "QUESTION: Is it a fruit or a vegetable?"), start=1)]
    rows = [{"input_ids": s, "labels": s, "target": t} for s, t in zip(seqs, (0.9, 0.2, 0.6))]
    assert_packed_is_padded(CriticTrainer, model, PadCollator, rows, tmp_path)
