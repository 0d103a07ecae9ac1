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
