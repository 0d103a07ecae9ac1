"""LEAP (tasks/train/leap.py) on a hand-made case: which relabels become examples and at which
state, the loss mask (the counterfactual action's tokens alone), and a tiny train through the
train stage."""
from __future__ import annotations

import json

import polars as pl
import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import tiny_params, twenty_questions
from envs.reason_question import render_action
from storage.parquet import read_table, write_table
from storage.schema import to_table
from tasks.params import MethodParams, Params
from tasks.rollout import ScriptedAgent, derive_seed, new_episode, play, turn_start
from tasks.train import leap, run_train
from tasks.train.sft import IGNORE


@pytest.fixture(scope="module")
def parent() -> dict:
    """A logged game of at least four turns (noisy scripted player)."""
    env = twenty_questions(8)
    policies = env.policies({"p_random": 0.5, "p_repeat": 0.2, "p_early_guess": 0.0})
    for k in range(20):
        ep = new_episode(env, env.tasks("train")[0], derive_seed("leap", k))
        play([ep], ScriptedAgent(lambda rng: policies["noisy"]), 0, "logged")
        if ep.to_row()["num_turns"] >= 4:
            return ep.to_row()
    raise AssertionError("no scripted game lasted four turns")


def relabel(parent: dict, rid: str, turn: int | None, rank: int, question: str | None, status: str = "ok", trajectory_id: str | None = None) -> dict:
    text = render_action(f"Hindsight {rid}.", question) if question else None
    return {
        "relabel_id": rid, "trajectory_id": trajectory_id or parent["trajectory_id"], "task_id": parent["task_id"], "split": "train",
        "mode": "hope", "branch_turn": turn, "rank": rank, "original_text": None, "original_action": None,
        "counterfactual_text": text, "counterfactual_action": question, "player_reason": f"Hindsight {rid}." if question else None,
        "rationale": "r" if question else None, "status": status, "reason": None if status == "ok" else "unparseable",
        "proposer": "oracle", "prompt_hash": "h",
    }


@pytest.fixture(scope="module")
def relabels(parent) -> list[dict]:
    return [
        relabel(parent, "c", 2, 0, "Is it made of metal?"),
        relabel(parent, "b", 1, 1, "Is it bigger than a car?"),
        relabel(parent, "a", 1, 0, "Is it alive?"),
        relabel(parent, "failed", 2, 1, None, status="invalid"),  # no counterfactual: nothing to imitate
        relabel(parent, "orphan", 1, 0, "Is it red?", trajectory_id="no-such-trajectory"),  # no state to put it at
    ]


def test_each_ok_counterfactual_is_one_example_at_its_parents_state(parent, relabels):
    rows = leap.counterfactuals(twenty_questions(8), relabels, {parent["trajectory_id"]: parent})
    assert [(r["relabel_id"], r["branch_turn"]) for r in rows] == [("a", 1), ("b", 1), ("c", 2)]  # by turn, then the proposer's rank
    by_id = {r["relabel_id"]: r for r in relabels}
    for r in rows:
        # the state: the logged messages before the parent's action number branch_turn, observations included
        assert r["prompt"] == parent["messages"][: turn_start(parent["messages"], r["branch_turn"])]
        assert r["prompt"][-1]["role"] != "assistant" and sum(m["role"] == "assistant" for m in r["prompt"]) == r["branch_turn"]
        assert r["action"] == {"role": "assistant", "content": by_id[r["relabel_id"]]["counterfactual_text"]}


def test_the_loss_falls_on_the_counterfactual_actions_tokens_alone(parent, relabels, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = leap.counterfactuals(twenty_questions(8), relabels, {parent["trajectory_id"]: parent})
    examples, counts = leap.examples(tok, rows, 10**6)
    assert len(examples) == 3 and counts == {"truncated": 0, "too_long": 0}
    for row, ex in zip(rows, examples):
        supervised = [i for i, t in enumerate(ex["labels"]) if t != IGNORE]
        first = supervised[0]
        assert supervised == list(range(first, len(ex["labels"])))  # one span, at the end
        assert ex["labels"][first:] == ex["input_ids"][first:]
        assert tok.decode(ex["labels"][first:], skip_special_tokens=False) == row["action"]["content"] + tok.eos_token
        # the earlier agent turns are in the input, not in the loss
        state = tok.decode(ex["input_ids"][:first], skip_special_tokens=False)
        for m in row["prompt"]:
            assert m["content"] in state
        assert sum(m["role"] == "assistant" for m in row["prompt"]) == row["branch_turn"] > 0
    # A context shorter than the example: the state's start is cut, the action kept whole.
    cut, counts = leap.examples(tok, rows[:1], len(examples[0]["input_ids"]) - 5)
    assert counts["truncated"] == 1 and cut[0]["labels"] == examples[0]["labels"][5:]
    # An action alone longer than the context is left out and counted.
    n_action = sum(t != IGNORE for t in examples[0]["labels"])
    assert leap.examples(tok, rows[:1], n_action - 1) == ([], {"truncated": 0, "too_long": 1})


def test_leap_takes_neither_data_nor_alpha():
    assert MethodParams(algorithm="leap").algorithm == "leap"
    for bad in ({"alpha": 0.4}, {"data": "logged"}):
        with pytest.raises(ValidationError, match="leap trains on relabel's counterfactuals"):
            MethodParams(algorithm="leap", **bad)


def test_the_train_stage_trains_leap_on_the_counterfactuals(parent, relabels, tiny_model_dir, tmp_path):
    write_table(to_table([parent], "trajectories"), tmp_path / "collect.parquet", "trajectories")
    write_table(to_table(relabels, "relabels"), tmp_path / "relabels.parquet", "relabels")
    table = {  # the training table: one logged row, which leap does not train on
        "trajectory_id": parent["trajectory_id"], "task_id": parent["task_id"], "split": "train", "source": "policy", "parent_id": None,
        "relabel_id": None, "messages": parent["messages"], "reward": -8.0, "standardized_reward": 0.0, "weight": 0.0, "group_size": 1,
        "group_mean": None, "group_std": None, "standardize_status": "singleton",
    }
    write_table(pl.DataFrame([table]).to_arrow(), tmp_path / "train.parquet", "training")
    raw = tiny_params({"train": {"base_model": str(tiny_model_dir), "epochs": 2, "batch_size": 2, "learning_rate": 3.0e-3}})
    raw["train"]["methods"] = {"leap": {"algorithm": "leap"}}
    params = Params.model_validate(raw)

    with pytest.raises(ValueError, match="a leap method learns relabel's counterfactuals"):
        run_train(params, tmp_path / "train.parquet", tmp_path / "none")
    m = run_train(params, tmp_path / "train.parquet", tmp_path / "out", relabels=tmp_path / "relabels.parquet", trajectories=tmp_path / "collect.parquet")
    leap_m = m["methods"]["leap"]
    assert leap_m["trained"] and leap_m["rows"] == 3 and leap_m["sites"] == 2
    assert (leap_m["rows_logged"], leap_m["rows_hindsight"], leap_m["hindsight_share"]) == (0, 3, 1.0)
    # the orphan relabel is quarantined with its reason, the rest kept
    quarantine = read_table(tmp_path / "out/quarantine.parquet").to_pylist()
    assert [q["reason"] for q in quarantine if "no-such-trajectory" in q["reason"]]
    curve = json.loads((tmp_path / "out/loss/leap.json").read_text())
    assert len(curve) == 4 and all(torch.isfinite(torch.tensor(p["loss"])) for p in curve)  # 3 examples / 2, 2 epochs
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "out/models/leap").state_dict()
    assert any(not torch.equal(base[k], trained[k]) for k in base)
    # the loss went to the counterfactuals: their log-likelihood rose
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples, _ = leap.examples(tok, leap.counterfactuals(twenty_questions(8), relabels, {parent["trajectory_id"]: parent}), 10**6)

    def nll(model_dir) -> float:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        with torch.no_grad():
            return sum(model(input_ids=torch.tensor([e["input_ids"]]), labels=torch.tensor([e["labels"]])).loss.item() for e in examples)

    assert nll(tmp_path / "out/models/leap") < nll(tiny_model_dir)
