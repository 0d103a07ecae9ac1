"""The base model's knowledge of objects (envs/twenty_questions/facts.py): riddles, not games."""
from __future__ import annotations

import random
import re

from envs.twenty_questions.facts import FACTS_SYSTEM, fact_sheets, identifying_facts
from envs.twenty_questions.format import system_prompt
from envs.twenty_questions.game import Game
from envs.twenty_questions.kb import Entity, KnowledgeBase, Question, load_kb
from envs.twenty_questions.policies import ExpertPolicy, play


def test_facts_are_true_and_tell_the_object_apart():
    kb = load_kb()
    rng = random.Random(3)
    for entity in kb.entities:
        facts = identifying_facts(kb, entity, rng)
        assert all(kb.truth(entity, q) == truth for q, truth in facts)
        fits = [e for e in kb.entities if all(kb.truth(e, q) == truth for q, truth in facts)]
        assert fits == [entity], f"{entity.name}: {[e.name for e in fits]} fit {len(facts)} facts"


def _toy_kb() -> KnowledgeBase:
    """Eight objects: "big" splits them 4/4, "red" 2/6, "odd" 1/7."""
    q = [Question(f"Is it {k}?", "attribute", k, k, f"not {k}") for k in ("odd", "red", "big")]
    attrs = [{"big", "red", "odd"}, {"big", "red"}, {"big"}, {"big"}, set(), set(), set(), set()]
    return KnowledgeBase([Entity(f"O{i}", (), "thing", "train", frozenset(a)) for i, a in enumerate(attrs)], q)


def test_a_description_goes_from_the_most_telling_statement_to_the_least():
    kb = _toy_kb()
    o0 = kb.get("O0")
    # breadth 1: always the statement that splits the remaining objects most evenly
    assert [(q.key, t) for q, t in identifying_facts(kb, o0, random.Random(0), breadth=1)] == [("big", True), ("red", True), ("odd", True)]
    # breadth 2: the first statement is "big" or "red", never the least telling "odd"
    firsts = {identifying_facts(kb, o0, random.Random(s), breadth=2)[0][0].key for s in range(40)}
    assert firsts == {"big", "red"}
    # a statement that no longer splits the remaining objects is never made: O2 is told apart
    # from O3 by nothing, so its description stops once only the two are left
    facts = identifying_facts(kb, kb.get("O2"), random.Random(0), breadth=1)
    assert [(q.key, t) for q, t in facts] == [("big", True), ("red", False)]


def test_sheets_cover_every_split_and_are_reproducible():
    kb = load_kb()
    sheets = fact_sheets(kb, 2, seed=7, per_sheet=8)
    names = [re.fullmatch(r"only (.+) fits\.", m["content"]).group(1) for s in sheets for m in s if m["role"] == "assistant"]
    assert sorted(names) == sorted(e.name for e in kb.entities for _ in range(2))
    assert len(sheets) == -(-len(names) // 8)
    named = set(names)
    assert {e.split for e in kb.entities if e.name in named} == {"train", "val", "test"}
    assert sheets == fact_sheets(kb, 2, seed=7)
    assert sheets != fact_sheets(kb, 2, seed=8)


def test_a_sheet_is_not_a_game():
    """No game prompt, no turns, no player's questions: statements and names."""
    sheet = fact_sheets(load_kb(), 1, seed=0, per_sheet=3)[0]
    assert [m["role"] for m in sheet] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert sheet[0]["content"] == FACTS_SYSTEM != system_prompt()
    assert "Turn" not in sheet[1]["content"] and "QUESTION:" not in sheet[2]["content"] and "REASON:" not in sheet[2]["content"]
    labels = sheet[1]["content"].removesuffix(":").split(", ")
    name = re.fullmatch(r"only (.+) fits\.", sheet[2]["content"]).group(1)
    kb = load_kb()
    by_label = {q.label: (q, True) for q in kb.questions} | {q.no_label: (q, False) for q in kb.questions}
    assert all(kb.truth(kb.get(name), by_label[label][0]) == by_label[label][1] for label in labels)  # the user states, the model names


def test_bootstrap_learns_from_train_games_and_facts_and_reports_its_learning_curve(tmp_path):
    """Demonstrations come from train tasks only; the fact sheets cover every object; with
    curve_every the metrics hold success after each epoch."""
    import duckdb

    from tasks.bootstrap import run_bootstrap
    from tasks.params import Params
    from conftest import tiny_params

    raw = tiny_params({"bootstrap": {"demo_splits": ["train"], "curve_every": 1, "train": {"epochs": 2}, "eval_splits": ["train", "val"]}})
    metrics = run_bootstrap(Params.model_validate(raw), tmp_path)
    splits = duckdb.sql(f"SELECT DISTINCT split FROM '{tmp_path / 'demos.parquet'}'").fetchall()
    assert splits == [("train",)]
    assert metrics["fact_sheets"] == -(-len(load_kb().entities) // 8)
    curve = metrics["model"]["learning_curve"]
    assert [p["epoch"] for p in curve] == [1, 2] and all(set(p) == {"epoch", "train", "val"} for p in curve)
    assert curve[-1]["train"] == metrics["model"]["success"]["train"]["success_rate"]
    assert metrics["demonstrations"]["longest_action_tokens"] <= raw["bootstrap"]["eval_sampling"]["max_new_tokens"]


def test_bootstrap_stops_when_the_policy_could_not_finish_its_longest_action(tmp_path):
    """A guess lists what the answers established; a max_new_tokens below the longest scripted
    action would cut every long guess off (it then fails to parse), so bootstrap refuses before training."""
    import pytest

    from tasks.bootstrap import run_bootstrap
    from tasks.params import Params
    from conftest import tiny_params

    raw = tiny_params({"bootstrap": {"eval_sampling": {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 8}}})
    with pytest.raises(ValueError, match=r"bootstrap.eval_sampling.max_new_tokens is 8, but the longest scripted action is \d+ tokens"):
        run_bootstrap(Params.model_validate(raw), tmp_path)
    assert not (tmp_path / "model").exists()


def test_a_riddle_in_guess_form_is_a_guess_without_a_game():
    """fact_form: guess writes the description as a guess's reason, in the player's action format,
    after one neutral request: no turns, no questions asked, no answers."""
    from envs.twenty_questions.facts import RIDDLE_ASK
    from envs.twenty_questions.format import parse_action

    kb = load_kb()
    sheet = fact_sheets(kb, 1, seed=0, breadth=1, per_sheet=2, form="guess")[0]
    assert [m["role"] for m in sheet] == ["system", "user", "assistant", "user", "assistant"]
    assert sheet[1]["content"] == sheet[3]["content"] == RIDDLE_ASK
    action = parse_action(sheet[2]["content"])
    labels, _, named = action.reason.partition(": only ")
    name = named.removesuffix(" fits.")
    assert action.question == f"Is it {name}?"
    by_label = {q.label: (q, True) for q in kb.questions} | {q.no_label: (q, False) for q in kb.questions}
    assert all(kb.truth(kb.get(name), by_label[label][0]) == by_label[label][1] for label in labels.split(", "))


def test_the_expert_order_describes_an_object_by_the_experts_path():
    """fact_order expert: the most telling statement, ties in the question set's order, as the
    scripted expert asks; so a description is the expert's game for that object, over every object."""
    kb = _toy_kb()
    # "big" splits 4/4 first; then "red" (2/2) beats "odd" (1/3); O1 is then told from O0 by "odd"
    assert [(q.key, t) for q, t in identifying_facts(kb, kb.get("O1"), random.Random(5), breadth=3, expert=True)] == [("big", True), ("red", True), ("odd", False)]
    full = load_kb()
    expert = ExpertPolicy(full)
    for entity in full.split("val")[:6]:
        game = Game(full, entity, max_turns=20)
        asked = [a.question for a, _ in play(expert, game, list(full.entities), random.Random(0))][:-1]  # the last is the guess
        assert [q.text for q, _ in identifying_facts(full, entity, random.Random(1), expert=True)] == asked


def test_a_riddle_in_known_form_is_an_observations_list_then_the_guess():
    sheets = fact_sheets(_toy_kb(), 2, seed=0, per_sheet=2, form="known", order="mixed")
    riddles = [(s[i]["content"], s[i + 1]["content"]) for s in sheets for i in range(1, len(s), 2)]
    assert ("Known: big, red, not odd.", "REASON: Only O1 fits.\nQUESTION: Is it O1?") in riddles
    # mixed: one of each object's two riddles is the expert's path; the other may differ
    assert sum(user == "Known: big, red, not odd." for user, _ in riddles) >= 1


def test_known_observations_carry_what_the_answers_established(tmp_path):
    """observation: known: every answer is followed by the list of what all the answers so far
    established, and a guess's reason then only names the object."""
    from envs.twenty_questions.env import TwentyQuestions, TwentyQuestionsOptions

    env = TwentyQuestions(TwentyQuestionsOptions(observation="known"))
    game = env.game(env.task("Apple"))
    game.reset()
    first = game.step("REASON: Ask about fruit.\nQUESTION: Is it a fruit?")
    assert first.observation[0]["content"].startswith("Answer: yes. Known: fruit. Turn 2 of 20.")
    second = game.step("REASON: Ask about red.\nQUESTION: Is it red?")
    assert "Known: fruit, red." in second.observation[0]["content"]
    unknown = game.step("REASON: Hm.\nQUESTION: Is it tasty?")  # "unknown" settles nothing
    assert "Known: fruit, red." in unknown.observation[0]["content"]
    expert = env.policies({"p_random": 0, "p_repeat": 0, "p_early_guess": 0})["expert"]
    rng, game = random.Random(0), env.game(env.task("Apple"))
    game.reset()
    while not game.done:
        text = expert.act(game, rng)
        step = game.step(text)
    assert step.terminated and text == "REASON: Only Apple fits.\nQUESTION: Is it Apple?"
    plain = TwentyQuestions(TwentyQuestionsOptions())
    game = plain.game(plain.task("Apple"))
    game.reset()
    assert "Known" not in game.step("REASON: Ask about fruit.\nQUESTION: Is it a fruit?").observation[0]["content"]
