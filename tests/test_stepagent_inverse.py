"""StepAgent-Inverse (tasks/train/discriminator.py, ppo.py, stepagent_inverse.py; tasks/stepagent.py's
`inverse` variant): the discriminator's labels and loss and PPO's rewards, advantages, clipped
objective and KL on hand-computed batches; the action's log-probabilities and V(s) where they are
read; the stage on a hand-made practice table; and the stage on 2 CPU ranks under DeepSpeed."""
from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import ROOT, tiny_params
from test_stepagent import GAME, WRONG, pairs_table, params, practice_row
from tasks.params import Params
from tasks.stepagent import run_stepagent
from tasks.train import critic, discriminator, online_dpo, ppo, stepagent_implicit, stepagent_inverse
from tasks.train.sft import IGNORE, PadCollator


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# ---- the discriminator ------------------------------------------------------------------------


def test_the_discriminator_labels_the_experts_steps_1_and_the_agents_0_and_its_loss_is_the_hand_computed_bce():
    pairs = [{"expert": [1, 2, 3], "agent": {"input_ids": [1, 2, 4], "labels": [IGNORE, IGNORE, 4]}, "old": [-1.0]},
             {"expert": [5, 6], "agent": {"input_ids": [5, 7, 8], "labels": [IGNORE, 7, 8]}, "old": [-1.0, -2.0]}]
    rows, labels = discriminator.labelled(pairs)
    assert [r["input_ids"] for r in rows] == [[1, 2, 3], [5, 6], [1, 2, 4], [5, 7, 8]] and labels.tolist() == [1, 1, 0, 0]
    scores = torch.tensor([2.0, -0.5, -1.0, 0.3])  # D = sigmoid(score)
    loss, accuracy = discriminator.loss(scores, labels)
    # - log D on the expert's two, - log(1 - D) on the agent's two
    expected = -(math.log(sigmoid(2.0)) + math.log(sigmoid(-0.5)) + math.log(1 - sigmoid(-1.0)) + math.log(1 - sigmoid(0.3))) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert accuracy == 0.5  # D > 0.5 on the first expert's (right), < 0.5 on the second (wrong); agent: right, wrong


# ---- PPO on hand-computed batches -------------------------------------------------------------


def test_the_reward_is_log_d_no_lower_than_the_floor():
    got = ppo.rewards(torch.tensor([0.5, 1e-4, 1.0, 0.0]), floor=-5.0)
    assert got.tolist() == pytest.approx([math.log(0.5), -5.0, 0.0, -5.0])


def test_advantages_are_r_minus_v_whitened_over_the_batch():
    r, v = torch.tensor([-0.5, -2.0, -1.0]), torch.tensor([-1.0, -1.0, -0.5])
    assert ppo.advantages(r, v, whiten=False).tolist() == pytest.approx([0.5, -1.0, -0.5])
    # A = (0.5, -1, -0.5): mean -1/3, deviations (5/6, -2/3, -1/6), population variance 7/18
    std = math.sqrt(7 / 18)
    assert ppo.advantages(r, v, whiten=True).tolist() == pytest.approx([5 / 6 / std, -2 / 3 / std, -1 / 6 / std], rel=1e-5)
    assert ppo.advantages(torch.tensor([-0.7]), torch.tensor([0.0]), whiten=True).tolist() == [0.0]  # one action: nothing to prefer


def test_the_clipped_objective_the_kl_and_the_value_loss_on_a_hand_computed_batch():
    # two actions: tokens 0 and 1 are the first's, token 2 the second's
    rows = torch.tensor([0, 0, 1])
    old = torch.tensor([-1.0, -2.0, -0.5])
    logps = (old + torch.tensor([0.1, 0.5, -0.5])).requires_grad_()
    adv, values, returns = torch.tensor([1.0, -2.0]), torch.tensor([-0.5, -1.0]), torch.tensor([-0.2, -3.0])
    loss, parts = ppo.ppo_loss(logps, rows, old, old, adv, values, returns, clip_epsilon=0.2, kl_coef=0.05, value_coef=0.1)
    # token 0: ratio e^0.1 inside [0.8, 1.2]: -A ratio; token 1: e^0.5 with A > 0, clipped to 1.2;
    # token 2: e^-0.5 with A < 0, clipped to 0.8: max(2 e^-0.5, 2 x 0.8) = 1.6
    first = (-math.exp(0.1) - 1.2) / 2
    policy = (first + 1.6) / 2
    k3 = [math.exp(x) - x - 1 for x in (-0.1, -0.5, 0.5)]  # log ref/pi = old - logps
    kl = ((k3[0] + k3[1]) / 2 + k3[2]) / 2
    value = 0.5 * ((-0.5 + 0.2) ** 2 + (-1.0 + 3.0) ** 2) / 2
    assert parts["policy_loss"] == pytest.approx(policy, rel=1e-6)
    assert parts["kl"] == pytest.approx(kl, rel=1e-5)
    assert parts["value_loss"] == pytest.approx(value, rel=1e-6)
    assert parts["clip_fraction"] == pytest.approx((1 / 2 + 1) / 2)
    assert loss.item() == pytest.approx(policy + 0.05 * kl + 0.1 * value, rel=1e-6)
    # the clipped tokens carry no gradient; the unclipped one -A ratio / (2 tokens x 2 actions)
    policy_only, _ = ppo.ppo_loss(logps, rows, old, old, adv, values, returns, clip_epsilon=0.2, kl_coef=0.0, value_coef=0.0)
    policy_only.backward()
    assert logps.grad.tolist() == pytest.approx([-math.exp(0.1) / 4, 0.0, 0.0], abs=1e-7)


def test_the_actions_log_probabilities_and_v_of_the_state_are_read_where_they_belong(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = ppo.PolicyWithValue(policy)
    assert model.value(torch.ones(1, policy.config.hidden_size)).item() == 0.0  # V starts at 0
    torch.manual_seed(0)
    torch.nn.init.normal_(model.value.weight)
    encoded = [online_dpo.encode(tok, GAME[:2], GAME[2], 1024)[0], online_dpo.encode(tok, GAME[:4], WRONG, 1024)[0]]
    batch = PadCollator(tok.pad_token_id)(encoded)
    with torch.no_grad():
        logps, rows, values = model(**batch)
        sums = online_dpo.sequence_logps(policy, batch["input_ids"], batch["attention_mask"], batch["labels"])
        for j, (prompt, enc) in enumerate(zip((GAME[:2], GAME[:4]), encoded)):
            # V(s) is the head on the body's last hidden state of the state alone (the generation prompt)
            state = tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
            hidden = policy.model(torch.tensor([list(state)])).last_hidden_state[0, -1]
            assert values[j].item() == pytest.approx(model.value(hidden).item(), abs=1e-5)
            assert (rows == j).sum().item() == sum(t != IGNORE for t in enc["labels"])
    assert torch.allclose(torch.zeros(2).index_add(0, rows, logps), sums, atol=1e-5)
    old = ppo.behaviour_logps(policy, tok, encoded)
    assert [len(o) for o in old] == [(rows == j).sum().item() for j in range(2)]
    assert [sum(o) for o in old] == pytest.approx(sums.tolist(), abs=1e-4)


def test_global_batches_cover_every_row_and_pad_to_a_multiple_of_the_ranks():
    plan = stepagent_inverse.batches(5, 2, 2, 1, seed=0)  # batches of 2 ranks x 2 rows
    assert [len(b) for b in plan] == [4, 2] and sorted(plan[0] + plan[1][:1]) == list(range(5))
    assert plan[1] == [plan[1][0]] * 2  # one row left: repeated for the other rank
    two = stepagent_inverse.batches(5, 2, 2, 2, seed=0)
    assert len(two) == 4 and two[:2] == plan and two[2:] != plan
    assert len(stepagent_inverse.batches(8, 4, 1, 0.5, seed=0)) == 1


def test_the_zero_config_is_filled_as_the_hf_trainer_fills_it(tmp_path):
    cfg = stepagent_inverse.zero_config(str(ROOT / "tasks/train/deepspeed_zero3.json"), hidden=64, micro_batch=4, bf16=False)
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["train_batch_size"] == 4 and cfg["gradient_accumulation_steps"] == 1
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 64 * 64 and cfg["bf16"]["enabled"] is False
    assert "auto" not in json.dumps(cfg)
    (tmp_path / "odd.json").write_text(json.dumps({"optimizer": {"params": {"lr": "auto"}}}))
    with pytest.raises(ValueError, match="optimizer.params.lr is 'auto'"):
        stepagent_inverse.zero_config(str(tmp_path / "odd.json"), 64, 4, False)


# ---- the stage --------------------------------------------------------------------------------


def inverse_params(model_dir, **overrides) -> Params:
    return params({"stepagent": {"variant": "inverse", "base_model": str(model_dir), "bf16": False, **overrides}})


def hand_table(path):
    """At each of the 3 states: 2 samples of a wrong action, 1 equal to the expert's; and 1 failed."""
    rows = [practice_row(GAME[: 2 * s + 2], GAME[2 * s + 2], WRONG, step=s, sample=j) for s in range(3) for j in range(2)]
    rows += [practice_row(GAME[: 2 * s + 2], GAME[2 * s + 2], GAME[2 * s + 2], step=s, sample=2, equal=True) for s in range(3)]
    rows += [practice_row(GAME[:2], GAME[2], None, sample=3)]
    return pairs_table(path, rows), rows


def test_the_stage_learns_a_discriminator_and_moves_the_policy_toward_the_experts_action(tiny_model_dir, tmp_path):
    table, rows = hand_table(tmp_path / "pairs.parquet")
    p = inverse_params(tiny_model_dir, epochs=20, batch_size=3, learning_rate=1e-3, discriminator_learning_rate=3e-3)
    m = run_stepagent(p, table, tmp_path / "out")
    assert (m["variant"], m["pairs"], m["equal_kept"], m["failed_dropped"], m["quarantined"]) == ("inverse", 9, 3, 1, 0)
    assert m["ppo_epochs"] == 4 and m["clip_epsilon"] == 0.2 and m["reward_floor"] == -5.0 and "beta" not in m
    curve = json.loads((tmp_path / "out/loss.json").read_text())
    assert [c["step"] for c in curve] == list(range(1, 20 * 3 + 1))
    assert set(curve[0]) == {"step", "loss", "accuracy", "reward", "kl", "policy_loss", "value_loss", "clip_fraction"}
    # a new head reads both classes alike at first (log 2); the discriminator then tells them apart
    # (a batch's floor depends on its rows: an agent sample equal to the expert's is labelled both ways)
    first, last = (sum(c["loss"] for c in part) / len(part) for part in (curve[:15], curve[-15:]))
    assert curve[0]["loss"] == pytest.approx(math.log(2), abs=0.05) and last < 0.75 * first
    assert curve[-1]["kl"] > 0 and m["final_loss"] == curve[-1]["loss"] and m["final_kl"] == curve[-1]["kl"]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    states = [(GAME[: 2 * s + 2], GAME[2 * s + 2]) for s in range(3)]
    # the discriminator, written beside the policy, scores the expert's action above the agent's wrong one
    judge = critic.scorer(str(tmp_path / "out/discriminator"))
    d = judge([(s, a) for s, expert in states for a in (expert, WRONG)])
    assert all(d[2 * i] > d[2 * i + 1] for i in range(3)), d
    # the policy, rewarded with log D, gained on the expert's action over the wrong one against pi_ref
    encoded, _, _ = stepagent_implicit.encode(tok, [practice_row(s, a, WRONG) for s, a in states], 1024)
    batch = PadCollator(tok.pad_token_id)([e for pair in encoded for e in pair])
    trained, reference = (AutoModelForCausalLM.from_pretrained(x) for x in (tmp_path / "out/model", tiny_model_dir))
    with torch.no_grad():
        pi, ref = (online_dpo.sequence_logps(x, batch["input_ids"], batch["attention_mask"], batch["labels"]) for x in (trained, reference))
    assert ((pi - ref)[0::2] > (pi - ref)[1::2]).all(), (pi - ref).tolist()
    # seeded: a rerun trains the same weights
    short = inverse_params(tiny_model_dir, epochs=1, batch_size=3, learning_rate=1e-3)
    for again in ("a", "b"):
        run_stepagent(short, table, tmp_path / again)
    for part in ("model/model.safetensors", "discriminator/model.safetensors"):
        assert (tmp_path / "a" / part).read_bytes() == (tmp_path / "b" / part).read_bytes()


def test_with_every_sample_failed_the_policy_is_the_base_and_the_discriminator_says_it_is_untrained(tiny_model_dir, tmp_path):
    pairs_table(tmp_path / "pairs.parquet", [practice_row(GAME[:2], GAME[2], None)])
    m = run_stepagent(inverse_params(tiny_model_dir), tmp_path / "pairs.parquet", tmp_path / "out")
    assert m["pairs"] == 0 and m["untrained"].startswith("no pair to learn from") and json.loads((tmp_path / "out/loss.json").read_text()) == []
    assert critic.untrained(tmp_path / "out/discriminator").endswith("the discriminator's head is untrained")
    base, kept = (AutoModelForCausalLM.from_pretrained(d).state_dict() for d in (tiny_model_dir, tmp_path / "out/model"))
    assert all(torch.equal(base[k], kept[k]) for k in base)


def test_the_inverse_knobs_are_checked():
    assert Params.model_validate(tiny_params({"stepagent": {"variant": "inverse"}})).stepagent.variant == "inverse"
    for knob, bad in (("clip_epsilon", 1.5), ("reward_floor", 0.0), ("ppo_epochs", 0)):
        with pytest.raises(ValueError, match=f"stepagent.{knob}"):
            Params.model_validate(tiny_params({"stepagent": {"variant": "inverse", knob: bad}}))


# ---- on ranks ---------------------------------------------------------------------------------


@pytest.mark.system
def test_the_inverse_stage_on_two_cpu_ranks_under_deepspeed_matches_one_process(tiny_model_dir, tmp_path):
    table, _ = hand_table(tmp_path / "pairs.parquet")  # 9 pairs: global batches of 4, 4 and 1 (padded to 2 on ranks)

    def p(nproc: int, batch_size: int) -> Params:
        # the default learning rates: at 3e-3 Adam's first steps blew float noise in the ranks' gradient sums up to 1e-3 of drift
        return inverse_params(tiny_model_dir, epochs=1, batch_size=batch_size, nproc_per_node=nproc, deepspeed=str(ROOT / "tasks/train/deepspeed_zero3.json"))

    two = run_stepagent(p(2, 2), table, tmp_path / "two")
    one = run_stepagent(p(1, 4), table, tmp_path / "one")
    assert two["world_size"] == 2 and two["partition"]["held_by_rank"][0] < two["partition"]["elements"] and "world_size" not in one
    assert two["pairs"] == one["pairs"] == 9
    curve2, curve1 = (json.loads((tmp_path / f"{d}/loss.json").read_text()) for d in ("two", "one"))
    assert [c["step"] for c in curve2] == [c["step"] for c in curve1] == [1, 2, 3]
    # the same rows in every global batch (the last one's single row twice on two ranks: the same means)
    for a, b in zip(curve2, curve1):
        for key in ("loss", "accuracy", "reward", "kl", "policy_loss", "value_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-4), (key, curve2, curve1)
    loaders = {"model": AutoModelForCausalLM.from_pretrained, "discriminator": lambda d: critic.load_critic(str(d))[0]}
    for folder, load in loaders.items():
        w1 = dict(load(tmp_path / "one" / folder).named_parameters())
        drift = max((w - w1[k]).abs().max().item() for k, w in load(tmp_path / "two" / folder).named_parameters())
        assert drift < 1e-4, (folder, drift)
