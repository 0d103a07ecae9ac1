"""RFT (tasks/train/rft.py): which rows count as the policy's successful rollouts, on a hand-made
table (and how that differs from filtered BC's cut), and a tiny train through the train stage."""
from __future__ import annotations

import json

import polars as pl
import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import CONV, SHORT, tiny_params
from storage.parquet import write_table
from tasks.params import MethodParams, Params
from tasks.train import filtered_bc, rft, run_train
from tasks.train.sft import tokenize_chats

MAX_TURNS = 20
WON = lambda r: r > -MAX_TURNS  # noqa: E731  (TwentyQuestions' rule: a lost game returns exactly -max_turns)


def row(i: str, reward: float | None, source: str = "policy", messages=CONV) -> dict:
    weight = None if reward is None else (reward + MAX_TURNS) / MAX_TURNS  # standardize's return_range map
    return {
        "trajectory_id": i, "task_id": "Dog", "split": "train", "source": source, "parent_id": None, "relabel_id": None,
        "messages": messages, "reward": reward, "standardized_reward": 0.0, "weight": weight, "group_size": 3,
        "group_mean": None, "group_std": None, "standardize_status": "ok",
    }


TABLE = pl.DataFrame([
    row("win_early", -5.0),  # weight 0.75
    row("lost", -20.0),  # weight 0
    row("unlabelled", None),
    row("regen_win", -3.0, source="regeneration"),  # a hindsight trajectory: not the policy's rollout
    row("win_late", -19.0),  # weight 0.05: still a win
    row("lost_again", -20.0),
    row("imported_win", -10.0, source="import"),  # weight 0.5
])


def test_rft_keeps_every_logged_success_and_nothing_else():
    kept, counts = rft.select(TABLE, WON)
    assert kept["trajectory_id"].to_list() == ["win_early", "win_late", "imported_win"]  # the table's order
    assert counts == {"successes": 3, "failures": 2, "no_reward": 1, "regenerations_dropped": 1, "success_rule": "Environment.won"}
    assert sum(v for k, v in counts.items() if k != "success_rule") == TABLE.height  # every row counted once


def test_a_threshold_reads_the_weight_instead_of_the_environments_rule():
    kept, counts = rft.select(TABLE, WON, threshold=0.5)
    assert kept["trajectory_id"].to_list() == ["win_early", "imported_win"]  # 0.75 and 0.5 (the bound counts); 0.05 does not
    assert (counts["successes"], counts["failures"], counts["success_rule"]) == (2, 3, "weight >= 0.5")
    # No success at all: nothing to clone.
    assert rft.select(TABLE, lambda r: False)[0].is_empty()


def test_filtered_bc_cuts_relatively_where_rft_cuts_absolutely():
    # filtered BC's top half of the 6 rated rows: the hindsight win leads, and a late win is left out.
    assert filtered_bc.select(TABLE, 0.5)["trajectory_id"].to_list() == ["regen_win", "win_early", "imported_win"]
    # Where every logged episode lost, filtered BC still keeps its top share; RFT keeps none.
    losses = pl.DataFrame([row("a", -20.0), row("b", -20.0)])
    assert filtered_bc.select(losses, 1.0).height == 2 and rft.select(losses, WON)[0].is_empty()


def test_rft_takes_only_logged_data():
    assert MethodParams(algorithm="rft").data == "logged"
    assert MethodParams(algorithm="rft", data="logged", success_threshold=0.9).success_threshold == 0.9
    for bad in ({"data": "all"}, {"alpha": 0.4}, {"aggregate_multiple": 2.0}):
        with pytest.raises(ValidationError, match="rft clones the policy's own successful rollouts"):
            MethodParams(algorithm="rft", **bad)
    with pytest.raises(ValidationError, match="success_threshold applies to algorithm rft only"):
        MethodParams(algorithm="filtered_bc", success_threshold=0.5)
    assert MethodParams(algorithm="rft", gradient_steps=7).gradient_steps == 7
    with pytest.raises(ValidationError, match="gradient_steps applies to algorithms rft, filtered_bc, sft only, not refit"):
        MethodParams(algorithm="refit", gradient_steps=7)
    with pytest.raises(ValidationError, match="not grpo: set grpo.gradient_steps"):
        MethodParams(algorithm="grpo", gradient_steps=7)


def test_gradient_steps_hold_rft_to_a_step_count_whatever_its_successes(tiny_model_dir, tmp_path):
    """NLAC gives every method the same optimizer steps: RFT's are the SFT trainer's max_steps, passes
    over the successes repeated (one success at batch 1: 5 passes) or cut short (8: 5 of one pass's 8 steps)."""
    def steps_on(table: pl.DataFrame, out: str) -> list[int]:
        write_table(table.to_arrow(), tmp_path / f"{out}.parquet", "training")
        raw = tiny_params({"train": {"base_model": str(tiny_model_dir), "epochs": 1, "batch_size": 1}})
        raw["train"]["methods"] = {"rft": {"algorithm": "rft", "gradient_steps": 5}}
        m = run_train(Params.model_validate(raw), tmp_path / f"{out}.parquet", tmp_path / out)["methods"]["rft"]
        assert m["trained"]
        return [e["step"] for e in json.loads((tmp_path / out / "loss/rft.json").read_text())]

    one = pl.DataFrame([row("won", -3.0), row("lost", -8.0, messages=SHORT)])
    assert steps_on(one, "one") == [1, 2, 3, 4, 5]  # 1 epoch would be 1 step
    many = pl.DataFrame([row(f"won{i}", -3.0) for i in range(8)])
    assert steps_on(many, "many") == [1, 2, 3, 4, 5]  # 1 epoch would be 8


def test_the_train_stage_clones_the_successes_alone(tiny_model_dir, tmp_path):
    # tiny_params' TwentyQuestions has max_turns 8: -8 is a loss, -3 a win.
    table = pl.DataFrame([
        row("won", -3.0), row("lost", -8.0, messages=SHORT), row("regen", -2.0, source="regeneration", messages=SHORT),
    ]).with_columns(weight=pl.Series([5 / 8, 0.0, 6 / 8]))
    write_table(table.to_arrow(), tmp_path / "train.parquet", "training")
    raw = tiny_params({"train": {"base_model": str(tiny_model_dir), "epochs": 4, "batch_size": 1, "learning_rate": 3.0e-3}})
    raw["train"]["methods"] = {"rft": {"algorithm": "rft"}, "rft_none": {"algorithm": "rft", "success_threshold": 1.0}}
    m = run_train(Params.model_validate(raw), tmp_path / "train.parquet", tmp_path / "out")["methods"]
    r = m["rft"]
    assert r["trained"] and r["rows"] == 1 and r["rows_skipped"] == 1  # the regeneration never reached it
    assert (r["data"], r["rows_logged"], r["rows_hindsight"]) == ("logged", 2, 0)
    assert (r["successes"], r["failures"], r["no_reward"], r["min_reward_kept"]) == (1, 1, 0, -3.0)
    assert len(json.loads((tmp_path / "out/loss/rft.json").read_text())) == 4
    # The won game's agent tokens became likelier; the lost one was not trained on.
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    won = tokenize_chats(tok, [CONV], 10**6).examples[0]

    def nll(model_dir) -> float:
        with torch.no_grad():
            model = AutoModelForCausalLM.from_pretrained(model_dir)
            return model(input_ids=torch.tensor([won["input_ids"]]), labels=torch.tensor([won["labels"]])).loss.item()

    assert nll(tmp_path / "out/models/rft") < nll(tiny_model_dir) - 0.5
    # No weight reaches 1.0: nothing succeeds, and the base model is kept, untrained.
    none = m["rft_none"]
    assert not none["trained"] and none["successes"] == 0 and none["success_rule"] == "weight >= 1"
    assert (tmp_path / "out/models/rft_none/model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
