"""PPO on Monte Carlo returns (tasks/train/ppo_returns.py): the value targets and advantages on
hand-computed batches, the loss on a tiny case, where the token-level value head reads, the train
stage on a tiny model (seeded, the value head fit, toward the better episode), and 2 CPU ranks under
DeepSpeed against one process."""
from __future__ import annotations

import json
import math

import polars as pl
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import CONV
from tasks.params import MethodParams
from tasks.train import grpo, ppo, ppo_returns, run_train
from tasks.train.sft import IGNORE, PadCollator
from test_grpo import LOST, compare_ranks, logps_of, stage_params, training_row, write_training

X = IGNORE


def test_every_token_of_a_turn_targets_the_return_from_that_turn_on():
    # the first label never counts; turn 0 is tokens 5, 6; turn 1 tokens 7, 8, 9
    labels = [4, X, 5, 6, X, X, 7, 8, 9, X]
    assert ppo_returns.turn_of_tokens(labels) == [0, 0, 1, 1, 1]
    assert ppo_returns.value_targets(labels, 2, 0.8, gamma=1.0) == [0.8] * 5  # the default: the sparse reward undiscounted
    assert ppo_returns.value_targets(labels, 2, 0.8, gamma=0.5) == pytest.approx([0.4, 0.4, 0.8, 0.8, 0.8])
    # a conversation cut after its second of 3 turns: its kept turns are still 0 and 1 of 3
    assert ppo_returns.value_targets(labels, 3, 0.8, gamma=0.5) == pytest.approx([0.2, 0.2, 0.4, 0.4, 0.4])


def test_the_targets_follow_the_two_assistant_turns_of_an_episode(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    (ep,), _ = grpo.episodes(tok, pl.DataFrame([training_row("t", "Dog", CONV, 1.0)]), "weight", 1024)
    turns = ppo_returns.turn_of_tokens(ep["labels"])
    scored = [t for t in ep["labels"][1:] if t != IGNORE]
    for k, message in enumerate((CONV[2], CONV[4])):
        assert tok.decode([t for t, turn in zip(scored, turns) if turn == k]) == message["content"] + tok.eos_token
    assert ppo_returns.value_targets(ep["labels"], ep["turns"], 1.0, 0.9) == [0.9 if k == 0 else 1.0 for k in turns]


def test_advantages_are_the_return_minus_the_tokens_value():
    returns, values = torch.tensor([0.5, 0.5, 1.0, 0.0]), torch.tensor([0.2, 0.6, 0.0, 0.0])
    assert ppo.advantages(returns, values, whiten=False).tolist() == pytest.approx([0.3, -0.1, 1.0, 0.0])
    a = [0.3, -0.1, 1.0, 0.0]
    mean = sum(a) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in a) / 4)
    assert ppo.advantages(returns, values, whiten=True).tolist() == pytest.approx([(x - mean) / std for x in a], rel=1e-5)


def test_the_loss_on_a_hand_computed_batch():
    # episode 0: tokens 0 and 1; episode 1: token 2
    rows = torch.tensor([0, 0, 1])
    old = torch.tensor([-1.0, -2.0, -0.5])
    logps = old + torch.tensor([0.1, 0.5, 0.0])
    values = torch.tensor([0.2, 0.4, -0.1])
    returns = torch.tensor([1.0, 1.0, 0.0])
    adv = torch.tensor([0.8, 0.6, 0.1])
    loss, parts = ppo_returns.ppo_returns_loss((logps, rows, values), 2, adv, old, old, returns, clip_epsilon=0.2, kl_coef=0.05, value_coef=0.5)
    # token 1: e^0.5 > 1.2 with A > 0: clipped to 1.2; token 2: ratio 1
    policy = ((-0.8 * math.exp(0.1) - 0.6 * 1.2) / 2 - 0.1) / 2
    k3 = [math.exp(x) - x - 1 for x in (-0.1, -0.5, 0.0)]
    kl = ((k3[0] + k3[1]) / 2 + k3[2]) / 2
    value = 0.5 * ((0.8**2 + 0.6**2) / 2 + 0.1**2) / 2  # per token, a mean over the episode's tokens, then over episodes
    assert parts["policy_loss"] == pytest.approx(policy, rel=1e-6) and parts["kl"] == pytest.approx(kl, rel=1e-5)
    assert parts["value_loss"] == pytest.approx(value, rel=1e-6) and parts["clip_fraction"] == pytest.approx((1 / 2 + 0) / 2)
    assert loss.item() == pytest.approx(policy + 0.05 * kl + 0.5 * value, rel=1e-6)


def test_the_token_level_value_reads_the_body_before_each_action_token(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = ppo.PolicyWithValue(policy, token_level=True)
    torch.manual_seed(0)
    torch.nn.init.normal_(model.value.weight)
    (ep, short), _ = grpo.episodes(tok, pl.DataFrame([training_row("a", "Dog", CONV, 1.0), training_row("b", "Dog", CONV[:3], 0.0)]), "weight", 1024)
    batch = PadCollator(tok.pad_token_id)([{"input_ids": e["input_ids"], "labels": e["labels"]} for e in (ep, short)])
    with torch.no_grad():
        logps, rows, values = model(**batch)
        positions = [i for i, t in enumerate(ep["labels"]) if t != IGNORE]
        assert len(values) == len(logps) == len(positions) + sum(t != IGNORE for t in short["labels"])
        for j in (0, len(positions) // 2, len(positions) - 1):  # V(s, a_<t): the prefix alone, up to the token before
            hidden = policy.model(torch.tensor([ep["input_ids"][: positions[j]]])).last_hidden_state[0, -1]
            assert values[j].item() == pytest.approx(model.value(hidden).item(), abs=1e-5)
    assert rows.tolist() == [0] * len(positions) + [1] * (len(values) - len(positions))


def test_ppo_returns_takes_the_logged_rows_and_its_own_settings_only():
    m = MethodParams(algorithm="ppo_returns", ppo_returns={"gamma": 0.9})
    assert m.data == "logged" and m.ppo_returns.gamma == 0.9 and m.ppo_returns.ppo_epochs == 4 and m.ppo_returns.whiten_advantages
    with pytest.raises(ValueError, match="ppo_returns learns from the policy's own rollouts"):
        MethodParams(algorithm="ppo_returns", data="all")
    with pytest.raises(ValueError, match="ppo_returns settings apply to algorithm ppo_returns only"):
        MethodParams(algorithm="grpo", ppo_returns={})


def test_the_train_stage_fits_the_value_and_moves_the_policy_toward_the_better_episode_seeded(tiny_model_dir, tmp_path):
    table = write_training(tmp_path / "train.parquet", [
        training_row("won", "Dog", CONV, 1.0), training_row("lost", "Dog", LOST, 0.0), training_row("unrated", "Dog", LOST, None),
    ])
    p = stage_params(tiny_model_dir, {"ppo": {"algorithm": "ppo_returns", "ppo_returns": {"gradient_steps": 16}}})
    m = run_train(p, table, tmp_path / "a")["methods"]["ppo"]
    assert (m["rows"], m["no_reward"], m["steps"], m["gamma"]) == (2, 1, 16, 1.0)
    curve = json.loads((tmp_path / "a/loss/ppo.json").read_text())
    assert [c["step"] for c in curve] == list(range(1, 17)) and m["final_loss"] == curve[-1]["loss"]
    # the head starts at 0: every first advantage is the reward, 1 on the won episode's tokens, 0 on the lost one's
    assert 0 < m["mean_advantage"] < 1 and m["final_kl"] > 0
    # V fit to the returns: 0.5 x mean (V - G)^2 from 0.25 (V = 0, G = 1 or 0 a token) down; the
    # first turn, the same in both episodes, keeps a floor
    assert m["final_value_loss"] < 0.19, m
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    gap = [logps_of(d, tok, CONV) - logps_of(d, tok, LOST) for d in (tiny_model_dir, tmp_path / "a/models/ppo")]
    assert gap[1] > gap[0] + 0.1, gap
    run_train(p, table, tmp_path / "b")
    weights = [(tmp_path / d / "models/ppo/model.safetensors").read_bytes() for d in ("a", "b")]
    assert weights[0] == weights[1] != (tiny_model_dir / "model.safetensors").read_bytes()
    # the saved model is the policy alone: the value head is not part of it
    assert not any("value" in k for k in AutoModelForCausalLM.from_pretrained(tmp_path / "a/models/ppo").state_dict())


@pytest.mark.system
def test_ppo_returns_on_two_cpu_ranks_under_deepspeed_matches_one_process(tiny_model_dir, tmp_path):
    compare_ranks(tiny_model_dir, tmp_path, "ppo", {"algorithm": "ppo_returns", "ppo_returns": {"ppo_epochs": 2}},
                  ("first_loss", "final_loss", "final_kl", "final_clip_fraction", "final_value_loss", "mean_advantage"))
