"""Every trainer puts zero loss on observation and prompt tokens; the export trains in TRL as is;
filtered BC keeps the top fraction; alpha mixes hindsight rows in at its share; the train stage
writes one model per method."""
import json

import polars as pl
import pytest
import torch
from pydantic import ValidationError
from transformers import Trainer, TrainingArguments

from conftest import CONV, SHORT, tiny_params
from models.tiny import make_model, train_tokenizer
from storage.parquet import write_table
from tasks.params import MethodParams, Params
from tasks.train import filtered_bc, training_rows
from tasks.train.refit import RewardWeightedTrainer
from tasks.train.sft import IGNORE, PadCollator, tokenize_chats



@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([m["content"] for m in CONV + SHORT] * 20, vocab_size=400)


def _trainer(kind: str, model, tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", remove_unused_columns=False)
    if kind == "weighted":  # refit and swift
        return RewardWeightedTrainer(model=model, args=args, norm="sequences")
    return Trainer(model=model, args=args)  # sft and filtered_bc use the HF Trainer's own loss


@pytest.mark.parametrize("algorithm", ["sft", "filtered_bc", "refit", "swift"])
def test_no_loss_falls_on_observation_or_prompt_tokens(algorithm, tok, tmp_path):
    torch.manual_seed(0)
    model = make_model(tok, 64, 1, 1, 64, 128, 256)
    examples = tokenize_chats(tok, [CONV, SHORT], max_length=256).examples
    weights = {"refit": [1.0, 0.5], "swift": [0.7, -0.7]}.get(algorithm)
    if weights:
        examples = [dict(e, weight=w) for e, w in zip(examples, weights)]
    batch = PadCollator(tok.pad_token_id)(examples)
    captured = {}

    def keep(_, __, out):
        out.retain_grad()
        captured["logits"] = out

    model.lm_head.register_forward_hook(keep)
    trainer = _trainer("weighted" if weights else "plain", model, tmp_path)
    loss = trainer.compute_loss(model, dict(batch))
    loss.backward()
    grad = captured["logits"].grad  # [B, T, V]: position t predicts token t + 1
    predicts_agent = torch.zeros(batch["labels"].shape, dtype=torch.bool)
    predicts_agent[:, :-1] = batch["labels"][:, 1:] != IGNORE
    assert grad[~predicts_agent].abs().max().item() == 0.0  # prompts, observations, padding
    assert grad[predicts_agent].abs().sum(-1).gt(0).all()  # every agent token carries loss


def test_export_loads_in_datasets_and_trains_in_trl_with_assistant_only_loss(tok, tmp_path):
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    rows = [
        {"messages": c, "reward": r, "standardized_reward": z, "weight": w, "trajectory_id": i, "task_id": "Dog", "source": "policy", "tools": None}
        for c, r, z, w, i in ((CONV, -1.0, 0.7, 1.0, "a"), (SHORT, -20.0, -0.7, 0.0, "b"))
    ]
    write_table(pl.DataFrame(rows).to_arrow(), tmp_path / "export/train.parquet", "export")
    ds = load_dataset("parquet", data_files=str(tmp_path / "export/train.parquet"), split="train")
    assert ds.column_names[:2] == ["messages", "reward"] and ds[0]["messages"] == CONV
    torch.manual_seed(0)
    model = make_model(tok, 64, 1, 1, 64, 128, 256)
    args = SFTConfig(output_dir=str(tmp_path / "trl"), max_steps=2, per_device_train_batch_size=2, assistant_only_loss=True,
                     report_to="none", use_cpu=True, save_strategy="no", learning_rate=1e-3)
    trainer = SFTTrainer(model=model, processing_class=tok, train_dataset=ds, args=args)
    batch = next(iter(trainer.get_train_dataloader()))
    for ids, labels in zip(batch["input_ids"], batch["labels"]):
        supervised = tok.decode([t for t, l in zip(ids.tolist(), labels.tolist()) if l != IGNORE])
        conv = CONV if "Dog fits" in tok.decode(ids) else SHORT
        assert supervised == "".join(m["content"] + tok.eos_token for m in conv if m["role"] == "assistant")
    assert trainer.train().training_loss > 0


def test_filtered_bc_keeps_the_top_fraction_with_a_fixed_tie_break():
    table = pl.DataFrame({"trajectory_id": list("abcdef"), "reward": [-3.0, -20.0, -3.0, None, -1.0, -20.0]})
    assert filtered_bc.select(table, 0.4)["trajectory_id"].to_list() == ["e", "a"]  # ceil(0.4 * 5 rated) = 2
    # Never the unrated, and never a failure tied at the floor when some trajectories do better.
    assert filtered_bc.select(table, 1.0)["trajectory_id"].to_list() == ["e", "a", "c"]
    floor = pl.DataFrame({"trajectory_id": list("ab"), "reward": [-20.0, -20.0]})
    assert filtered_bc.select(floor, 0.5)["trajectory_id"].to_list() == ["a"]  # all tied: the top fraction as usual


def test_filtered_bc_keeps_nothing_when_no_trajectory_has_a_reward():
    unrated = pl.DataFrame({"trajectory_id": list("ab"), "reward": [None, None]}, schema={"trajectory_id": pl.Utf8, "reward": pl.Float64})
    assert filtered_bc.select(unrated, 0.5).height == 0
    assert filtered_bc.select(unrated.clear(), 0.5).height == 0


def mixed(logged: int, hindsight: int) -> pl.DataFrame:
    """A training table's rows, as far as the selection reads them: logged l0.., then regenerations h0.."""
    return pl.DataFrame({
        "trajectory_id": [f"l{i}" for i in range(logged)] + [f"h{i}" for i in range(hindsight)],
        "source": ["policy"] * logged + ["regeneration"] * hindsight,
    })


def ids(table: pl.DataFrame, prefix: str) -> set[str]:
    return {i for i in table["trajectory_id"] if i.startswith(prefix)}


def test_alpha_keeps_every_logged_row_and_draws_the_hindsight_share():
    alpha = MethodParams(algorithm="refit", alpha=0.4)
    table = mixed(6, 7)
    data, counts = training_rows(table, alpha, seed=0)
    # round(0.4 / 0.6 * 6) = 4 of the 7 regenerations: 4 of 10 rows.
    assert counts == {"rows_logged": 6, "rows_hindsight": 4, "hindsight_share": 0.4}
    assert ids(data, "l") == ids(table, "l") and len(ids(data, "h")) == 4
    assert data["trajectory_id"].to_list() == [i for i in table["trajectory_id"] if i in set(data["trajectory_id"])]  # table order
    # Deterministic: the same rows on a rerun and in any row order; another seed draws others.
    assert training_rows(table, alpha, seed=0)[0].equals(data)
    assert ids(training_rows(table.reverse(), alpha, seed=0)[0], "h") == ids(data, "h")
    assert ids(training_rows(table, alpha, seed=1)[0], "h") != ids(data, "h")
    # alpha 0: no hindsight; null: every row; data: logged: the logged rows.
    assert training_rows(table, MethodParams(algorithm="refit", alpha=0.0), 0)[1] == {"rows_logged": 6, "rows_hindsight": 0, "hindsight_share": 0.0}
    assert training_rows(table, MethodParams(algorithm="refit"), 0)[0].equals(table)
    assert training_rows(table, MethodParams(algorithm="refit", data="logged"), 0)[1]["rows_hindsight"] == 0


def test_alpha_with_too_few_regenerations_keeps_them_all_and_subsamples_the_logged_rows():
    alpha = MethodParams(algorithm="swift", alpha=0.4)
    table = mixed(6, 2)  # 4 regenerations wanted, 2 exist: round(2 * 0.6 / 0.4) = 3 logged rows
    data, counts = training_rows(table, alpha, seed=0)
    assert counts == {"rows_logged": 3, "rows_hindsight": 2, "hindsight_share": 0.4}
    assert ids(data, "h") == {"h0", "h1"} and ids(data, "l") < ids(table, "l")
    assert training_rows(table, alpha, seed=0)[0].equals(data)
    # No regeneration at all: no share can be reached, and the logged rows are kept.
    assert training_rows(mixed(6, 0), alpha, 0)[1] == {"rows_logged": 6, "rows_hindsight": 0, "hindsight_share": 0.0}


def test_aggregate_multiple_keeps_every_logged_row_and_adds_regenerations_up_to_the_multiple():
    five = MethodParams(algorithm="ilql", aggregate_multiple=5)
    table = mixed(4, 30)  # HR's 5x: 4 originals + 16 regenerations = 20 rows
    data, counts = training_rows(table, five, seed=0)
    assert counts == {"rows_logged": 4, "rows_hindsight": 16, "hindsight_share": 0.8, "multiple": 5.0}
    assert ids(data, "l") == ids(table, "l") and len(ids(data, "h")) == 16
    assert training_rows(table, five, seed=0)[0].equals(data)
    assert ids(training_rows(table.reverse(), five, seed=0)[0], "h") == ids(data, "h")
    assert ids(training_rows(table, five, seed=1)[0], "h") != ids(data, "h")
    # A fractional multiple rounds the regenerations: 1.5 x 4 = 6 rows, 2 of them regenerations.
    assert training_rows(table, MethodParams(algorithm="refit", aggregate_multiple=1.5), 0)[1]["rows_hindsight"] == 2
    # Too few regenerations: all of them, and never a logged row less.
    data, counts = training_rows(mixed(4, 3), five, seed=0)
    assert counts == {"rows_logged": 4, "rows_hindsight": 3, "hindsight_share": 3 / 7, "multiple": 1.75}
    # 1x: the originals alone.
    assert training_rows(table, MethodParams(algorithm="refit", aggregate_multiple=1), 0)[1]["rows_hindsight"] == 0


def test_aggregate_multiple_is_at_least_one_and_not_beside_alpha_or_logged_data():
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        MethodParams(algorithm="ilql", aggregate_multiple=0.5)
    with pytest.raises(ValidationError, match="set one"):
        MethodParams(algorithm="refit", alpha=0.4, aggregate_multiple=5)
    with pytest.raises(ValidationError, match="data: logged has none"):
        MethodParams(algorithm="refit", data="logged", aggregate_multiple=5)


def test_alpha_needs_hindsight_rows_and_a_share_below_one():
    with pytest.raises(ValidationError, match="data: logged has none"):
        MethodParams(algorithm="refit", data="logged", alpha=0.4)
    with pytest.raises(ValidationError, match="alpha"):
        MethodParams(algorithm="refit", alpha=1.0)


def test_train_stage_writes_a_model_and_a_loss_curve_per_method(tiny_model_dir, tmp_path):
    def row(i: str, source: str, reward: float, z: float, w: float) -> dict:
        return {
            "trajectory_id": i, "task_id": "Dog", "split": "train", "source": source, "parent_id": None, "relabel_id": None,
            "messages": CONV, "reward": reward, "standardized_reward": z, "weight": w, "group_size": 3,
            "group_mean": -7.0, "group_std": 5.0, "standardize_status": "ok",
        }

    table = pl.DataFrame([row("a", "policy", -1.0, 1.0, 1.0), row("b", "policy", -20.0, -1.0, 0.0), row("c", "regeneration", -5.0, 0.2, 0.8)])
    write_table(table.to_arrow(), tmp_path / "train.parquet", "training")
    params = Params.model_validate(tiny_params({"train": {"base_model": str(tiny_model_dir)}}))
    from tasks.train import run_train

    m = run_train(params, tmp_path / "train.parquet", tmp_path / "out")
    methods = m["methods"]
    assert set(methods) == set(params.train.methods)
    assert methods["refit_logged"]["rows"] == 1  # logged only, and weight 0 carries no gradient
    assert methods["refit"]["rows"] == 2 and methods["refit"]["rows_skipped"] == 1
    # alpha 0.4 of params.yaml: round(0.4 / 0.6 * 2) = 1 regeneration beside the 2 logged rows.
    assert (methods["refit"]["alpha"], methods["refit"]["rows_logged"], methods["refit"]["rows_hindsight"]) == (0.4, 2, 1)
    assert methods["refit"]["hindsight_share"] == pytest.approx(1 / 3)
    assert (methods["refit_logged"]["rows_logged"], methods["refit_logged"]["rows_hindsight"]) == (2, 0)
    assert methods["swift"]["rows"] == 3  # negative weights included
    assert methods["sft"]["rows"] == 3
    assert methods["filtered_bc"]["rows"] == 1  # ceil(0.25 * 3)
    for name in methods:
        assert (tmp_path / "out/models" / name / "model.safetensors").exists()
        assert json.loads((tmp_path / "out/loss" / f"{name}.json").read_text())


def test_a_method_with_no_training_signal_keeps_the_base_model_and_says_so(tiny_model_dir, tmp_path):
    tied = pl.DataFrame([{
        "trajectory_id": i, "task_id": "Dog", "split": "train", "source": "policy", "parent_id": None, "relabel_id": None,
        "messages": SHORT, "reward": -20.0, "standardized_reward": 0.0, "weight": 1.0, "group_size": 2,
        "group_mean": -20.0, "group_std": 0.0, "standardize_status": "tied",
    } for i in "ab"])
    write_table(tied.to_arrow(), tmp_path / "train.parquet", "training")
    params = Params.model_validate(tiny_params({"train": {"base_model": str(tiny_model_dir), "methods": {"swift": {"algorithm": "swift"}}}}))
    from tasks.train import run_train

    m = run_train(params, tmp_path / "train.parquet", tmp_path / "out")["methods"]["swift"]
    assert m["trained"] is False and m["rows"] == 0 and m["rows_skipped"] == 2
    assert (tmp_path / "out/models/swift/model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
