"""GuessMyCity: cities and splits, the rules on hand-made games, the knowledge-base oracle."""
import json

import pytest

from envs.guess_my_city.cities import DATA_PATH, EXPECTED_COUNTS, SPLITS, load_cities, normalize


@pytest.fixture(scope="module")
def cities():
    return load_cities()


def test_splits_hold_each_real_city_once(cities):
    assert {s: len(cities.split(s)) for s in SPLITS} == EXPECTED_COUNTS
    # Disjoint as cities: no name (own or alias) is shared by two tasks of different splits.
    by_name = {}
    for c in cities.cities:
        for n in c.names:
            assert by_name.setdefault(normalize(n), c) is c, f"{n!r} names {c.id} and {by_name[normalize(n)].id}"
    test_countries = {c.country for c in cities.split("test")}
    assert test_countries == {"Canada", "Cuba", "Ethiopia"}
    assert not test_countries & {c.country for s in ("train", "val") for c in cities.split(s)}


def test_duplicate_entries_merge_into_the_split_that_teaches_them(cities):
    ids = {c.id for c in cities.cities}
    assert "Chennai, India" not in ids and "Bangalore, India" not in ids
    madras, bengaluru = cities.get("Madras, India"), cities.get("Bengaluru, India")
    assert madras.split == bengaluru.split == "train"
    assert cities.named("Chennai") is madras and cities.named("Bangalore") is bengaluru
    source = json.loads(DATA_PATH.read_text())["cities"]
    assert len(source) == len(cities.cities) + 2


def test_a_name_of_two_cities_is_an_alias_of_neither(cities):
    assert cities.named("Santiago").id == "Santiago, Chile"
    assert cities.named("Santiago, Cuba") is None
    assert cities.named("Santiago de Cuba").id == "Santiago de Cuba, Cuba"
    assert cities.named("Puerto") is None


def test_names_match_whole_after_normalisation(cities):
    assert cities.named("  sao-paulo ").id == "Sao Paulo, Brazil"
    assert cities.named("Timisoara").id == cities.named("Timișoara").id
    assert cities.named("Porto").id == "Porto Alegre, Brazil"
    assert cities.named("Portoviejo").id == "Portoviejo, Ecuador"
    assert cities.named("Porto Alegre, Brazil").id == "Porto Alegre, Brazil"
    assert cities.named("Porto Alegre, Chile") is None
    assert cities.named("Porto Alegr") is None


def _game(cities, secret, max_turns=10):
    from envs.guess_my_city.game import Game

    return Game(cities, cities.get(secret), lambda city, q: "an answer", max_turns=max_turns)


def test_a_right_guess_on_question_k_returns_minus_k_plus_one(cities):
    game = _game(cities, "Porto Alegre, Brazil")
    rewards = [game.step(q)[1] for q in ("What language do people speak?", "What is the climate like?")]
    assert rewards == [-1.0, -1.0] and not game.done
    assert game.step("Is the city Porto?") == ("yes", 0.0)
    assert game.done and game.success and game.total == -2.0


def test_a_wrong_guess_ends_the_game_at_minus_ten(cities):
    game = _game(cities, "Porto Alegre, Brazil")
    game.step("What is the food like?")
    assert game.step("Is the city Portoviejo?") == ("no", -9.0)
    assert game.done and not game.success and game.total == -10.0
    with pytest.raises(RuntimeError, match="over"):
        game.step("Is it Porto Alegre?")


@pytest.mark.parametrize("question", ["Is it Porto Alegre?", "is the city called porto alegre", "Are you from Porto?", "Porto Alegre, Brazil", "Is the place Porto Alegre, Brazil?"])
def test_guess_forms_win(cities, question):
    game = _game(cities, "Porto Alegre, Brazil")
    assert game.step(question) == ("yes", 0.0) and game.success


@pytest.mark.parametrize("question", ["Is it coastal?", "Is it in South America?", "Is the city Porto Alegre's neighbour?", "Is it Paris?"])
def test_questions_that_name_no_listed_city_are_not_guesses(cities, question):
    game = _game(cities, "Porto Alegre, Brazil")
    assert game.step(question) == ("an answer", -1.0) and not game.done


def test_ten_questions_without_a_guess_lose_at_minus_ten(cities):
    game = _game(cities, "Quito, Ecuador")
    for _ in range(9):
        game.step("What is it known for?")
    assert not game.done
    assert game.step("What is it known for?")[1] == -1.0
    assert game.done and not game.success and not game.guessed and game.total == -10.0


def test_restore_resumes_a_running_game_only(cities):
    game = _game(cities, "Quito, Ecuador")
    game.restore([("What is the climate like?", "mild")])
    assert game.turn == 1 and game.total == -1.0
    assert game.step("Is it Quito?") == ("yes", 0.0) and game.total == -1.0
    with pytest.raises(ValueError, match="guess"):
        _game(cities, "Quito, Ecuador").restore([("Is it Lima?", "no"), ("Is it Cuenca?", "no")])


@pytest.fixture(scope="module")
def oracle(cities):
    from envs.guess_my_city.oracle import load_oracle

    return load_oracle(cities)


def test_some_question_tells_any_two_cities_apart_without_the_landmark(cities, oracle):
    from itertools import combinations

    sheets = {c.id: oracle.answers(c) for c in cities.cities}
    for a, b in combinations(cities.cities, 2):
        assert any(sheets[a.id][t] != sheets[b.id][t] for t in sheets[a.id]), f"{a.id} and {b.id} answer alike"
    # Structured facts alone separate almost every pair; the landmark and food decide the rest.
    structured = [t for t in next(iter(sheets.values())) if t not in ("landmark", "food")]
    alike = [(a.id, b.id) for a, b in combinations(cities.cities, 2) if all(sheets[a.id][t] == sheets[b.id][t] for t in structured)]
    assert len(alike) < 30, alike


def test_answers_name_neither_the_city_nor_its_country(cities, oracle):
    import re

    for c in cities.cities:
        for t, text in oracle.answers(c).items():
            said = f" {normalize(text)} "
            for name in (*c.names, c.country):
                assert not re.search(rf"\b{re.escape(normalize(name))}\b", said), f"{c.id} {t}: {text!r} names {name!r}"


def test_the_oracle_answers_its_topics_and_nothing_else(cities, oracle):
    from envs.guess_my_city.oracle import REFUSAL, UNKNOWN

    quito = cities.get("Quito, Ecuador")
    assert oracle.answer(quito, "What language do people speak there?") == "People there mainly speak Spanish."
    assert oracle.answer(quito, "Which currency do they use?") == "People pay with the US dollar."
    assert oracle.answer(quito, "Is it the national capital?") == "It is the national capital."
    assert oracle.answer(quito, "What continent is it on?") == "It is in South America, in the Andes of South America."
    assert oracle.answer(quito, "What is the name of the city?") == REFUSAL
    assert oracle.answer(quito, "Which country is it in?") == REFUSAL
    assert oracle.answer(quito, "Who is the mayor?") == UNKNOWN
    assert oracle.answer(quito, "asdf") == UNKNOWN


def test_the_environment_is_registered_and_plays_a_game():
    from envs import registry

    env = registry.make("guess_my_city", {})
    assert {s: len(env.tasks(s)) for s in SPLITS} == EXPECTED_COUNTS
    assert env.reward_range == (-10.0, 0.0) and env.won(-9.0) and not env.won(-10.0)
    assert env.relabel_turns(10) == [3, 4, 5, 6, 7]
    game = env.game(env.task("Porto Alegre, Brazil"))
    messages, _ = game.reset()
    assert "Portoviejo, Ecuador" in messages[0]["content"]
    step = game.step(env.render_action("start broad", "What language do people speak?"))
    assert step.reward == -1.0 and not step.terminated and not step.truncated
    assert step.info["turn"]["observation"] == "People there mainly speak Portuguese." and step.info["parsed"]
    step = game.step("no format at all")  # asked as it is: unknown, still a turn
    assert step.info["turn"]["observation"] == "unknown" and not step.info["parsed"] and step.reward == -1.0
    step = game.step(env.render_action("it is by a lake", "Is the city Portoviejo?"))
    assert (step.reward, step.terminated, step.truncated, game.success) == (-8.0, True, False, False)
    turns = [{"action": a} for a in ("What language do people speak?", "no format at all", "Is the city Portoviejo?")]
    assert env.label("Porto Alegre, Brazil", turns).reward == -10.0
    assert env.label("Porto Alegre, Brazil", turns[:1]).reward is None
    assert env.label("Lima, Peru", turns).reward is None


def test_running_out_of_questions_truncates():
    from envs import registry

    env = registry.make("guess_my_city", {"max_turns": 2})
    game = env.game(env.task("Quito, Ecuador"))
    game.reset()
    assert not game.step(env.render_action("", "What is the climate like?")).truncated
    step = game.step(env.render_action("", "What is the food like?"))
    assert step.truncated and not step.terminated and step.reward == -1.0
    assert "Game over." in step.observation[0]["content"]
