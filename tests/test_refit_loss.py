"""Refit/Swift loss on hand-computed examples: weights, masking of non-agent tokens, negative weights."""
import math

import pytest
import torch

from tasks.train.refit import weighted_action_nll
from tasks.train.sft import IGNORE, PadCollator

LOG3 = math.log(3)


def uniform_logits(b: int, t: int, v: int = 3) -> torch.Tensor:
    return torch.zeros(b, t, v, requires_grad=True)  # every token has probability 1/3


def test_weights_scale_each_trajectory_sum_of_agent_nll():
    # Sequence 0 supervises 2 tokens, sequence 1 supervises 1 (labels are shifted by one).
    labels = torch.tensor([[IGNORE, 1, 2, IGNORE], [IGNORE, IGNORE, 0, IGNORE]])
    logits = uniform_logits(2, 4)
    w = torch.tensor([2.0, 1.0])
    # sequences: mean(2 * 2*log3, 1 * 1*log3) = 2.5 log3; tokens: (4 log3 + log3) / 3.
    assert weighted_action_nll(logits, labels, w, "sequences").item() == pytest.approx(2.5 * LOG3)
    assert weighted_action_nll(logits, labels, w, "tokens").item() == pytest.approx(5 * LOG3 / 3)


def test_non_agent_tokens_get_no_gradient():
    labels = torch.tensor([[IGNORE, 1, IGNORE, 2]])
    logits = uniform_logits(1, 4)
    weighted_action_nll(logits, labels, torch.tensor([1.0])).backward()
    grad = logits.grad[0]
    # Position i predicts label i + 1: positions 0 and 2 carry loss, 1 and 3 do not.
    assert grad[0].abs().sum() > 0 and grad[2].abs().sum() > 0
    assert grad[1].abs().sum() == 0 and grad[3].abs().sum() == 0


def test_negative_weight_pushes_likelihood_down():
    labels = torch.tensor([[IGNORE, 1]])
    for sign in (1.0, -1.0):
        logits = uniform_logits(1, 2)
        weighted_action_nll(logits, labels, torch.tensor([sign])).backward()
        # A gradient step (logits -= lr * grad) raises the target logit for w > 0, lowers it for w < 0.
        assert (-logits.grad[0, 0, 1]).sign().item() == sign


def test_push_down_stops_at_the_floor_for_negative_weights_only():
    labels = torch.tensor([[IGNORE, 1, 2], [IGNORE, 1, 2]])
    logits = torch.zeros(2, 3, 3)
    logits[:, 0, 1] = -10.0  # token 1 is already very unlikely (p ~ 2e-5 < 1e-3); token 2 is at 1/3
    logits.requires_grad_(True)
    w = torch.tensor([1.0, -1.0])
    nll_1 = -torch.log_softmax(logits[0, 0].detach(), -1)[1].item()
    loss = weighted_action_nll(logits, labels, w, "sequences", push_down_floor=1e-3)
    # Positive row: full NLL of both tokens. Negative row: the unlikely token counts -log(1e-3), capped.
    assert loss.item() == pytest.approx((1 * (nll_1 + LOG3) - 1 * (-math.log(1e-3) + LOG3)) / 2, rel=1e-5)
    loss.backward()
    assert logits.grad[1, 0].abs().sum() == 0  # nothing left to push down past the floor
    assert logits.grad[0, 0].abs().sum() > 0 and logits.grad[1, 1].abs().sum() > 0


def test_zero_weight_means_no_learning_signal():
    labels = torch.tensor([[IGNORE, 1, 2]])
    logits = uniform_logits(1, 3)
    loss = weighted_action_nll(logits, labels, torch.tensor([0.0]))
    loss.backward()
    assert loss.item() == 0.0 and logits.grad.abs().sum() == 0


def test_collator_carries_weights_and_pads_labels_with_ignore():
    batch = PadCollator(pad_id=0)([
        {"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7], "weight": -0.5},
        {"input_ids": [5], "labels": [IGNORE], "weight": 1.0},
    ])
    assert batch["weight"].tolist() == [-0.5, 1.0]
    assert batch["labels"][1].tolist() == [IGNORE, IGNORE, IGNORE]
    assert batch["attention_mask"][1].tolist() == [1, 0, 0]


def test_unknown_norm_is_refused():
    with pytest.raises(ValueError, match="norm must be"):
        weighted_action_nll(uniform_logits(1, 2), torch.tensor([[IGNORE, 1]]), torch.tensor([1.0]), "mean")


def test_trainer_raises_positive_and_lowers_negative_trajectories():
    """Through the HF Trainer: after training, the w=+1 trajectory is likelier, the w=-1 one less."""
    from models.tiny import make_model, train_tokenizer
    from tasks.train.refit import RewardWeightedTrainer
    from tasks.train.sft import tokenize_chats, train_sft

    def chat(q: str) -> list[dict]:
        return [{"role": "user", "content": "Turn 1 of 20."}, {"role": "assistant", "content": f"REASON: Ask.\nQUESTION: {q}"}]

    good, bad = chat("Is it an animal?"), chat("Is it a fruit?")
    tok = train_tokenizer([m["content"] for c in (good, bad) for m in c] * 10, vocab_size=300)
    torch.manual_seed(0)
    model = make_model(tok, 64, 1, 1, 64, 128, 256)
    examples = tokenize_chats(tok, [good, bad], max_length=256).examples
    collate = PadCollator(tok.pad_token_id)

    def nll(ex: dict) -> float:
        batch = collate([ex])
        with torch.no_grad():
            return weighted_action_nll(model(input_ids=batch["input_ids"]).logits, batch["labels"], torch.ones(1)).item()

    before = [nll(e) for e in examples]
    weighted = [dict(examples[0], weight=1.0), dict(examples[1], weight=-1.0)]
    train_sft(model, tok, weighted, epochs=5, batch_size=2, learning_rate=1e-3, warmup_ratio=0.0,
              weight_decay=0.0, bf16=False, seed=0, trainer_cls=RewardWeightedTrainer)
    after = [nll(e) for e in examples]
    assert after[0] < before[0] and after[1] > before[1]


def _tiny_chats():
    """A tiny tokenizer and model, and conversations whose agent turns differ in length (so the
    per-token and per-trajectory means differ)."""
    from models.tiny import make_model, train_tokenizer

    def chat(*questions: str) -> list[dict]:
        msgs = [{"role": "system", "content": "You play twenty questions."}]
        for i, q in enumerate(questions):
            msgs += [{"role": "user", "content": f"Turn {i + 1} of 20."}, {"role": "assistant", "content": f"REASON: Ask.\nQUESTION: {q}"}]
        return msgs + [{"role": "user", "content": "Answer: no. Game over."}]

    chats = [chat("Is it an animal?"), chat("Is it a fruit?", "Is it red and round and sweet?"), chat("Is it big?", "Is it Apple?", "Is it Pear?")]
    tok = train_tokenizer([m["content"] for c in chats for m in c] * 10, vocab_size=300)
    torch.manual_seed(0)
    return tok, make_model(tok, 64, 1, 1, 64, 128, 256), chats


def test_token_normalised_loss_equals_trl_sft_loss(tmp_path):
    """Weights 1 and norm "tokens": the Refit trainer's loss on a batch is TRL SFTTrainer's
    (assistant_only_loss) on the same conversations, to float tolerance. Differing masks (which
    tokens carry loss) or normalisation (per trajectory instead of per token) break it."""
    import copy

    from datasets import Dataset
    from transformers import TrainingArguments
    from trl import SFTConfig, SFTTrainer

    from tasks.train.refit import RewardWeightedTrainer
    from tasks.train.sft import tokenize_chats

    tok, model, chats = _tiny_chats()
    trl_args = SFTConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(chats), assistant_only_loss=True,
                         gradient_checkpointing=False, bf16=False, use_cpu=True, report_to="none", max_length=256)
    sft = SFTTrainer(model=copy.deepcopy(model), args=trl_args, train_dataset=Dataset.from_list([{"messages": c} for c in chats]),
                     processing_class=tok)
    trl_batch = sft.data_collator([sft.train_dataset[i] for i in range(len(chats))])
    # As the Trainer counts the items of an optimizer step: supervised next-token targets.
    n_items = (trl_batch["labels"][:, 1:] != IGNORE).sum()
    with torch.no_grad():
        trl_loss = sft.compute_loss(sft.model, trl_batch, num_items_in_batch=n_items).item()

    examples = tokenize_chats(tok, chats, max_length=256).examples
    batch = PadCollator(tok.pad_token_id)([dict(ex, weight=1.0) for ex in examples])
    assert torch.equal(batch["labels"], trl_batch["labels"])  # the same loss mask, token for token
    ours = {}
    for norm in ("tokens", "sequences"):
        trainer = RewardWeightedTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / norm), use_cpu=True, report_to="none"), norm=norm)
        with torch.no_grad():
            ours[norm] = trainer.compute_loss(model, dict(batch)).item()
    assert ours["tokens"] == pytest.approx(trl_loss, rel=1e-5, abs=1e-6)
    assert ours["sequences"] != pytest.approx(trl_loss, rel=1e-2)  # the check can tell the normalisations apart


def test_gradient_accumulation_divides_the_micro_batch_loss(tmp_path):
    """compute_loss ignores num_items_in_batch, so each micro-batch's loss is divided by the
    accumulation steps (the Trainer would not do it on its own for a model whose forward takes **kwargs)."""
    from transformers import TrainingArguments

    from tasks.train.refit import RewardWeightedTrainer
    from tasks.train.sft import tokenize_chats

    tok, model, chats = _tiny_chats()
    batch = PadCollator(tok.pad_token_id)([dict(ex, weight=1.0) for ex in tokenize_chats(tok, chats, 256).examples])
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", gradient_accumulation_steps=2)
    trainer = RewardWeightedTrainer(model=model, args=args)
    with torch.no_grad():
        full = trainer.compute_loss(model, dict(batch)).item()
    trainer.current_gradient_accumulation_steps = 2  # as the training loop sets it
    step = trainer.training_step(model, dict(batch), num_items_in_batch=(batch["labels"][:, 1:] != IGNORE).sum()).item()
    assert step == pytest.approx(full / 2, rel=1e-6)


def test_padding_free_batches_give_the_padded_loss_and_gradients():
    """One packed row, attention per sequence: the same loss and gradients as the padded batch,
    with mixed-sign weights, the push-down floor and either norm; the model keeps its attention."""
    import copy

    from tasks.train.sft import PACKED_ATTENTION, tokenize_chats

    tok, model, chats = _tiny_chats()
    examples = [dict(ex, weight=w) for ex, w in zip(tokenize_chats(tok, chats, 256).examples, (1.0, -0.5, 0.25))]
    padded = PadCollator(tok.pad_token_id)(examples)
    packed = PadCollator(tok.pad_token_id, padding_free=True)(examples)
    assert packed["input_ids"].shape == (1, sum(len(e["input_ids"]) for e in examples)) and "attention_mask" not in packed
    packed_model = copy.deepcopy(model)
    packed_model.set_attn_implementation(PACKED_ATTENTION)
    for norm in ("sequences", "tokens"):
        losses, grads = [], []
        for m, batch in ((model, padded), (packed_model, packed)):
            m.zero_grad()
            inputs = {k: v for k, v in batch.items() if k not in ("labels", "weight")}
            loss = weighted_action_nll(m(**inputs).logits, batch["labels"], batch["weight"], norm, 1e-3, batch.get("cu_seq_lens_q"))
            loss.backward()
            losses.append(loss.item())
            grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
        assert losses[1] == pytest.approx(losses[0], rel=1e-5)
        assert torch.allclose(grads[1], grads[0], rtol=1e-4, atol=1e-6)
    assert model.config._attn_implementation != PACKED_ATTENTION


def test_padding_free_training_restores_the_attention_implementation():
    from tasks.train.refit import RewardWeightedTrainer
    from tasks.train.sft import tokenize_chats, train_sft

    tok, model, chats = _tiny_chats()
    before = model.config._attn_implementation
    examples = [dict(ex, weight=1.0) for ex in tokenize_chats(tok, chats, 256).examples]
    curve = train_sft(model, tok, examples, epochs=2, batch_size=3, learning_rate=1e-3, warmup_ratio=0.0, weight_decay=0.0,
                      bf16=False, seed=0, padding_free=True, trainer_cls=RewardWeightedTrainer, norm="tokens")
    assert curve and all(math.isfinite(e["loss"]) for e in curve)
    assert model.config._attn_implementation == before
