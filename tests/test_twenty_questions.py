from __future__ import annotations

import itertools
import random
import re
import statistics
from pathlib import Path

import pytest
import yaml

from envs.base import EMPTY_REPLY, Mixture, recorded_reply
from envs.twenty_questions.format import (
    ActionParseError,
    final_message,
    observation_message,
    parse_action,
    render_action,
    system_prompt,
)
from envs.twenty_questions.game import MAX_TURNS, Answer, Game, Oracle
from envs.twenty_questions.kb import DATA_PATH, KBError, load_kb
from envs.twenty_questions.policies import (
    ExpertPolicy,
    NoisyPolicy,
    PlayerView,
    RandomPolicy,
    play,
)

# HOPE's word lists (hope.md §11.3), ";" separating aliases, exactly as printed there.
HOPE_LISTS = {
    "train": {
        "Sports": "Basketball, Football, Baseball, Golf ball, Tennis ball, Volleyball, Tennis racket, Helmet",
        "Animals": "Cat, Dog, Horse, Cow, Rabbit, Lion, Tiger, Bear",
        "Fruits": "Apple, Banana, Orange, Strawberry, Grape, Mango, Cantaloupe, Peach",
        "Vehicles": "Car, Truck, Airplane;Plane, Train, Bus, Helicopter, Scooter, Ship",
        "Clothes": "Shirt, Pants;Pant;Pair of pants, Jacket, Dress, Skirt, Belt, Shoes;Shoe;Pair of shoes, "
        "Socks;Sock;Pair of socks, Hat",
        "Furniture": "Chair, Bed, Desk, Couch, Dresser, Bookcase, Nightstand, Pillow",
        "Office Supplies": "Pen, Paper;Piece of paper, Stapler, Printer, Calculator, Toothbrush, Pencil, "
        "Scissors;Pair of scissors, Key, Diary, Calendar",
        "Vegetables": "Potato, Broccoli, Tomato, Onion, Corn, Peas;Pea, Celery, Cucumber",
        "Art": "Painting;Canvas painting;Oil painting;Watercolor painting, Paintbrush, Marker, "
        "Glue;Glue stick;Bottle of glue, Sculpture",
        "Kitchen Tools": "Knife, Fork, Plate, Cooking pot;Pot, Pan;Saucepan;Frying pan, Cup, "
        "Chopstick;Chopsticks;Pair of chopsticks, Whisk",
        "Nature": "Tree, Bush, Forest, Ocean, Sea, Lake, River, Meteorite, Cactus",
        "Toys": "Lego;Lego set, Kite, Puzzle;Jigsaw puzzle, Stuffed animal",
        "Jewelry": "Earring;Earrings;Pair of earrings, Necklace, Ring, Brooch, Pendant, Watch, Locket",
        "Garden Supplies": "Gloves;Glove;Pair of gloves, Shovel, Watering can, Lawn mower",
        "Tools": "Screwdriver, Wrench, Saw, Pliers;plier;Pair of pliers, Drill",
    },
    "val": {
        "Sports": "Baseball bat, Soccer ball",
        "Animals": "Elephant, Sheep",
        "Fruits": "Watermelon, Pineapple",
        "Vehicles": "Motorcycle, Boat",
        "Clothes": "Scarf, Boots;Boot;Pair of boots",
        "Furniture": "Mattress, Table",
        "Office Supplies": "Battery;Battery pack;Pack of batteries, Sharpie, Toothpaste",
        "Vegetables": "Carrot, Spinach",
        "Art": "Eraser;Pencil eraser, Canvas;Painting canvas",
        "Kitchen Tools": "Spoon, Bowl",
        "Nature": "Mountain, Rock",
        "Toys": "Doll;Toy doll;Plush doll",
        "Jewelry": "Bracelet, Hairclip",
        "Garden Supplies": "Rake",
        "Tools": "Hammer",
    },
    "test": {
        "Musical Instruments": "Piano, Guitar, Drum;Drums, Violin, Saxophone, Flute, Trumpet, Clarinet, Harp, Trombone",
        "Electronics": "Computer, Smartphone, Television;TV, Headphone;Headphones;Pair of headphones, "
        "Monitor;Computer monitor, Camera, Microwave;Microwave oven, Refrigerator, Blender, Computer keyboard;Keyboard",
    },
}


@pytest.fixture(scope="module")
def kb():
    return load_kb()


def new_game(kb, name: str, max_turns: int = MAX_TURNS) -> Game:
    return Game(kb, kb.get(name), max_turns=max_turns)


def run_split(kb, policy, split: str, seed: int = 0) -> list[list]:
    candidates = kb.split(split)
    return [play(policy, Game(kb, e), candidates, random.Random(seed * 1000 + i)) for i, e in enumerate(candidates)]


def success_rate(episodes: list[list]) -> float:
    return statistics.mean(ep[-1][1].success for ep in episodes)


# --- word lists and knowledge base ---------------------------------------------------------


def test_split_counts_and_categories(kb):
    assert [len(kb.split(s)) for s in ("train", "val", "test")] == [110, 28, 20]
    train_categories = {e.category for e in kb.split("train")}
    assert len(train_categories) == 15
    assert {e.category for e in kb.split("val")} == train_categories
    assert {e.category for e in kb.split("test")} == {"Musical Instruments", "Electronics"}
    assert set(kb.categories) == train_categories | {"Musical Instruments", "Electronics"}


def test_word_lists_are_hopes(kb):
    for split, by_category in HOPE_LISTS.items():
        expected = {
            (category, tuple(item.split(";"))) for category, items in by_category.items() for item in items.split(", ")
        }
        got = {(e.category, (e.name, *e.aliases)) for e in kb.split(split)}
        assert {(c, tuple(n.lower() for n in names)) for c, names in got} == {
            (c, tuple(n.lower() for n in names)) for c, names in expected
        }


def test_every_pair_of_objects_is_separable(kb):
    for a, b in itertools.combinations(kb.entities, 2):
        assert (a.category, a.attributes) != (b.category, b.attributes), f"{a.name} and {b.name} are indistinguishable"


def test_attribute_vectors_are_unique_even_across_categories(kb):
    for a, b in itertools.combinations(kb.entities, 2):
        assert a.attributes != b.attributes, f"{a.name} and {b.name} share an attribute vector"


def test_every_attribute_splits_the_objects(kb):
    for q in kb.questions:
        n = sum(kb.truth(e, q) for e in kb.entities)
        assert 0 < n < len(kb.entities), q.key


@pytest.mark.parametrize(
    "text, name",
    [
        ("Is it a plane?", "Airplane"),
        ("Is it a pair of pants?", "Pants"),
        ("is it AN AIRPLANE", "Airplane"),
        ("Is it the TV?", "Television"),
        ("Is it  a   pot ?", "Cooking pot"),
        ("Is it Golf ball?", "Golf ball"),
        ("Is it a piano?", "Piano"),  # any split, not only the one being played
        ("Is it an animal?", None),
        ("Is it a plane or a car?", None),
        ("Is it used for sports?", None),
    ],
)
def test_resolve_guess(kb, text, name):
    entity = kb.resolve_guess(text)
    assert (entity.name if entity else None) == name


def test_match_question_normalises(kb):
    q = kb.match_question("  is it AN   animal ")
    assert q is not None and (q.kind, q.key) == ("category", "Animals")
    assert kb.match_question("Is it a office supply?").key == "Office Supplies"
    assert kb.match_question("Does it fit in your hand!!").key == "hand"
    assert kb.match_question("What colour is it?") is None


# --- oracle and game rules ------------------------------------------------------------------


@pytest.mark.parametrize(
    "secret, question, answer",
    [
        ("Cat", "Is it an animal?", "yes"),
        ("Cat", "Is it a fruit?", "no"),
        ("Cat", "Is it soft?", "yes"),
        ("Cat", "Is it bigger than a person?", "no"),
        ("Ship", "Does it have to do with water?", "yes"),
        ("Ship", "Does it have wheels?", "no"),
        ("Calculator", "Is it an electronic device?", "yes"),  # also in a second category
        ("Cat", "What colour is it?", "unknown"),
        ("Cat", "Is it a mammal?", "unknown"),
    ],
)
def test_oracle_answers_questions(kb, secret, question, answer):
    got = Oracle(kb).answer(kb.get(secret), question)
    assert (got.text, got.is_guess, got.correct) == (answer, False, False)


def test_oracle_answers_guesses(kb):
    oracle, pants = Oracle(kb), kb.get("Pants")
    for text in ("Is it Pants?", "is it a pair of pants", "Is it a PANT?"):
        answer = oracle.answer(pants, text)
        assert (answer.text, answer.is_guess, answer.correct) == ("yes", True, True)
    wrong = oracle.answer(pants, "Is it a skirt?")
    assert (wrong.text, wrong.is_guess, wrong.correct) == ("no", True, False)


def test_correct_first_guess_returns_zero(kb):
    game = new_game(kb, "Apple")
    step = game.step("Is it an apple?")
    assert (step.observation, step.reward, step.done, step.success) == ("yes", 0.0, True, True)
    assert game.turn == 1 and game.history == [("Is it an apple?", "yes")]


def test_each_other_action_costs_one(kb):
    game = new_game(kb, "Apple")
    assert game.step("Is it a fruit?").reward == -1.0
    assert game.step("Is it a banana?").reward == -1.0
    assert game.step("What is it?").reward == -1.0
    final = game.step("Is it Apple?")
    assert final.reward == 0.0 and final.success and game.turn == 4


def test_failed_episode_returns_minus_twenty_after_twenty_turns(kb):
    game = new_game(kb, "Apple")
    steps = [game.step("Is it a banana?") for _ in range(MAX_TURNS)]
    assert sum(s.reward for s in steps) == -20.0
    assert game.done and not game.success and game.turn == 20
    assert [s.done for s in steps] == [False] * 19 + [True]


def test_final_turn_forces_a_guess(kb):
    game = new_game(kb, "Apple")
    for _ in range(MAX_TURNS - 1):
        assert not game.is_final_turn
        game.step("Is it a fruit?")
    assert game.is_final_turn
    step = game.step("Is it red?")  # a true fact, but not a guess
    assert (step.observation, step.reward, step.done, step.success) == ("yes", -1.0, True, False)
    assert not game.is_final_turn


def test_correct_guess_on_final_turn_wins(kb):
    game = new_game(kb, "Apple", max_turns=3)
    game.step("Is it a fruit?")
    game.step("Is it red?")
    assert game.is_final_turn
    step = game.step("Is it Apple?")
    assert step.success and step.reward == 0.0


def test_stepping_a_finished_game_raises(kb):
    game = new_game(kb, "Apple")
    game.step("Is it Apple?")
    with pytest.raises(RuntimeError):
        game.step("Is it Apple?")


# --- scripted policies ----------------------------------------------------------------------


@pytest.mark.parametrize("split", ["train", "val", "test"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_expert_always_succeeds(kb, split, seed):
    for ep in run_split(kb, ExpertPolicy(kb), split, seed):
        assert ep[-1][1].success and len(ep) <= MAX_TURNS


def test_expert_beats_noisy_and_random(kb):
    expert = run_split(kb, ExpertPolicy(kb), "train")
    noisy = run_split(kb, NoisyPolicy(0.15, 0.1, 0.1, kb), "train")
    very_noisy = run_split(kb, NoisyPolicy(0.3, 0.2, 0.2, kb), "train")
    rand = run_split(kb, RandomPolicy(kb), "train")
    assert success_rate(expert) == 1.0
    assert success_rate(expert) > success_rate(very_noisy)
    assert success_rate(expert) > success_rate(rand)
    # Mild noise rarely exhausts 20 turns; it shows in the length of the episodes instead.
    assert success_rate(expert) >= success_rate(noisy)
    assert statistics.mean(map(len, expert)) < statistics.mean(map(len, noisy))


def test_expert_reason_names_its_choice(kb):
    view = PlayerView(
        candidates=kb.split("train"),
        history=[("Is it an animal?", "yes"), ("Is it a cat?", "no"), ("What is it?", "unknown"), ("Is it bigger than a person?", "no")],
        turn=4,
        max_turns=MAX_TURNS,
    )
    action = ExpertPolicy(kb).act(view, random.Random(0))
    q = kb.match_question(action.question)
    assert action.reason == f"Ask about {q.label}."
    # Dog and Rabbit remain: one question tells them apart, then the expert guesses.
    assert kb.match_question(action.question) is not None


def test_expert_guesses_when_one_candidate_is_left(kb):
    view = PlayerView(kb.split("train"), [("Is it an animal?", "yes"), ("Does it have stripes or spots?", "yes"),
                                          ("Does it have a sharp edge, point or claws?", "yes")], 3, MAX_TURNS)
    action = ExpertPolicy(kb).act(view, random.Random(0))
    assert action == parse_action(render_action(action.reason, action.question))
    assert action.question == "Is it Tiger?" and action.reason == "animal, striped or spotted, sharp: only Tiger fits."


def test_expert_guesses_a_consistent_candidate_on_the_final_turn(kb):
    view = PlayerView(kb.split("train"), [("Is it a fruit?", "yes")], MAX_TURNS - 1, MAX_TURNS)
    action = ExpertPolicy(kb).act(view, random.Random(0))
    guess = kb.resolve_guess(action.question)
    assert guess is not None and guess.category == "Fruits" and "Last turn" in action.reason


def test_expert_is_one_tree_unless_ties_are_random(kb):
    def questions(seed: int, random_ties: bool) -> tuple[str, ...]:
        policy = ExpertPolicy(kb, random_ties=random_ties)
        return tuple(a.question for a, _ in play(policy, new_game(kb, "Apple"), kb.split("train"), random.Random(seed)))

    assert len({questions(s, False) for s in range(20)}) == 1
    assert len({questions(s, True) for s in range(20)}) > 5


@pytest.mark.parametrize("policy_cls", [ExpertPolicy, RandomPolicy, lambda kb: NoisyPolicy(0.3, 0.3, 0.3, kb)])
def test_reasons_share_one_format_and_round_trip(kb, policy_cls):
    policy = policy_cls(kb)
    for i, secret in enumerate(kb.split("val")):
        for action, _ in play(policy, Game(kb, secret), kb.split("val"), random.Random(i)):
            assert re.fullmatch(r"(Ask about [^.]+|(Only|.+: only) .+ fits|(Last turn, g|G)uess .+)\.", action.reason)
            assert parse_action(render_action(action.reason, action.question)) == action


def test_policies_are_deterministic_given_the_seed(kb):
    def questions(seed: int) -> list[str]:
        steps = play(NoisyPolicy(0.2, 0.2, 0.2, kb), new_game(kb, "Tiger"), kb.split("train"), random.Random(seed))
        return [a.question for a, _ in steps]

    assert questions(7) == questions(7)


def test_noisy_policy_validates_probabilities(kb):
    with pytest.raises(ValueError):
        NoisyPolicy(0.6, 0.3, 0.2, kb)


def test_mixture_draws_one_policy_per_episode(kb):
    policies = {"expert": ExpertPolicy(kb), "noisy": NoisyPolicy(0.15, 0.1, 0.1, kb), "random": RandomPolicy(kb)}
    mixture = Mixture({"expert": 0.6, "noisy": 0.3, "random": 0.1}, policies)
    draws = [mixture.for_episode(random.Random(seed)).name for seed in range(300)]
    assert draws == [mixture.for_episode(random.Random(seed)).name for seed in range(300)]
    assert set(draws) == {"expert", "noisy", "random"}
    assert draws.count("expert") > draws.count("noisy") > draws.count("random")
    only_expert = Mixture({"expert": 1.0, "random": 0.0}, policies)
    assert {only_expert.for_episode(random.Random(s)).name for s in range(20)} == {"expert"}


def test_mixture_rejects_bad_weights(kb):
    with pytest.raises(ValueError, match="greedy"):
        Mixture({"greedy": 1.0}, {"expert": ExpertPolicy(kb)})
    with pytest.raises(ValueError):
        Mixture({"expert": 0.0}, {"expert": ExpertPolicy(kb)})


# --- chat format ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, reason, question",
    [
        ("REASON: Known: animal.\nQUESTION: Is it a cat?", "Known: animal.", "Is it a cat?"),
        ("\n  REASON:\nKnown: animal,\n  not large.\n\nQUESTION:\n  Is it a cat?  \nREASON: more", "Known: animal, not large.",
         "Is it a cat?"),
        ("REASON:QUESTION: Is it red?", "", "Is it red?"),
    ],
)
def test_parse_action_accepts(text, reason, question):
    action = parse_action(text)
    assert (action.reason, action.question) == (reason, question)


@pytest.mark.parametrize(
    "text, message",
    [
        ("REASON: Known: animal.", "missing 'QUESTION:'"),
        ("REASON: Known: animal.\nQUESTION:   \n\n", "empty question"),
        ("Sure! REASON: x\nQUESTION: Is it a cat?", "before 'REASON:'"),
        ("QUESTION: Is it a cat?", "missing 'REASON:'"),
    ],
)
def test_parse_action_rejects(text, message):
    with pytest.raises(ActionParseError, match=message):
        parse_action(text)


def test_render_action():
    assert render_action("Known: nothing yet.", "Is it an animal?") == "REASON: Known: nothing yet.\nQUESTION: Is it an animal?"


@pytest.mark.parametrize("text", ["", " ", "\n\t \n"])
def test_an_empty_reply_is_recorded_as_a_marker_that_is_no_action(kb, text):
    assert recorded_reply(text) == EMPTY_REPLY and EMPTY_REPLY.strip()
    with pytest.raises(ActionParseError):
        parse_action(EMPTY_REPLY)
    # Answered as any text outside the oracle's question set: unknown, and no guess.
    assert Oracle(kb).answer(kb.split("train")[0], EMPTY_REPLY) == Answer("unknown", is_guess=False, correct=False)


def test_a_reply_with_text_is_recorded_as_it_is():
    for text in (" REASON: x\nQUESTION: Is it red?\n", "?", "\nno format"):
        assert recorded_reply(text) == text


def test_system_prompt_is_short_and_lists_candidates():
    text = system_prompt()
    assert len(text.split()) <= 60 and "Is it X?" in text and "20 turns" in text
    assert "REASON:" in text and "QUESTION:" in text and "Possible objects" not in text
    assert system_prompt(5, ["Apple", "Golf ball"]).endswith("Possible objects: Apple, Golf ball.")


def test_observation_messages():
    assert observation_message(None, 0, 20) == "Turn 1 of 20. Ask a yes-no question."
    assert observation_message("yes", 6, 20) == "Answer: yes. Turn 7 of 20."
    assert observation_message("unknown", 19, 20) == "Answer: unknown. Turn 20 of 20. Final turn: you must guess."
    assert final_message("yes", True) == "Answer: yes. You found it."
    assert final_message("no", False) == "Answer: no. Game over."


# --- YAML validation ------------------------------------------------------------------------


def broken_copy(tmp_path: Path, edit) -> Path:
    raw = yaml.safe_load(DATA_PATH.read_text())
    edit(raw)
    path = tmp_path / "objects.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def objects(raw: dict, split: str, category: str) -> list[dict]:
    return raw["splits"][split][category]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda raw: objects(raw, "train", "Fruits")[0]["attributes"].append("sweet"), r"'Apple'.*unknown attribute.*sweet"),
        (lambda raw: objects(raw, "train", "Fruits")[1].update(aliases=["apple"]), r"'Banana'.*'apple'.*'Apple'"),
        (lambda raw: objects(raw, "val", "Tools").append({"name": "Mallet", "attributes": ["metal"]}), r"'val'.*29.*28"),
        (lambda raw: objects(raw, "train", "Fruits")[0].update(colour="red"), r"'Apple'.*unknown field.*colour"),
        (lambda raw: objects(raw, "train", "Fruits")[0].pop("attributes"), r"'Apple'.*'attributes'"),
        (lambda raw: objects(raw, "val", "Fruits")[0].update(attributes=["edible", "on_trees", "round", "red", "hand"]),
         r"'Watermelon'.*same category and attributes as 'Apple'|'Apple'.*'Watermelon'"),
        (lambda raw: raw["attributes"]["red"].update(question="Is it a cat?"), r"'red'.*reads as a guess"),
    ],
)
def test_yaml_errors_name_the_object_and_field(tmp_path, edit, message):
    with pytest.raises(KBError, match=message):
        load_kb(broken_copy(tmp_path, edit))
