"""HOPE's distilled hindsight proposer (tasks/proposer.py): the reply renderer's round trip through
each environment's proposer parser, the SFT example's loss mask, and the stage on scripted games
whose counterfactuals an expert plays on (so some regenerations win and some lose)."""
from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

import tasks.proposer as stage
from conftest import tiny_params, twenty_questions
from envs import registry
from envs.base import Counterfactual, Environment
from envs.car_dealer.format import api_body, render_api, render_reply, reply_body
from envs.car_dealer.tools import ApiCall
from envs.reason_question import render_action
from storage.parquet import read_table, write_table
from storage.schema import from_table, to_table
from tasks.params import Params
from tasks.regenerate import splice_all
from tasks.relabel import run_relabel
from tasks.rollout import ScriptedAgent, derive_seed, new_episode, play
from tasks.summarize import run_summarize
from tasks.train.sft import IGNORE, tokenize_chats

NOISE = {"p_random": 0.3, "p_repeat": 0.1, "p_early_guess": 0.1}


def question(reason: str, q: str, rationale: str) -> Counterfactual:
    return Counterfactual(render_action(reason, q), q, reason, rationale)


# ---- the reply renderer ----


@pytest.mark.parametrize("name", ["twenty_questions", "guess_my_city"])
def test_question_game_replies_parse_back_to_the_same_counterfactuals(name):
    env = registry.make(name, {})
    task = env.tasks("train")[0]
    proposals = [
        question("Nothing is known yet.", "Is it in Asia?" if name == "guess_my_city" else "Is it alive?", f"The secret is {task.name}; this splits the rest."),
        question("A second  way to split.", "Is it big?", "Hindsight: it is."),  # whitespace the parser normalises
    ]
    request = env.proposer_request(task, [], 2, "The player lost.")
    back = request.parse(env.proposer_reply(proposals))
    assert [(c.action, c.reason, c.rationale) for c in back] == [(p.action, " ".join(p.reason.split()), p.rationale) for p in proposals]
    assert back[0] == proposals[0] and back[1].text == render_action("A second way to split.", "Is it big?")
    # What the parser refuses stays refused when rendered: the stage leaves such a counterfactual out.
    leaky = question(f"Only {task.name} fits.", "Is it alive?", "t")
    with pytest.raises(ValueError, match="names the hidden"):
        request.parse(env.proposer_reply([leaky]))
    with pytest.raises(ValueError, match="no proposals"):
        env.proposer_reply([])


def test_car_dealer_replies_parse_back_to_the_same_calls_and_offers():
    env = registry.make("car_dealer", {})
    b = env.task("1_Volkswagen_van_65000")
    ep = new_episode(env, b, 0)
    play([ep], ScriptedAgent(lambda rng: env.policies(NOISE)["expert"]), 0, "test")
    turns = ep.to_row()["turns"]
    calls = [ApiCall.make("search_car_by_type", car_type="van"), ApiCall.make("search_car_that_have_features", features=["backup camera", "sunroof"]), ApiCall("no_op")]
    api = [Counterfactual(render_api(f"reason {i}", c), api_body(c), f"reason {i}", f"teacher {i}") for i, c in enumerate(calls)]
    assert env.proposer_request(b, turns[:2], 3, "s").parse(env.proposer_reply(api)) == api
    car = env.dealership(b, turns[:3]).listing.cars[1]
    offers = [
        Counterfactual(render_reply("the priciest van", "It is $70,000.", 2, car), reply_body("It is $70,000.", 2, car), "the priciest van", "t"),
        Counterfactual(render_reply("ask first", "What do you need?", 0, None), reply_body("What do you need?", 0, None), "ask first", "t2"),
    ]
    assert env.proposer_request(b, turns[:3], 2, "s").parse(env.proposer_reply(offers)) == offers


def test_an_environment_without_the_format_says_so():
    with pytest.raises(NotImplementedError, match="has no LLM proposer reply format"):
        Environment.proposer_reply(twenty_questions(), [])


def test_the_loss_mask_covers_exactly_the_reply(tiny_model_dir):
    env, tok = twenty_questions(8), AutoTokenizer.from_pretrained(tiny_model_dir)
    task = env.tasks("train")[0]
    prefix = [{"action": "Is it alive?", "observation": "No", "reason": "r", "reward": -1.0}]
    proposals = [question("Not alive.", "Is it big?", "t"), question("Not alive.", "Is it made of metal?", "u")]
    chat = stage.conversation(env, task, prefix, "The player lost.", proposals)
    assert chat[:2] == env.proposer_request(task, prefix, 2, "The player lost.").messages and chat[2]["role"] == "assistant"
    (ex,) = tokenize_chats(tok, [chat], 10**6).examples
    first = next(i for i, t in enumerate(ex["labels"]) if t != IGNORE)
    assert tok.decode(ex["labels"][first:], skip_special_tokens=False) == env.proposer_reply(proposals) + tok.eos_token
    assert ex["labels"][first:] == ex["input_ids"][first:] and all(t == IGNORE for t in ex["labels"][:first])
    assert tok.decode(ex["input_ids"][:first]).count("Is it alive?") == 1  # the prompt: the prefix, never in the loss


# ---- the stage on a small chain ----


@pytest.fixture(scope="module")
def chain(tmp_path_factory, tiny_model_dir):
    """Noisy scripted games, oracle summaries and relabels, regenerations an expert plays on from
    each counterfactual; one counterfactual the parser refuses and one of a missing trajectory
    added; and the tiny model with room for the proposer's prompts (its BPE spends ~1300 tokens
    on one; rotary positions have no table to grow)."""
    d = tmp_path_factory.mktemp("proposer")
    params = Params.model_validate(tiny_params({"relabel": {"k": 2, "t": 2, "n": 2}}))
    env = twenty_questions(params.env.max_turns)
    policies = env.policies(NOISE)
    eps = [new_episode(env, task, derive_seed("proposer", task.id, k)) for task in env.tasks("train")[:6] for k in range(2)]
    play(eps, ScriptedAgent(lambda rng: policies["noisy"]), 0, "logged")
    write_table(to_table([e.to_row() for e in eps], "trajectories"), d / "collect.parquet", "trajectories")
    run_summarize(params, d / "collect.parquet", d)
    run_relabel(params, d / "collect.parquet", d / "summaries.parquet", d / "relabel")
    parents = {t["trajectory_id"]: t for t in from_table(read_table(d / "collect.parquet"))}
    rows = read_table(d / "relabel/relabels.parquet").to_pylist()
    regen = splice_all(params, [(parents[r["trajectory_id"]], r) for r in rows if r["status"] == "ok"])
    play(regen, ScriptedAgent(lambda rng: policies["expert"]), 0, "regenerate")
    write_table(to_table([e.to_row() for e in regen], "trajectories"), d / "regenerate.parquet", "trajectories")
    assert 0 < sum(e.game.success for e in regen) < len(regen)
    secret = parents[rows[0]["trajectory_id"]]["task_id"]
    leak = {**rows[0], "relabel_id": "leaky", "rank": 9, "player_reason": f"Only {secret} fits.", "counterfactual_text": render_action(f"Only {secret} fits.", rows[0]["counterfactual_action"] + " really")}
    leak["counterfactual_action"] += " really"
    orphan = {**rows[1], "relabel_id": "orphan", "trajectory_id": "no-such-trajectory"}
    write_table(to_table(rows + [leak, orphan], "relabels"), d / "relabels.parquet", "relabels")
    shutil.copytree(tiny_model_dir, d / "base")
    config = json.loads((d / "base/config.json").read_text())
    (d / "base/config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return d


def stage_params(d, **proposer) -> Params:
    return Params.model_validate(tiny_params({
        "proposer": {"base_model": str(d / "base"), "batch_size": 4, "heldout_share": 0.25, "learning_rate": 3e-3, "success_learning_rate": 3e-4, **proposer},
        "roles": {"proposer": {"backend": "oracle", "sampling": {"max_new_tokens": 32}, "parse_attempts": 1}},
    }))


def run(d, out, regenerations="regenerate.parquet", **proposer) -> dict:
    return stage.run_proposer(stage_params(d, **proposer), d / "relabels.parquet", [d / "collect.parquet", d / regenerations], d / "summaries.parquet", out)


@pytest.fixture(scope="module")
def trained(chain, tmp_path_factory):
    """The stage run once, with what each training phase was given recorded."""
    phases = []

    def recording(model, tokenizer, examples, **kwargs):
        phases.append({"examples": examples, **kwargs})
        return train_sft(model, tokenizer, examples, **kwargs)

    train_sft = stage.train_sft
    out = tmp_path_factory.mktemp("trained")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stage, "train_sft", recording)
        metrics = run(chain, out)
    return out, metrics, phases


def test_sites_and_phases_follow_the_relabels_and_regenerations(chain, trained, tiny_model_dir):
    out, m, phases = trained
    env, tok = twenty_questions(8), AutoTokenizer.from_pretrained(tiny_model_dir)
    ok = [r for r in read_table(chain / "relabel/relabels.parquet").to_pylist() if r["status"] == "ok"]
    sites = {(r["trajectory_id"], r["branch_turn"]) for r in ok}
    won = {t["relabel_id"] for t in read_table(chain / "regenerate.parquet").to_pylist() if t["success"]}
    held = {s for s in sites if stage.heldout(f"{s[0]}:{s[1]}", 0, 0.25)}
    assert m["sites"] == len(sites) and m["counterfactuals"] == len(ok) + 1  # the leaky one; the orphan is quarantined
    assert m["inputs"][str(chain / "relabels.parquet")]["quarantined"] == 1
    assert m["counterfactuals_refused"] == 1 and "names the hidden secret" in m["refused_reasons"][0][1]
    assert m["heldout"]["sites"] == len(held) > 0 and m["heldout"]["calls"]["requests"] == len(held)
    assert m["phases"]["1"]["sites"] == len(sites) - len(held) and m["phases"]["1"]["epochs"] == 2
    trained_on = {s for s in sites if s not in held}
    wins = {s: [r for r in ok if (r["trajectory_id"], r["branch_turn"]) == s and r["relabel_id"] in won] for s in trained_on}
    assert m["phases"]["2"]["sites"] == sum(map(bool, wins.values())) > 0 and m["phases"]["2"]["learning_rate"] == 3e-4

    def replies(phase):
        """Each example's supervised text, parsed back to its actions."""
        texts = [tok.decode([t for t in e["labels"] if t != IGNORE], skip_special_tokens=False).removesuffix(tok.eos_token) for e in phase["examples"]]
        return sorted(tuple(p["question"] for p in json.loads(t.removeprefix("```json\n").removesuffix("\n```"))) for t in texts)

    assert [(p["epochs"], p["learning_rate"]) for p in phases] == [(2, 3e-3), (1, 3e-4)]
    by_site = {s: tuple(r["counterfactual_action"] for r in ok if (r["trajectory_id"], r["branch_turn"]) == s) for s in trained_on}
    assert replies(phases[0]) == sorted(by_site.values())  # every training site, all its counterfactuals, in rank order
    assert replies(phases[1]) == sorted(tuple(r["counterfactual_action"] for r in w) for w in wins.values() if w)  # only the winners
    loss = json.loads((out / "loss.json").read_text())
    assert {e["phase"] for e in loss} == {1, 2} and loss[0]["loss"] > [e for e in loss if e["phase"] == 1][-1]["loss"]


def test_without_a_successful_regeneration_phase_2_is_skipped(chain, tmp_path):
    write_table(to_table([{**t, "success": False} for t in from_table(read_table(chain / "regenerate.parquet"))], "trajectories"), chain / "lost.parquet", "trajectories")
    m = run(chain, tmp_path, regenerations="lost.parquet", heldout_share=0.0)
    assert m["phases"]["2"] == {"sites": 0, "skipped": "no training site has a counterfactual whose regeneration succeeded"}
    assert m["heldout"] == {"sites": 0} and m["phases"]["1"]["sites"] == m["sites"]


def test_no_site_to_train_on_keeps_the_base_model_and_says_why(chain, tmp_path):
    """As the actor without pairs: the base model stays the proposer, and metrics say why."""
    import torch
    from transformers import AutoModelForCausalLM

    rows = [{**r, "status": "failed", "reason": "x"} for r in read_table(chain / "relabels.parquet").to_pylist()]
    write_table(to_table(rows, "relabels"), tmp_path / "relabels.parquet", "relabels")
    params = stage_params(chain)
    m = stage.run_proposer(params, tmp_path / "relabels.parquet", [chain / "collect.parquet"], chain / "summaries.parquet", tmp_path / "out")
    assert m["untrained"].startswith(f"{tmp_path / 'relabels.parquet'}: no relabel site to train the proposer on (0 ok counterfactuals")
    assert m["phases"] == {"1": {"sites": 0, "skipped": "no site"}, "2": {"sites": 0, "skipped": "no site"}}
    saved, base = (AutoModelForCausalLM.from_pretrained(d) for d in (tmp_path / "out/model", params.proposer.base_model))
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), base.state_dict().values()))


def test_a_rerun_writes_the_same_model(chain, trained, tmp_path):
    out, m, _ = trained
    again = run(chain, tmp_path)
    assert (tmp_path / "model/model.safetensors").read_bytes() == (out / "model/model.safetensors").read_bytes()
    assert (tmp_path / "loss.json").read_bytes() == (out / "loss.json").read_bytes()
    assert {**again, "seconds": 0} == {**m, "seconds": 0}


def test_the_model_serves_as_the_proposer_role(chain, trained, tmp_path):
    out, _, _ = trained
    role = {"backend": "hf", "model": str(out / "model"), "sampling": {"max_new_tokens": 32}, "parse_attempts": 1, "max_failure_rate": 1.0}
    p = Params.model_validate(tiny_params({"roles": {"proposer": role}, "relabel": {"k": 2, "t": 2, "n": 2}}))
    m = run_relabel(p, chain / "collect.parquet", chain / "summaries.parquet", tmp_path)
    rows = read_table(tmp_path / "relabels.parquet").to_pylist()
    assert m["calls"]["requests"] == m["timesteps"] > 0 and len(rows) >= m["timesteps"]
    assert {r["proposer"].split("@")[0] for r in rows} == {"hf:model"}
