"""GRPO on logged multi-turn episodes (tasks/train/grpo.py): group advantages and the loss on
hand-computed batches, the assistant-token mask on a hand-made 2-turn episode, the step budget, the
train stage on a tiny model (seeded, toward the group's better episode), and 2 CPU ranks under
DeepSpeed against one process."""
from __future__ import annotations

import json
import math

import polars as pl
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import CONV, ROOT, tiny_params
from storage.parquet import write_table
from tasks.params import MethodParams, Params
from tasks.train import grpo, run_train
from tasks.train.sft import IGNORE, PadCollator

# A lost game beside CONV's won one: the same first turn (no signal between them), another second.
LOST = CONV[:4] + [{"role": "assistant", "content": "REASON: Guess now.\nQUESTION: Is it Cat?"}, {"role": "user", "content": "Answer: no. Game over."}]


def training_row(i: str, task: str, messages: list[dict], weight: float | None, source: str = "policy") -> dict:
    """A training-table row (storage/schema.py TRAINING) whose reward maps to `weight`."""
    return {
        "trajectory_id": i, "task_id": task, "split": "train", "source": source, "parent_id": None, "relabel_id": None,
        "messages": messages, "reward": None if weight is None else 8 * weight - 8, "standardized_reward": None if weight is None else 0.0, "weight": weight,
        "group_size": 2, "group_mean": None, "group_std": None, "standardize_status": "ok" if weight is not None else "no_reward",
    }


def write_training(path, rows: list[dict]):
    write_table(pl.DataFrame(rows).to_arrow(), path, "training")
    return path


def stage_params(model_dir, methods: dict, **train) -> Params:
    raw = tiny_params({"train": {"base_model": str(model_dir), "epochs": 1, "batch_size": 2, "learning_rate": 1.0e-3, "warmup_ratio": 0.0,
                                 "bf16": False, **train}})
    raw["train"]["methods"] = methods
    return Params.model_validate(raw)


# ---- group advantages -------------------------------------------------------------------------


def test_group_advantages_are_the_reward_minus_the_groups_mean_and_none_where_the_group_agrees():
    groups = ["a", "a", "b", "a", "b", "a", "c"]
    rewards = [1.0, 0.0, 0.5, 0.0, 0.5, 1.0, 0.3]
    # a: mean 0.5; b: both 0.5, zero variance; c: alone
    assert grpo.group_advantages(groups, rewards, scale=False) == [0.5, -0.5, None, -0.5, None, 0.5, None]
    # a's sample std: sqrt(4 x 0.25 / 3)
    s = math.sqrt(1 / 3)
    assert grpo.group_advantages(groups, rewards, scale=True) == pytest.approx([0.5 / s, -0.5 / s, None, -0.5 / s, None, 0.5 / s, None])
    # a group of three, unequal: mean 0.4
    assert grpo.group_advantages(["x"] * 3, [0.2, 0.2, 0.8], scale=False) == pytest.approx([-0.2, -0.2, 0.4])


# ---- the mask and the loss --------------------------------------------------------------------


def test_only_the_assistant_tokens_of_a_two_turn_episode_are_scored(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    table = pl.DataFrame([training_row("t", "Dog", CONV, 1.0)])
    (ep,), counts = grpo.episodes(tok, table, "weight", 1024)
    assert counts == {"no_reward": 0, "no_action": 0, "truncated": 0} and (ep["task_id"], ep["reward"], ep["turns"]) == ("Dog", 1.0, 2)
    scored = [t for t in ep["labels"] if t != IGNORE]
    # exactly the two assistant turns, each with its end-of-turn token: no system, user or header token
    assert tok.decode(scored) == CONV[2]["content"] + tok.eos_token + CONV[4]["content"] + tok.eos_token
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = PadCollator(tok.pad_token_id)([{"input_ids": ep["input_ids"], "labels": ep["labels"]}])
    with torch.no_grad():
        logps, rows = grpo.Policy(policy)(**batch)
        full = policy(input_ids=batch["input_ids"]).logits[0, :-1].log_softmax(-1)
    # one log-probability per scored token, each the model's at the position before it
    positions = [i for i, t in enumerate(ep["labels"]) if t != IGNORE]
    assert len(logps) == len(positions) and rows.tolist() == [0] * len(positions)
    assert logps.tolist() == pytest.approx([full[i - 1, ep["input_ids"][i]].item() for i in positions], abs=1e-5)
    # a row with no reward or no agent turn is left out, counted
    none = pl.DataFrame([training_row("n", "Dog", CONV, None), training_row("q", "Dog", CONV[:2], 0.5)])
    assert grpo.episodes(tok, none, "weight", 1024) == ([], {"no_reward": 1, "no_action": 1, "truncated": 0})
    with pytest.raises(ValueError, match="'return' is not in the table"):
        grpo.episodes(tok, table, "return", 1024)


def test_the_grpo_loss_on_a_hand_computed_batch():
    # episode 0: tokens 0 and 1, A = 0.5; episode 1: token 2, A = -0.5
    rows = torch.tensor([0, 0, 1])
    old = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.2, -2.0, -0.4])
    logps = (old + torch.tensor([0.1, 0.3, -0.4])).requires_grad_()
    adv = torch.tensor([0.5, 0.5, -0.5])
    episodes = [{"advantage": 0.5}, {"advantage": -0.5}]
    loss, parts = grpo.grpo_loss((logps, rows), episodes, adv, old, ref, clip_epsilon=0.2, kl_coef=0.1)
    # token 0: e^0.1 inside the clip: -0.5 e^0.1; token 1: e^0.3 > 1.2 with A > 0: -0.5 x 1.2;
    # token 2: e^-0.4 < 0.8 with A < 0: max(0.5 e^-0.4, 0.5 x 0.8) = 0.4
    policy = ((-0.5 * math.exp(0.1) - 0.6) / 2 + 0.4) / 2
    k3 = [math.exp(x) - x - 1 for x in (-0.3, -0.3, 0.5)]  # log ref/pi: ref - logps
    kl = ((k3[0] + k3[1]) / 2 + k3[2]) / 2
    assert parts["policy_loss"] == pytest.approx(policy, rel=1e-6) and parts["kl"] == pytest.approx(kl, rel=1e-5)
    assert parts["clip_fraction"] == pytest.approx((1 / 2 + 1) / 2) and parts["advantage"] == 0.0
    assert loss.item() == pytest.approx(policy + 0.1 * kl, rel=1e-6)


# ---- the step budget --------------------------------------------------------------------------


def test_gradient_steps_fix_the_optimizer_steps_whatever_the_tables_size():
    by_epochs = grpo.plan(5, 2, 1, 2, ppo_epochs=3, gradient_steps=None, seed=0)
    assert [k for _, k in by_epochs] == [3] * 6  # 3 batches a pass, 2 passes
    for n in (3, 5, 40):
        fixed = grpo.plan(n, 2, 1, 1, ppo_epochs=3, gradient_steps=7, seed=0)
        assert [k for _, k in fixed] == [3, 3, 1]
    # more steps than a pass holds: the passes repeat in their seeded orders
    long = grpo.plan(3, 2, 1, 1, ppo_epochs=1, gradient_steps=5, seed=0)
    assert len(long) == 5 and sorted(long[0][0] + long[1][0]) == [0, 1, 2]
    # on 2 ranks: global batches of 2 x 2, each padded to a multiple of the ranks
    assert all(len(b) % 2 == 0 for b, _ in grpo.plan(5, 2, 2, 1, ppo_epochs=1, gradient_steps=4, seed=0))


def test_grpo_takes_the_logged_rows_and_its_own_settings_only():
    m = MethodParams(algorithm="grpo", grpo={"kl_coef": 0.0, "gradient_steps": 100})
    assert m.data == "logged" and m.grpo.kl_coef == 0.0 and m.grpo.ppo_epochs == 1 and m.grpo.scale_rewards is False
    with pytest.raises(ValueError, match="grpo learns from the policy's own rollouts"):
        MethodParams(algorithm="grpo", alpha=0.4)
    with pytest.raises(ValueError, match="grpo settings apply to algorithm grpo only"):
        MethodParams(algorithm="sft", grpo={})


# ---- the train stage --------------------------------------------------------------------------


def logps_of(model_dir, tok, messages: list[dict]) -> float:
    (ep,), _ = grpo.episodes(tok, pl.DataFrame([training_row("x", "x", messages, 0.0)]), "weight", 1024)
    batch = PadCollator(tok.pad_token_id)([{"input_ids": ep["input_ids"], "labels": ep["labels"]}])
    with torch.no_grad():
        return grpo.Policy(AutoModelForCausalLM.from_pretrained(model_dir))(**batch)[0].sum().item()


def test_the_train_stage_moves_the_policy_toward_the_groups_better_episode_and_is_seeded(tiny_model_dir, tmp_path):
    table = write_training(tmp_path / "train.parquet", [
        training_row("won", "Dog", CONV, 1.0), training_row("lost", "Dog", LOST, 0.0),
        training_row("tie1", "Cat", CONV, 0.5), training_row("tie2", "Cat", LOST, 0.5),  # zero variance: no gradient
        training_row("regen", "Dog", LOST, 1.0, source="regeneration"),  # not the policy's rollout
    ])
    p = stage_params(tiny_model_dir, {"grpo": {"algorithm": "grpo", "grpo": {"gradient_steps": 6, "ppo_epochs": 2}}})
    m = run_train(p, table, tmp_path / "a")["methods"]["grpo"]
    assert (m["rows"], m["rows_logged"], m["rows_hindsight"], m["groups"], m["groups_zero_variance"], m["episodes_zero_variance"]) == (2, 4, 0, 2, 1, 2)
    assert m["group_sizes"] == {"2": 2} and m["mean_advantage"] == 0.0 and m["mean_abs_advantage"] == 0.5
    curve = json.loads((tmp_path / "a/loss/grpo.json").read_text())
    assert m["steps"] == 6 and [c["step"] for c in curve] == list(range(1, 7)) and m["final_loss"] == curve[-1]["loss"]
    assert m["first_loss"] == pytest.approx(0.0, abs=1e-6)  # ratio 1 and A's mean 0 at the first step, the KL 0
    assert m["final_kl"] > 0 and 0 <= m["final_clip_fraction"] <= 1
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    trained = tmp_path / "a/models/grpo"
    gap = [logps_of(d, tok, CONV) - logps_of(d, tok, LOST) for d in (tiny_model_dir, trained)]
    assert gap[1] > gap[0] + 0.1, gap
    run_train(p, table, tmp_path / "b")
    weights = [(tmp_path / d / "models/grpo/model.safetensors").read_bytes() for d in ("a", "b")]
    assert weights[0] == weights[1] != (tiny_model_dir / "model.safetensors").read_bytes()


def test_a_reference_other_than_the_policy_is_what_the_kl_pulls_toward(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy, reference = (AutoModelForCausalLM.from_pretrained(tiny_model_dir) for _ in range(2))
    torch.manual_seed(0)
    with torch.no_grad():
        reference.lm_head.weight.add_(0.2 * torch.randn_like(reference.lm_head.weight))
    table = pl.DataFrame([training_row("won", "Dog", CONV, 1.0), training_row("lost", "Dog", LOST, 0.0)])
    (a, b), _ = grpo.episodes(tok, table, "weight", 1024)
    same, other = grpo.with_logps(policy, None, tok, [a, b]), grpo.with_logps(policy, reference, tok, [a, b])
    assert same[0]["ref"] == same[0]["old"] == other[0]["old"] and other[0]["ref"] != other[0]["old"]
    cfg = stage_params(tiny_model_dir, {"grpo": {"algorithm": "grpo"}}).train.config_for(MethodParams(algorithm="grpo", grpo={"gradient_steps": 1}))
    m = grpo.train(policy, tok, table, cfg, seed=0, reference=reference)
    # the KL to another reference is there from the first step, where the ratio is 1 and A's mean 0
    assert m["curve"][0]["kl"] > 0.01 and m["first_loss"] == pytest.approx(0.04 * m["curve"][0]["kl"], rel=1e-3)


def test_with_every_group_agreeing_nothing_is_trained(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    cfg = stage_params(tiny_model_dir, {"grpo": {"algorithm": "grpo"}}).train.config_for(MethodParams(algorithm="grpo"))
    m = grpo.train(policy, tok, pl.DataFrame([training_row("a", "Dog", CONV, 0.0), training_row("b", "Dog", LOST, 0.0)]), cfg, seed=0)
    assert (m["rows"], m["groups_zero_variance"], m["steps"], m["curve"]) == (0, 1, 0, [])
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())


# ---- on ranks ---------------------------------------------------------------------------------


def ranks_table(path):
    """3 tasks of 2 episodes, one won and one lost each: 6 episodes, global batches of 4 and 2."""
    return write_training(path, [training_row(f"{t}{i}", t, [CONV, LOST][i], 1.0 - i) for t in ("Dog", "Cat", "Cow") for i in range(2)])


def compare_ranks(tiny_model_dir, tmp_path, name: str, method: dict, keys: tuple[str, ...]) -> None:
    """`method` on 2 ranks of batch 2 against one process of batch 4: the same global batches, the
    same curve and weights."""
    table = ranks_table(tmp_path / "train.parquet")

    def p(nproc: int, batch_size: int) -> Params:
        return stage_params(tiny_model_dir, {name: method}, batch_size=batch_size, nproc_per_node=nproc,
                            deepspeed=str(ROOT / "tasks/train/deepspeed_zero3.json"))

    two = run_train(p(2, 2), table, tmp_path / "two")
    one = run_train(p(1, 4), table, tmp_path / "one")
    assert two["world_size"] == 2 and "world_size" not in one
    assert two["methods"][name]["partition"]["held_by_rank"][0] < two["methods"][name]["partition"]["elements"]
    curve2, curve1 = (json.loads((tmp_path / d / f"loss/{name}.json").read_text()) for d in ("two", "one"))
    assert [c["step"] for c in curve2] == [c["step"] for c in curve1] == list(range(1, len(curve1) + 1)) and len(curve1) > 1
    metrics2, metrics1 = two["methods"][name], one["methods"][name]
    assert metrics2["steps"] == metrics1["steps"] == len(curve1)
    for key in keys:
        assert metrics2[key] == pytest.approx(metrics1[key], rel=1e-3, abs=1e-4), (key, metrics2, metrics1)
    w1 = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "one/models" / name).named_parameters())
    drift = max((w - w1[k]).abs().max().item() for k, w in AutoModelForCausalLM.from_pretrained(tmp_path / "two/models" / name).named_parameters())
    assert drift < 1e-4, drift
    moved = max((w - w1[k]).abs().max().item() for k, w in AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    assert moved > 1e-3, moved  # the comparison is between trained weights


@pytest.mark.system
def test_grpo_on_two_cpu_ranks_under_deepspeed_matches_one_process(tiny_model_dir, tmp_path):
    compare_ranks(tiny_model_dir, tmp_path, "grpo", {"algorithm": "grpo", "grpo": {"ppo_epochs": 2}},
                  ("first_loss", "final_loss", "final_kl", "final_clip_fraction"))
