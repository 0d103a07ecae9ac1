"""StepAgent (tasks/expert.py, tasks/practice.py, tasks/train/stepagent_implicit.py, tasks/stepagent.py):
the expert's trajectories as data, prefixes and practice pairs on hand-made trajectories, the
step-level DPO's masks and loss on a hand-computed case, the stage lowering its loss on its pairs,
and evaluate playing its policy."""
from __future__ import annotations

import json
import math
from pathlib import Path

import polars as pl
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import ROOT, tiny_params, twenty_questions
from storage.parquet import read_table, write_table
from storage.schema import chat_message, from_table, to_table, trajectory_id
from tasks.expert import run_expert
from tasks.params import Params, ParamsError
from tasks.practice import compare, drawn, prefixes, run_practice
from tasks.stepagent import run_stepagent
from tasks.train import online_dpo, stepagent_implicit
from tasks.train.sft import IGNORE, PadCollator

SYSTEM = {"role": "system", "content": "You play twenty questions."}


def say(text: str) -> dict:
    return {"role": "user", "content": text}


def act(reason: str, question: str) -> dict:
    return {"role": "assistant", "content": f"REASON: {reason}\nQUESTION: {question}"}


# A hand-made expert game of 3 actions: 3 prefixes (Eq. 4).
GAME = [
    SYSTEM, say("Turn 1 of 8. Ask a yes-no question."),
    act("Ask about animal.", "Is it an animal?"), say("Answer: yes. Known: animal. Turn 2 of 8."),
    act("Ask about pet.", "Is it a pet?"), say("Answer: yes. Known: animal, pet. Turn 3 of 8."),
    act("Only Dog fits.", "Is it Dog?"), say("Answer: yes. You found it."),
]


def params(overrides: dict | None = None) -> Params:
    return Params.model_validate(tiny_params(overrides))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def game_row(messages: list[dict], task_id: str, success: bool | None = True, **extra) -> dict:
    return {"messages": messages, "task_id": task_id, "env": "twenty_questions", **({"success": success} if success is not None else {}), **extra}


# ---- the expert's trajectories ----------------------------------------------------------------


def test_the_expert_stage_writes_the_environments_expert_games_failed_ones_flagged(tmp_path):
    p = params({"expert": {"limit_tasks": 3, "m": 2}})
    m = run_expert(p, tmp_path / "a")
    rows = from_table(read_table(tmp_path / "a/trajectories.parquet", "trajectories"))
    assert len(rows) == m["trajectories"] == 3 * 2 and m["tasks"] == 3
    assert {r["policy_id"] for r in rows} == {"scripted:expert"} and {r["split"] for r in rows} == {"train"}
    assert {r["source"] for r in rows} == {"policy"}
    # 8 turns (the tiny env) are too few for some of the expert's games: kept, flagged, counted
    assert m["successes"] + m["failures"] == 6 and m["failures"] == sum(r["success"] is False for r in rows) > 0
    assert m["steps"] == sum(r["num_turns"] for r in rows) and m["success_unknown"] == 0
    # the expert's own moves: its scripted policy replayed on the same game chooses each action again
    env = p.env.environment()
    expert = env.policies(p.bootstrap.noisy.model_dump())["expert"]
    from tasks.rollout import ScriptedAgent, new_episode, play
    again = play([new_episode(env, env.task(rows[0]["task_id"]), rows[0]["seed"])], ScriptedAgent(lambda rng: expert), 0, "again")
    assert again[0].messages == rows[0]["messages"]
    run_expert(p, tmp_path / "b")  # seeded: the same bytes
    assert (tmp_path / "a/trajectories.parquet").read_bytes() == (tmp_path / "b/trajectories.parquet").read_bytes()


@pytest.mark.parametrize("env", ["guess_my_city", "car_dealer", "persuasion"])
def test_every_shipped_environments_expert_plays(env, tmp_path):
    m = run_expert(params({"env": {"name": env}, "expert": {"limit_tasks": 2}}), tmp_path)
    assert m["trajectories"] == 2 and m["steps"] > 0


def test_imported_expert_trajectories_go_through_the_import_path_and_practice_skips_the_failed(tiny_model_dir, tmp_path, capsys):
    source = write_jsonl(tmp_path / "experts.jsonl", [
        game_row(GAME, "dog"),
        game_row(GAME[:4], "cat", success=False),
        game_row(GAME, "dog", env="persuasion"),
        game_row(GAME, "dog", split="val"),
        {"task_id": "dog", "env": "twenty_questions"},  # no messages
    ])
    p = params({"expert": {"source": str(source)}, "practice": {"model": str(tiny_model_dir), "k": 1, "prefixes": None}})
    m = run_expert(p, tmp_path / "expert")
    assert m["source"]["rows_in"] == 5 and m["trajectories"] == 2 and (m["successes"], m["failures"]) == (1, 1)
    quarantine = read_table(tmp_path / "expert/quarantine.parquet", "quarantine").to_pylist()
    assert [(q["row"], q["field"]) for q in quarantine] == [(3, "env"), (4, "split"), (5, "messages")]
    assert "'persuasion', but the run's environment is 'twenty_questions'" in quarantine[0]["reason"]
    assert "'val' is not in expert.splits (train)" in quarantine[1]["reason"]
    practised = run_practice(p, tmp_path / "expert/trajectories.parquet", tmp_path / "practice")
    assert practised["expert_trajectories"] == {"in": 2, "used": 1, "skipped_failed": 1, "success_unknown": 0, "quarantined": 0}
    assert practised["prefixes"] == {"all": 3, "drawn": 3} and practised["samples"] == 3
    assert "1 of 2 expert trajectories failed and are skipped" in capsys.readouterr().out
    with pytest.raises(ParamsError, match="expert.source .*missing.jsonl: no such file"):
        run_expert(params({"expert": {"source": str(tmp_path / "missing.jsonl")}}), tmp_path / "none")


def test_an_environment_without_an_expert_is_told_to_import_one(tmp_path, monkeypatch):
    from envs.twenty_questions.env import TwentyQuestions

    monkeypatch.setattr(TwentyQuestions, "policies", lambda self, noise: {"noisy": None})
    with pytest.raises(ParamsError, match="offers no scripted expert policy \\(it offers noisy\\); import expert trajectories instead with expert.source"):
        run_expert(params(), tmp_path)


# ---- inspection and practice ------------------------------------------------------------------


def test_a_trajectory_of_n_actions_is_cut_into_its_n_prefixes():
    cut = prefixes({"trajectory_id": "t", "task_id": "dog", "split": "train", "messages": GAME})
    assert [c["step"] for c in cut] == [0, 1, 2]
    assert [c["prompt"] for c in cut] == [GAME[:2], GAME[:4], GAME[:6]]  # each state ends on the observation before the action
    assert [c["expert"] for c in cut] == [GAME[2], GAME[4], GAME[6]]
    # a draw keeps a prefix by its own key: a larger draw keeps a smaller one's
    many = [{"trajectory_id": f"t{i}", "step": s} for i in range(10) for s in range(3)]
    assert drawn(many, None, 0) == many and len(drawn(many, 7, 0)) == 7
    assert all(x in drawn(many, 12, 0) for x in drawn(many, 7, 0)) and drawn(many, 7, 0) != drawn(many, 7, 1)


def test_equal_flags_follow_the_environments_normalisation_or_the_text():
    env = twenty_questions(8)
    expert = GAME[4]["content"]  # Is it a pet?
    cases = {
        expert: (True, True, True),  # identical
        "REASON: Pets next.\nQUESTION:   is it a PET? ": (True, False, False),  # the same move, worded otherwise
        "REASON: Ask about pet.\nQUESTION: Is it a vehicle?": (False, False, False),  # another move
        "Is it a pet?": (False, False, False),  # does not parse: never the same move
    }
    for agent, (by_action, identical, by_text) in cases.items():
        equal, same_text, expert_move, agent_move = compare(env, expert, agent, "action")
        assert (equal, same_text) == (by_action, identical), agent
        assert compare(env, expert, agent, "text")[0] == by_text, agent
        assert expert_move == "Is it a pet?" and (agent_move is None) == (agent == "Is it a pet?")


@pytest.fixture(scope="module")
def practised(tiny_model_dir, tmp_path_factory):
    """Two hand-made expert games (3 + 2 actions) practised by the tiny model, 2 samples a prefix."""
    d = tmp_path_factory.mktemp("practice")
    other = [SYSTEM, say("Turn 1 of 8."), act("Ask about food.", "Is it food?"), say("Answer: yes."), act("Only Pear fits.", "Is it Pear?"), say("You found it.")]
    source = write_jsonl(d / "experts.jsonl", [game_row(GAME, "dog"), game_row(other, "pear")])
    p = params({"expert": {"source": str(source)}, "practice": {"model": str(tiny_model_dir), "k": 2, "prefixes": None,
                                                                 "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 12}}})
    run_expert(p, d / "expert")
    m = run_practice(p, d / "expert/trajectories.parquet", d / "practice")
    return p, d, m


def test_practice_samples_k_actions_at_every_prefix_without_playing_them(practised, tiny_model_dir, tmp_path):
    p, d, m = practised
    rows = read_table(d / "practice/pairs.parquet", "practice").to_pylist()
    experts = {t["trajectory_id"]: t for t in from_table(read_table(d / "expert/trajectories.parquet", "trajectories"))}
    assert len(rows) == m["samples"] == 5 * 2 and m["prefixes"] == {"all": 5, "drawn": 5}
    assert len({r["pair_id"] for r in rows}) == 10 and {(r["step"], r["sample"]) for r in rows if r["task_id"] == "dog"} == {(s, j) for s in range(3) for j in range(2)}
    env = p.env.environment()
    for r in rows:
        messages = experts[r["trajectory_id"]]["messages"]
        at = [i for i, x in enumerate(messages) if x["role"] == "assistant"][r["step"]]
        assert [chat_message(x) for x in r["prompt"]] == messages[:at] and chat_message(r["expert"]) == messages[at]
        assert r["status"] == "ok" and r["agent"]["role"] == "assistant" and r["policy_id"].startswith("model@")
        equal, identical, *_ = compare(env, r["expert"]["content"], r["agent"]["content"], "action")
        assert (r["equal"], r["identical"]) == (equal, identical)
    assert m["equal"] == sum(r["equal"] for r in rows) and m["pairs"] == 10 - m["equal"]
    # log pi(a|s) of the practising policy, over the action's tokens: computed again here
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    r = rows[3]
    for side in ("expert", "agent"):
        enc, _ = online_dpo.encode(tok, [chat_message(x) for x in r["prompt"]], chat_message(r[side]), 1024)
        batch = PadCollator(tok.pad_token_id)([enc])
        with torch.no_grad():
            expected = online_dpo.sequence_logps(model, batch["input_ids"], batch["attention_mask"], batch["labels"]).item()
        assert r[f"{side}_logp"] == pytest.approx(expected, abs=1e-4)
    # seeded: a rerun, with an empty response cache, writes the same bytes
    p = p.model_copy(update={"cache": p.cache.model_copy(update={"path": str(tmp_path / "cache.sqlite")})})
    run_practice(p, d / "expert/trajectories.parquet", tmp_path)
    assert (tmp_path / "pairs.parquet").read_bytes() == (d / "practice/pairs.parquet").read_bytes()


def test_practice_quarantines_expert_trajectories_of_another_environment(tiny_model_dir, tmp_path):
    run_expert(params({"expert": {"limit_tasks": 3}}), tmp_path / "expert")
    rows = from_table(read_table(tmp_path / "expert/trajectories.parquet", "trajectories"))
    rows[0] = {**rows[0], "env": "guess_my_city"}
    rows[0]["trajectory_id"] = trajectory_id(rows[0])  # its content hash, as another environment's table would hold it
    write_table(to_table(rows, "trajectories"), tmp_path / "mixed.parquet", "trajectories")
    m = run_practice(params({"practice": {"model": str(tiny_model_dir), "k": 1, "prefixes": 4,
                                          "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8}}}), tmp_path / "mixed.parquet", tmp_path / "practice")
    counts = m["expert_trajectories"]
    assert counts["quarantined"] == 1 and counts["in"] == 3 == counts["used"] + counts["skipped_failed"] + counts["quarantined"]
    [q] = read_table(tmp_path / "practice/quarantine.parquet", "quarantine").to_pylist()
    assert (q["row"], q["field"]) == (0, "env") and "'guess_my_city', but the run's environment is 'twenty_questions'" in q["reason"]
    assert rows[0]["trajectory_id"] not in set(pl.read_parquet(tmp_path / "practice/pairs.parquet")["trajectory_id"])


def test_a_tool_call_is_practised_as_the_game_at_that_state_records_it(tiny_model_dir, tmp_path):
    """CarDealer's API phase: the agent's text is written as a tool call, by the game restored at the prefix."""
    p = params({"env": {"name": "car_dealer"}, "expert": {"limit_tasks": 1},
                "practice": {"model": str(tiny_model_dir), "k": 1, "prefixes": 6, "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8}}})
    run_expert(p, tmp_path / "expert")
    m = run_practice(p, tmp_path / "expert/trajectories.parquet", tmp_path / "practice")
    rows = read_table(tmp_path / "practice/pairs.parquet", "practice").to_pylist()
    assert m["expert_trajectories"]["quarantined"] == 0 and len(rows) == 6
    calls = [r for r in rows if r["expert"]["tool_calls"]]
    assert calls and all(r["agent"]["tool_calls"] and r["agent"]["tool_calls"][0]["id"] == r["expert"]["tool_calls"][0]["id"] for r in calls)
    assert all(not r["agent"]["tool_calls"] for r in rows if not r["expert"]["tool_calls"])


# ---- StepAgent-Implicit -----------------------------------------------------------------------


def practice_row(prompt: list[dict], expert: dict, agent: dict | None, step: int = 0, sample: int = 0, equal: bool = False) -> dict:
    """A practice table's row; agent None: a sample the backend gave up on."""
    return {
        "pair_id": f"{step}-{sample}", "trajectory_id": "t", "task_id": "dog", "split": "train", "step": step, "sample": sample,
        "prompt": prompt, "expert": expert, "agent": agent or {"role": "assistant", "content": "(empty reply)"},
        "expert_action": None, "agent_action": None,
        "equal": equal, "identical": agent == expert, "status": "ok" if agent else "failed", "reason": None if agent else "gave up",
        "expert_logp": None, "agent_logp": None, "policy_id": "model@x", "seed": 0,
    }


WRONG = act("Ask about pet.", "Is it a car?")


def test_the_mask_and_the_loss_on_a_hand_computed_pair(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [practice_row(GAME[:4], GAME[4], WRONG), practice_row(GAME[:4], GAME[4], GAME[4], sample=1, equal=True), practice_row(GAME[:4], GAME[4], None, sample=2)]
    kept, counts = stepagent_implicit.teaching(rows)
    assert kept == rows[:1] and counts == {"rows": 3, "equal_dropped": 1, "failed_dropped": 1, "kept": 1}
    [(chosen, rejected)], refused, cut = stepagent_implicit.encode(tok, kept, 1024)
    assert refused == [] and cut == 0
    # chosen = the expert's action, rejected = the agent's, each alone under the mask, at the same state
    for enc, action in ((chosen, GAME[4]), (rejected, WRONG)):
        assert tok.decode([t for t in enc["labels"] if t != IGNORE], skip_special_tokens=False) == action["content"] + tok.eos_token
    first = next(i for i, t in enumerate(chosen["labels"]) if t != IGNORE)
    assert chosen["input_ids"][:first] == rejected["input_ids"][:first]
    # Eq. 6 with pi_ref, beta 0.1, on hand numbers: rewards 0.1 * (pi - ref) = (0.2, -0.1): -log s(0.3)
    loss, rc, rr = online_dpo.dpo_loss(torch.tensor([-1.0]), torch.tensor([-4.0]), torch.tensor([-3.0]), torch.tensor([-3.0]), 0.1)
    assert rc.item() == pytest.approx(0.2) and rr.item() == pytest.approx(-0.1)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-0.3)), rel=1e-6)
    # the trainer's loss on that pair, against a reference it has moved from, is the formula's
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for w in model.parameters():
            w.add_(0.05 * torch.randn_like(w))
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    [row] = online_dpo.pair_rows(reference, tok, [(chosen, rejected)])
    batch = online_dpo.PairCollator(tok.pad_token_id)([row])
    trainer = online_dpo.DPOTrainer.__new__(online_dpo.DPOTrainer)
    trainer.beta, trainer._seen = 0.1, []
    with torch.no_grad():
        got = trainer.compute_loss(model, dict(batch)).item()
        pi = online_dpo.sequence_logps(model, batch["input_ids"], batch["attention_mask"], batch["labels"])
    expected = -math.log(1 / (1 + math.exp(-0.1 * ((pi[0].item() - row["ref_chosen"]) - (pi[1].item() - row["ref_rejected"])))))
    assert got == pytest.approx(expected, rel=1e-5) and got != pytest.approx(math.log(2), abs=1e-3)


def pairs_table(path: Path, rows: list[dict]) -> Path:
    write_table(to_table(rows, "practice"), path, "practice")
    return path


def test_the_stage_prefers_the_experts_action_on_its_pairs(tiny_model_dir, tmp_path):
    rows = [practice_row(GAME[:2 * s + 2], GAME[2 * s + 2], WRONG, step=s, sample=j) for s in range(3) for j in range(2)]
    rows += [practice_row(GAME[:2], GAME[2], GAME[2], sample=2, equal=True), practice_row(GAME[:2], GAME[2], None, sample=3)]
    pairs_table(tmp_path / "pairs.parquet", rows)
    p = params({"stepagent": {"base_model": str(tiny_model_dir), "epochs": 4, "batch_size": 2, "learning_rate": 3e-3, "bf16": False}})
    m = run_stepagent(p, tmp_path / "pairs.parquet", tmp_path / "out")
    assert (m["pairs"], m["equal_dropped"], m["failed_dropped"], m["quarantined"]) == (6, 1, 1, 0)
    assert m["reference_practised"] is False and m["practice_policies"] == ["model@x"]  # hand-made pairs: no policy of these weights practised them
    curve = json.loads((tmp_path / "out/loss.json").read_text())
    assert curve[0]["loss"] == pytest.approx(math.log(2), abs=0.05) and curve[-1]["loss"] < 0.5 * math.log(2)
    assert curve[-1]["margin"] > 0 and curve[-1]["accuracy"] == 1.0
    # on the pairs, after training: the expert's action gained on the agent's against pi_ref
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    trained, reference = (AutoModelForCausalLM.from_pretrained(d) for d in (tmp_path / "out/model", tiny_model_dir))
    encoded, _, _ = stepagent_implicit.encode(tok, stepagent_implicit.teaching(rows)[0], 1024)
    batch = PadCollator(tok.pad_token_id)([e for pair in encoded for e in pair])
    with torch.no_grad():
        pi, ref = (online_dpo.sequence_logps(x, batch["input_ids"], batch["attention_mask"], batch["labels"]) for x in (trained, reference))
    margin = ((pi - ref)[0::2] - (pi - ref)[1::2])
    assert (margin > 0).all()
    # seeded: a rerun trains the same weights
    run_stepagent(p, tmp_path / "pairs.parquet", tmp_path / "again")
    assert (tmp_path / "out/model/model.safetensors").read_bytes() == (tmp_path / "again/model/model.safetensors").read_bytes()


def test_with_every_sample_equal_the_policy_is_the_base_and_says_why(tiny_model_dir, tmp_path):
    pairs_table(tmp_path / "pairs.parquet", [practice_row(GAME[:2], GAME[2], GAME[2], equal=True)])
    m = run_stepagent(params({"stepagent": {"base_model": str(tiny_model_dir)}}), tmp_path / "pairs.parquet", tmp_path / "out")
    assert m["pairs"] == 0 and m["untrained"].startswith("no pair to learn from")
    base, kept = (AutoModelForCausalLM.from_pretrained(d).state_dict() for d in (tiny_model_dir, tmp_path / "out/model"))
    assert all(torch.equal(base[k], kept[k]) for k in base)


def test_a_quick_look_limits_the_experts_tasks_and_its_own_limit_wins():
    assert params({"limit_tasks": 2, "expert": {"limit_tasks": None}}).expert.limit_tasks == 2
    assert params({"limit_tasks": 2, "expert": {"limit_tasks": 5}}).expert.limit_tasks == 5
    raw = tiny_params({"limit_tasks": 2})
    del raw["expert"]  # a params file without the section: its defaults, limited too
    assert Params.model_validate(raw).expert.limit_tasks == 2


def test_the_variant_is_checked():
    raw = tiny_params()
    raw["stepagent"]["variant"] = "explicit"
    with pytest.raises(ValueError, match="stepagent.variant"):
        Params.model_validate(raw)


# ---- evaluate ---------------------------------------------------------------------------------


def test_evaluate_plays_the_stepagent_policy(tiny_model_dir, tmp_path):
    from tasks.evaluate import run_evaluate

    train = tmp_path / "train"
    for method in tiny_params()["train"]["methods"]:
        (train / "models").mkdir(parents=True, exist_ok=True)
        (train / "models" / method).symlink_to(tiny_model_dir)
    p = params({"train": {"base_model": str(tiny_model_dir)}, "roles": {"policy": {"model": str(tiny_model_dir)}},
                "evaluate": {"actor": None, "stepagent": str(tiny_model_dir), "best_of_n": {"policies": []}}})
    m = run_evaluate(p, train, tmp_path / "evaluate")
    assert list(m["policies"]) == ["bootstrap", *p.train.methods, "stepagent"]
    played = pl.read_parquet(tmp_path / "evaluate/episodes.parquet")
    assert played.filter(pl.col("policy_id").str.starts_with("stepagent:")).height == m["policies"]["stepagent"]["heldout"]["episodes"] > 0
    raw = tiny_params({"evaluate": {"stepagent": None, "best_of_n": {"policies": ["stepagent"]}}})
    with pytest.raises(ValueError, match="stepagent is not a policy evaluate plays"):
        Params.model_validate(raw)


# ---- on ranks ---------------------------------------------------------------------------------


@pytest.mark.system
def test_the_stage_on_two_cpu_ranks_matches_one_process(tiny_model_dir, tmp_path):
    rows = [practice_row(GAME[:2 * s + 2], GAME[2 * s + 2], WRONG, step=s, sample=j) for s in range(3) for j in range(2)]
    rows += [practice_row(GAME[:2], GAME[2], act("Ask about size.", "Is it big?"), step=0, sample=2)] + [practice_row(GAME[:4], GAME[4], act("Hmm.", "Is it red?"), step=1, sample=2)]
    pairs_table(tmp_path / "pairs.parquet", rows)  # 8 pairs: one global batch of 8

    def p(nproc: int, batch_size: int) -> Params:
        return params({"stepagent": {"base_model": str(tiny_model_dir), "epochs": 2, "nproc_per_node": nproc, "batch_size": batch_size,
                                     "deepspeed": str(ROOT / "tasks/train/deepspeed_zero3.json"), "bf16": False}})

    two = run_stepagent(p(2, 4), tmp_path / "pairs.parquet", tmp_path / "two")
    one = run_stepagent(p(1, 8), tmp_path / "pairs.parquet", tmp_path / "one")
    assert two["world_size"] == 2 and "world_size" not in one and two["pairs"] == one["pairs"] == 8
    curve2, curve1 = (json.loads((tmp_path / f"{d}/loss.json").read_text()) for d in ("two", "one"))
    assert [c["step"] for c in curve2] == [c["step"] for c in curve1] and len(curve1) == 2
    for a, b in zip(curve2, curve1):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["margin"] == pytest.approx(b["margin"], abs=1e-5)
    w1 = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "one/model").named_parameters())
    for key, w in AutoModelForCausalLM.from_pretrained(tmp_path / "two/model").named_parameters():
        assert (w - w1[key]).abs().max().item() < 1e-4
