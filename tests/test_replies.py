"""Replies of no use (empty, cut short, unparseable) from the policy or an LLM role are recorded
by the stage that got them in a form the next stage's row checks accept: the chain collect ->
summarize -> relabel -> regenerate -> label -> standardize -> train, on real tiny models forced
to give such replies, quarantines none of the rows a stage of ours wrote."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import tiny_params, twenty_questions
from envs.base import EMPTY_REPLY
from envs.twenty_questions.format import ActionParseError, parse_action
from envs.twenty_questions.kb import load_kb
from envs.twenty_questions.env import Scripted
from envs.twenty_questions.policies import NoisyPolicy
from models.base import SamplingParams
from models.hf import HFGenerator
from storage.parquet import read_table, write_table
from storage.schema import to_table
from storage.validate import read_checked
from tasks.buffer import run_buffer
from tasks.collect import run_collect
from tasks.actor import run_actor
from tasks.critic import run_critic
from tasks.evaluate import run_evaluate
from tasks.label import run_label
from tasks.params import Params
from tasks.regenerate import run_regenerate
from tasks.relabel import run_relabel
from tasks.rollout import ScriptedAgent, derive_seed, new_episode, play
from tasks.standardize import run_standardize
from tasks.summarize import run_summarize
from tasks.train import run_train

KB = load_kb()
MAX_TURNS = 8


@pytest.fixture(scope="module")
def silent_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model made to end every reply at once: its layers add nothing to the residual
    stream, every token embeds along one direction, and the end-of-sequence token's (tied)
    embedding lies far along it, so the end token's logit tops every other by a wide margin."""
    out = tmp_path_factory.mktemp("silent") / "model"
    shutil.copytree(tiny_model_dir, out)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert model.config.tie_word_embeddings
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings = model.model.embed_tokens.weight
        embeddings.mul_(0.01).add_(1.0)
        embeddings[model.config.eos_token_id] = 5.0
    model.save_pretrained(out)
    return out


def chain_params(model_dir: Path, max_new_tokens: int, roles: dict | None = None, relabel: dict | None = None, critic: Path | None = None) -> Params:
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": max_new_tokens}
    raw = tiny_params({
        "env": {"max_turns": MAX_TURNS},
        "roles": {"policy": {"model": str(model_dir)}, **(roles or {})},
        "collect": {"splits": ["train"], "m": 2, "limit_tasks": 3, "sampling": sampling},
        "relabel": {"k": 2, "t": 1, "n": 2, **(relabel or {})},
        "regenerate": {"sampling": sampling},
        "train": {"base_model": str(model_dir), "epochs": 1, "batch_size": 4},
        "critic": {"base_model": str(model_dir)},
        "actor": {"base_model": str(model_dir), "prompts": 8, "rounds": 2, "batch_size": 4, "sampling": sampling},
        # best-of-N picks with the chain's critic and evaluate plays its actor (run_chain trains
        # both, under the critic's folder's parent), or neither is played
        "evaluate": {
            "best_of_n": {"critic": str(critic), "policies": ["bootstrap"]} if critic else {"policies": []},
            "actor": str(critic.parent.parent / "actor/model") if critic else None,
            "stepagent": None,  # the chain has no StepAgent stages
        },
    })
    raw["train"]["methods"] = {"refit": {"algorithm": "refit"}, "swift": {"algorithm": "swift"}}
    return Params.model_validate(raw)


def assert_nothing_quarantined(stage: str, metrics: dict, out_dir: Path) -> None:
    """Every input row kept (rows in = rows kept) and an empty quarantine table."""
    for path, c in metrics["inputs"].items():
        assert c["quarantined"] == 0 and c["kept"] == c["rows_in"], f"{stage} quarantined rows of {path}: {c}"
    quarantine = read_table(out_dir / "quarantine.parquet", "quarantine")
    assert quarantine.num_rows == 0, f"{stage}: {quarantine.to_pylist()}"


def run_chain(params: Params, model_dir: Path, out: Path) -> dict[str, dict]:
    """Every stage from collect to train on the policy `model_dir`, each checked as it reads the
    one before; returns each stage's metrics."""
    m = {"collect": run_collect(params, model_dir, out / "collect")}
    trajectories = out / "collect" / "trajectories.parquet"
    m["summarize"] = run_summarize(params, trajectories, out / "summarize")
    m["relabel"] = run_relabel(params, trajectories, out / "summarize" / "summaries.parquet", out / "relabel")
    m["regenerate"] = run_regenerate(params, trajectories, out / "relabel" / "relabels.parquet", model_dir, out / "regenerate")
    both = [trajectories, out / "regenerate" / "trajectories.parquet"]
    m["label"] = run_label(params, both, out / "label")
    m["standardize"] = run_standardize(params, both, out / "label" / "labels.parquet", out / "standardize")
    m["train"] = run_train(params, out / "standardize" / "train.parquet", out / "train")
    m["buffer"] = run_buffer(params, both, out / "buffer")
    m["critic"] = run_critic(params, out / "buffer" / "pairs.parquet", out / "critic")
    actor = params.model_copy(update={"actor": params.actor.model_copy(update={"critic": str(out / "critic" / "model")})})
    m["actor"] = run_actor(actor, out / "buffer" / "pairs.parquet", both, out / "summarize" / "summaries.parquet", out / "actor")
    for stage in ("summarize", "relabel", "regenerate", "label", "standardize", "train", "buffer", "critic", "actor"):
        assert_nothing_quarantined(stage, m[stage], out / stage)
    # Rows in = rows out, stage after stage.
    n = m["collect"]["trajectories"]
    assert m["summarize"]["trajectories"] == n
    assert m["regenerate"]["regenerations"] == m["regenerate"]["relabels"] == m["relabel"]["relabels"] > 0
    assert m["label"]["labels"] == n + m["regenerate"]["regenerations"]
    assert m["standardize"]["rows_in"] == m["label"]["labels"] == m["standardize"]["rows_out"] + m["standardize"]["rows_other_splits"]
    assert m["train"]["rows"] == m["standardize"]["rows_out"]
    return m


def replies(path: Path) -> list[str]:
    return [msg["content"] for row in read_table(path, "trajectories").to_pylist() for msg in row["messages"] if msg["role"] == "assistant"]


def unparseable(text: str) -> bool:
    try:
        parse_action(text)
    except ActionParseError:
        return True
    return False


def test_the_silent_model_ends_every_reply_at_once(silent_model_dir):
    gen = HFGenerator(silent_model_dir, batch_size=8)
    prompts = [new_episode(twenty_questions(MAX_TURNS), task, 0).messages for task in KB.split("train")[:4]]
    assert [c.text for c in gen.generate(prompts, SamplingParams(1.0, 1.0, 24), [1, 2, 3, 4])] == [""] * 4


def test_empty_replies_are_recorded_as_the_marker_and_pass_every_stage(silent_model_dir, tmp_path):
    m = run_chain(chain_params(silent_model_dir, 24), silent_model_dir, tmp_path)
    for path in (tmp_path / "collect/trajectories.parquet", tmp_path / "regenerate/trajectories.parquet"):
        rows = read_table(path, "trajectories").to_pylist()
        for row in rows:
            # Every policy turn (all but a regeneration's spliced counterfactual) is the empty
            # reply: an invalid action that costs its turn and is answered "unknown".
            own = [t for t in row["turns"] if t["turn"] != row["branch_turn"]]
            assert own and all(t["action"] == EMPTY_REPLY and t["reason"] == "" and t["observation"] == "unknown" and t["reward"] == -1.0 for t in own)
            assert all(row["messages"][2 + 2 * t["turn"]]["content"] == EMPTY_REPLY for t in own)
            assert row["num_turns"] == MAX_TURNS and not row["success"]
    assert m["collect"]["train"]["parse_failure_rate"] == 1.0
    # The same replies give the same rows: the content hashes are deterministic.
    again = run_collect(chain_params(silent_model_dir, 24), silent_model_dir, tmp_path / "again")
    assert again["trajectories"] == m["collect"]["trajectories"]
    assert (tmp_path / "again/trajectories.parquet").read_bytes() == (tmp_path / "collect/trajectories.parquet").read_bytes()
    # evaluate records its episodes the same way: every policy's rows pass the trajectory checks.
    e = run_evaluate(chain_params(silent_model_dir, 24, critic=tmp_path / "critic/model"), tmp_path / "train", tmp_path / "evaluate")
    assert "bootstrap+best_of_4" in e["policies"] and "actor" in e["policies"]
    assert m["actor"]["untrained"].startswith("no pair to train on")  # every candidate is the empty reply: all tie
    kept, quarantine = read_checked(tmp_path / "evaluate/episodes.parquet", "trajectories")
    assert quarantine.num_rows == 0 and kept.num_rows == sum(p["heldout"]["episodes"] for p in e["policies"].values()) > 0
    assert set(replies(tmp_path / "evaluate/episodes.parquet")) == {EMPTY_REPLY}


@pytest.mark.parametrize("max_new_tokens", [1, 24], ids=["cut_short", "unparseable"])
def test_cut_short_and_unparseable_replies_pass_every_stage(tiny_model_dir, tmp_path, max_new_tokens):
    m = run_chain(chain_params(tiny_model_dir, max_new_tokens), tiny_model_dir, tmp_path)
    texts = replies(tmp_path / "collect/trajectories.parquet") + replies(tmp_path / "regenerate/trajectories.parquet")
    policy = [t for t in texts if not t.startswith("REASON:")]  # the spliced counterfactuals parse
    assert policy and all(unparseable(t) for t in policy)
    assert m["collect"]["train"]["parse_failure_rate"] == 1.0
    if max_new_tokens == 1:
        # One token each (re-encoding decoded bytes need not give it back, so lengths are compared).
        tokenizer = HFGenerator(tiny_model_dir, batch_size=1).tokenizer
        longest = max(len(tokenizer.decode([i])) for i in range(len(tokenizer)))
        assert all(len(t) <= longest for t in policy if t != EMPTY_REPLY)


# --- LLM roles that answer nothing -------------------------------------------------------------


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> Path:
    """Scripted trajectories: 2 per task on 3 train tasks."""
    out = tmp_path_factory.mktemp("logged")
    eps = [new_episode(twenty_questions(MAX_TURNS), task, derive_seed("replies", task.name, k)) for task in KB.split("train")[:3] for k in range(2)]
    play(eps, ScriptedAgent(lambda rng: Scripted(NoisyPolicy(0.4, 0.2, 0.1))), 0, "logged")
    write_table(to_table([e.to_row() for e in eps], "trajectories"), out / "trajectories.parquet", "trajectories")
    return out / "trajectories.parquet"


def silent_role(model_dir: Path, **extra) -> dict:
    return {"backend": "hf", "model": str(model_dir), "sampling": {"max_new_tokens": 8}, "parse_attempts": 1, "max_failure_rate": 1.0, **extra}


def test_an_empty_summary_is_an_invalid_row_relabel_reads_and_skips(silent_model_dir, logged, tmp_path):
    params = chain_params(silent_model_dir, 24, roles={"summarizer": silent_role(silent_model_dir)})
    m = run_summarize(params, logged, tmp_path)
    rows = read_table(tmp_path / "summaries.parquet", "summaries").to_pylist()
    assert m["not_summarized"] == len(rows) == 6
    assert all(r["status"] == "invalid" and r["summary"] is None and "empty summary" in r["reason"] for r in rows)
    r = run_relabel(params, logged, tmp_path / "summaries.parquet", tmp_path / "relabel")
    assert_nothing_quarantined("relabel", r, tmp_path / "relabel")
    assert r["skipped_no_summary"] == 6 and r["relabels"] == 0


@pytest.mark.parametrize("mode", ["hope", "hr"])
def test_an_empty_counterfactual_is_an_invalid_row_regenerate_reads_and_skips(silent_model_dir, logged, tmp_path, mode):
    params = chain_params(silent_model_dir, 24, roles={"proposer": silent_role(silent_model_dir)}, relabel={"mode": mode})
    run_summarize(params, logged, tmp_path)  # the oracle summarizer
    m = run_relabel(params, logged, tmp_path / "summaries.parquet", tmp_path)
    rows = read_table(tmp_path / "relabels.parquet", "relabels").to_pylist()
    assert rows and m["relabels"] == 0 and m["not_proposed"] == len(rows)
    assert all(r["status"] == "invalid" and r["counterfactual_text"] is None and r["reason"] for r in rows)
    g = run_regenerate(params, logged, tmp_path / "relabels.parquet", silent_model_dir, tmp_path / "regen")
    assert_nothing_quarantined("regenerate", g, tmp_path / "regen")
    assert g["regenerations"] == 0


def test_an_empty_forward_continuation_leaves_the_game_out_and_says_why(silent_model_dir, logged, tmp_path):
    params = chain_params(silent_model_dir, 24, roles={"forward": silent_role(silent_model_dir)})
    run_summarize(params, logged, tmp_path)
    relabels = run_relabel(params, logged, tmp_path / "summaries.parquet", tmp_path)["relabels"]
    g = run_regenerate(params, logged, tmp_path / "relabels.parquet", silent_model_dir, tmp_path / "regen")
    assert relabels and g["regenerations"] == 0 and len(g["forward_failures"]) == relabels
    assert all(f["status"] == "invalid" and "empty continuation" in f["reason"] for f in g["forward_failures"])
    lab = run_label(params, [logged, tmp_path / "regen/trajectories.parquet"], tmp_path / "label")
    assert_nothing_quarantined("label", lab, tmp_path / "label")


@pytest.mark.parametrize("mode", ["few_shot", "rubric"])
def test_an_empty_label_reply_is_a_row_without_reward_standardize_and_train_read(silent_model_dir, logged, tmp_path, mode):
    params = chain_params(silent_model_dir, 24, roles={"labeler": silent_role(silent_model_dir, mode=mode)})
    m = run_label(params, [logged], tmp_path)
    rows = read_table(tmp_path / "labels.parquet", "labels").to_pylist()
    assert m["status"] == {"invalid": 6}
    assert all(r["reward"] is None and r["reason"].startswith("unparseable after 1 attempts") for r in rows)
    s = run_standardize(params, [logged], tmp_path / "labels.parquet", tmp_path / "standardize")
    assert_nothing_quarantined("standardize", s, tmp_path / "standardize")
    assert s["rows_out"] == 6 and s["status"] == {"no_reward": 6}
    t = run_train(params, tmp_path / "standardize/train.parquet", tmp_path / "train")
    assert_nothing_quarantined("train", t, tmp_path / "train")
    assert t["rows"] == 6 and not any(method["trained"] for method in t["methods"].values())


def test_an_empty_simulator_answer_is_heard_as_unknown_and_the_rows_pass(silent_model_dir, tiny_model_dir, tmp_path):
    params = chain_params(tiny_model_dir, 24, roles={"simulator": silent_role(silent_model_dir)})
    m = run_collect(params, tiny_model_dir, tmp_path / "collect")
    rows = read_table(tmp_path / "collect/trajectories.parquet", "trajectories").to_pylist()
    assert m["simulator_calls"]["invalid"] == m["simulator_calls"]["requests"] > 0
    assert all(t["observation"] == "unknown" for r in rows for t in r["turns"])
    s = run_summarize(params, tmp_path / "collect/trajectories.parquet", tmp_path / "summarize")
    assert_nothing_quarantined("summarize", s, tmp_path / "summarize")


def test_an_empty_reply_asks_the_simulator_nothing(silent_model_dir, tiny_model_dir, tmp_path):
    """The environment answers an empty reply "unknown" itself: an LLM simulator has no question
    to answer, and would only make one up."""
    params = chain_params(silent_model_dir, 24, roles={"simulator": silent_role(tiny_model_dir)})
    m = run_collect(params, silent_model_dir, tmp_path)
    rows = read_table(tmp_path / "trajectories.parquet", "trajectories").to_pylist()
    assert m["simulator_calls"]["requests"] == 0
    assert all(t["action"] == EMPTY_REPLY and t["observation"] == "unknown" for r in rows for t in r["turns"])
