"""CarDealer (HOPE's tool-use dealership): data and splits, the database APIs and their display,
the action format, the buyer's state machine, the reward by paper and by code, the chat format
(tool calls, loadable by transformers and TRL), scripted sellers, oracle and LLM roles, on
hand-made cases."""
import json
import random
import shutil
import statistics
from pathlib import Path

import pyarrow as pa
import pytest

from envs import registry
from envs.base import Unfinished
from envs.car_dealer import data
from envs.car_dealer.buyer import COULD_NOT_RESPOND, BuyerReply, Counters, count, parse_buyer, read_observation, situate
from envs.car_dealer.data import Car, DataError
from envs.car_dealer.format import ActionParseError, parse_api, parse_reply, render_api, render_reply
from envs.car_dealer.game import Dealership, Rules
from envs.car_dealer.llm_roles import parse_summary, records
from envs.car_dealer.reward import penalty
from envs.car_dealer.tools import ApiCall, discounted, display, search, shown
from storage.parquet import read_table, write_table
from storage.schema import from_table, to_table
from storage.validate import read_checked
from tasks.rollout import ScriptedAgent, new_episode, play
from tasks.standardize import EXPORT_COLUMNS

NOISE = {"p_random": 0.15, "p_repeat": 0.10, "p_early_guess": 0.10}


@pytest.fixture(scope="module")
def env():
    return registry.make("car_dealer", {})


def buyer(task_id):
    return next(b for b in data.load_buyers() if b.id == task_id)


def call(name, brand="", car_type="", features=()):
    return render_api("why", ApiCall.make(name, brand, car_type, features))


def offer(index, car, words):
    return render_reply("why", words, index, car)


def cars(task_id):
    b = buyer(task_id)
    return data.inventory_for(b)[b.brand][b.type]


# ---- data ----

def test_splits_and_task_ids(env):
    counts = {s: len(env.tasks(s)) for s in env.splits}
    assert counts == {"train": 123, "val": 36, "test": 35}
    by_type = {s: sorted({b.buyer_type for b in env.tasks(s)}) for s in env.splits}
    assert by_type == {"train": [1, 2, 3], "val": [1, 2, 3], "test": [4, 5, 6]}
    assert [sum(b.buyer_type == t for b in env.tasks("test")) for t in (4, 5, 6)] == [12, 12, 11]
    b = env.task("2_Kia_truck_41000")
    assert (b.buyer_type, b.brand, b.type, b.budget, b.split) == (2, "Kia", "truck", 41000, "val")
    with pytest.raises(KeyError, match="unknown CarDealer buyer"):
        env.task("7_Kia_truck_1")


@pytest.fixture
def broken_data(tmp_path, monkeypatch):
    """A copy of the data to break, read instead of the package's."""
    shutil.copytree(data.DATA, tmp_path / "data")
    monkeypatch.setattr(data, "DATA", tmp_path / "data")
    caches = (data.load_catalog, data.load_inventories, data.load_buyers, data.load_buyer_types, data.dedicated_inventory)
    for f in caches:
        f.cache_clear()
    yield tmp_path / "data"
    for f in caches:
        f.cache_clear()


def _edit(path, change):
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize("change, message", [
    (lambda r: r["profiles"][3].update(ideal_msrp=1), r"profiles\[3\] \(1_Volkswagen_SUV_42000\): budget 42000, ideal_msrp 1"),
    (lambda r: r["profiles"][0].pop("budget"), r"profiles\[0\] \(1_Volkswagen_van_65000\): missing field 'budget'"),
    (lambda r: r["profiles"][0].update(buyer_type="1"), r"buyer_type: expected int, got str"),
    (lambda r: r["profiles"][1].update(game_id=r["profiles"][0]["game_id"], budget=r["profiles"][0]["budget"]), "duplicate"),
    (lambda r: r["profiles"][0].update(split="test"), "does not play in split 'test'"),
    (lambda r: r["profiles"].pop(), r"split sizes \{'train': 123, 'val': 36, 'test': 34\}"),
])
def test_bad_profiles_fail_naming_the_entry_and_field(broken_data, change, message):
    _edit(broken_data / "buyer_profiles.json", change)
    with pytest.raises(DataError, match=message):
        data.load_buyers()


def test_bad_inventory_and_catalog_fail_clearly(broken_data):
    _edit(broken_data / "inventories.json", lambda r: r["inventories"]["car_inventory_dict_0"]["Kia"]["truck"][1].update(msrp=1))
    with pytest.raises(DataError, match=r"car_inventory_dict_0\.Kia\.truck\[1\]\.msrp: 1, but base price plus features is"):
        data.load_inventories()
    (broken_data / "catalog.json").write_text("{not json")
    data.load_catalog.cache_clear()
    with pytest.raises(DataError, match="catalog.json: not JSON"):
        data.load_catalog()


def test_the_rules_agree_with_buyer_types_json(broken_data):
    from envs.car_dealer.buyer import check_buyer_types

    check_buyer_types()
    _edit(broken_data / "buyer_types.json", lambda r: r["types"][1]["patience"].update(max_negotiations=5))
    data.load_buyer_types.cache_clear()
    with pytest.raises(DataError, match=r"type 2: patience and distrust \(5, None, None\), the rules have \(6, None, None\)"):
        check_buyer_types()


@pytest.mark.parametrize("task_id", ["2_Volkswagen_van_44000", "2_Kia_truck_41000", "5_Kia_truck_77000"])
def test_dedicated_inventories_follow_the_generation_rule(task_id):
    b = buyer(task_id)
    inv = data.inventory_for(b)
    everything = data.all_cars(inv)
    planted = [c for c in everything if set(b.planted) <= set(c.features)]
    assert 4 <= len(planted) <= 5
    assert all(c.brand != b.brand and c.type != b.type for c in planted)
    # Only the planted cars carry any of the buyer's features, and none carries an unplanted one.
    assert all(not set(b.features) & set(c.features) for c in everything if c not in planted)
    assert all(set(b.features) & set(c.features) == set(b.planted) for c in planted)
    prices = [c.msrp for c in planted]
    assert 0.9 * min(prices) <= b.budget <= statistics.median(prices)
    brands = {c.brand for c in everything}
    assert len(brands) == (7 if b.split == "train" else 10)
    assert all(len(group) == 4 and not group[0].features for by_type in inv.values() for group in by_type.values())
    data.dedicated_inventory.cache_clear()
    assert data.inventory_for(b) == inv  # seeded by its key: the same inventory every time


def test_buyer_features_are_shuffled_per_game_not_stored_first():
    # The stored order puts the planted features first; a game names them in its own order.
    firsts = [b.features[0] == b.planted[0] for b in data.load_buyers() if b.planted]
    assert 0 < sum(firsts) < len(firsts)


# ---- the database ----

def test_api_arguments_are_normalised():
    assert ApiCall.make("search_car_by_brand", "  mercedes-BENZ ") == ApiCall("search_car_by_brand", "Mercedes-benz")
    assert ApiCall.make("search_car_by_brand_type", "BMW", "suv") == ApiCall("search_car_by_brand_type", "Bmw", "SUV")
    assert ApiCall.make("search_car_by_type", "Kia", "Sports  Car").brand == ""  # only its own arguments
    assert ApiCall.make("teleport_car") == ApiCall("no_op")
    assert str(ApiCall.make("search_car_that_have_features", features=["Sunroof"])) == 'search_car_that_have_features(features_list=["Sunroof"])'


def test_searches():
    inv = data.load_inventories()["car_inventory_dict_1"]
    assert len(search(ApiCall.make("search_car_by_brand_type", "kia", "truck"), inv)) == 4
    assert len(search(ApiCall.make("search_car_by_brand", "kia"), inv)) == 20
    assert len(search(ApiCall.make("search_car_by_type", car_type="SUV"), inv)) == 40
    assert search(ApiCall.make("search_car_by_brand", "Lada"), inv) == []
    assert search(ApiCall("no_op"), inv) == []
    found = search(ApiCall.make("search_car_that_have_features", features=["CRUISE CONTROL", "leather seats"]), inv)
    assert found and all({"cruise control", "leather seats"} <= set(c.features) for c in found)
    assert len(found) == sum({"cruise control", "leather seats"} <= set(c.features) for c in data.all_cars(inv))


def test_display_caps_broad_searches_at_eight():
    inv = data.load_inventories()["car_inventory_dict_1"]
    rng = random.Random(0)
    by_type = search(ApiCall.make("search_car_by_type", car_type="truck"), inv)
    cars, broad = shown(by_type, 8, rng)
    assert broad and len(cars) == 8 and len({c.brand for c in cars}) == 8  # 10 brands: 8 of them, one car each
    by_brand = search(ApiCall.make("search_car_by_brand", "Kia"), inv)
    cars, broad = shown(by_brand, 8, rng)
    assert broad and len(cars) == 5 and {c.type for c in cars} == set(data.load_catalog().types)  # 5 types x max(1, 8 // 5)
    assert shown(by_type, None, rng) == (by_type, False)
    assert shown(by_type[:4], 8, rng) == (by_type[:4], False)
    text = display(by_type[:2], False)
    assert text.splitlines()[0] == f'1. brand=Volkswagen, type=truck, features=[], msrp=$33000, 2% off=$32340, 5% off=$31350, 8% off=$30360, 10% off=$29700'
    assert display(cars, True).startswith("Your search may be too broad: only 5 of the cars found are shown.\n1. ")
    assert display([], False) == "No cars found. YOU MUST NOT MAKE UP A CAR THAT IS NOT IN THE DATABASE."
    assert discounted(45000, 10) == 40500 and discounted(33500, 2) == 32830


def test_the_cap_is_an_option(env):
    every = registry.make("car_dealer", {"max_cars_shown": None})
    for e, lines in ((env, 8), (every, 40)):
        game = e.game(e.task("4_Kia_truck_51000"))
        game.reset()
        step = game.step(call("search_car_by_type", car_type="truck"))
        assert sum(line[0].isdigit() for line in step.observation[0]["content"].splitlines()) == lines
    with pytest.raises(ValueError, match="max_cars_shown"):
        registry.make("car_dealer", {"max_cars_shown": 0})


# ---- the action format ----

def test_actions_render_and_parse():
    car = Car("Kia", "truck", ("cruise control", "leather seats"), 54500)
    text = offer(2, car, "It is $54,500.")
    r = parse_reply(text)
    assert (r.reason, r.response, r.car_index, r.copied) == ("why", "It is $54,500.", 2, car)
    assert parse_reply(render_reply("", "Hello!", 0, None)).copied is None
    # HOPE's layout: each value under its field, lower-case names, Python-style lists.
    hope = "reason:\nlook it up\napi name:\nsearch_car_that_have_features\napi brand:\nNone\napi type:\nNone\napi features:\n['sunroof', \"remote start\"]\n"
    assert parse_api(hope).call == ApiCall("search_car_that_have_features", features=("sunroof", "remote start"))
    for bad, why in [
        ("REASON: x\nAPI NAME: sell_car\nAPI BRAND: None\nAPI TYPE: None\nAPI FEATURES: []", "unknown API"),
        ("API NAME: no_op\nAPI BRAND: None\nAPI TYPE: None\nAPI FEATURES: []", "missing 'REASON:'"),
        ("REASON: x\nAPI NAME: no_op\nAPI BRAND: None\nAPI TYPE: None", "missing 'API FEATURES:'"),
        ("REASON: x\nAPI NAME: search_car_that_have_features\nAPI BRAND: None\nAPI TYPE: None\nAPI FEATURES: sunroof", "not a list of strings"),
    ]:
        with pytest.raises(ActionParseError, match=why):
            parse_api(bad)
    with pytest.raises(ActionParseError, match="CAR INDEX: not a whole number"):
        parse_reply(text.replace("CAR INDEX: 2", "CAR INDEX: two"))


# ---- the buyer ----

def _situate(task_id, car, message, counters, first=False, quirk=False):
    return situate(buyer(task_id), first, car, message, counters, quirk)


def test_counters_count_new_cars_and_discounts():
    a, b = cars("1_Volkswagen_van_65000")[1:3]
    c0 = Counters()
    assert count(c0, None, a, "It is $70,000.") == Counters(1, 1)
    assert count(Counters(1, 1), a, a, "It is $70,000.") == Counters(1, 1)  # same car, list price
    assert count(Counters(1, 1), a, a, "For you, $68,600.") == Counters(1, 2)  # same car, below list
    assert count(Counters(1, 2), a, b, "Or this one.") == Counters(2, 3)
    assert count(Counters(2, 3), b, None, "Let me look.") == Counters(3, 4)  # dropping to no car is a new car
    assert count(c0, None, None, "Hello") == c0


def test_type1_wants_brand_type_and_a_discount():
    vw = cars("1_Volkswagen_van_65000")[1]  # a Volkswagen van at $70,000
    kia = cars("4_Kia_truck_51000")[1]
    c = Counters(1, 1)
    assert _situate("1_Volkswagen_van_65000", vw, "Hi", c, first=True).mode == "initial"
    assert _situate("1_Volkswagen_van_65000", vw, "It is $70,000.", c).mode == "matched_but_need_discount"
    s = _situate("1_Volkswagen_van_65000", vw, "$68,600 for you, down from $70,000.", c)
    assert s.mode == "condition_met" and s.price == 68600  # the lowest amount quoted
    assert _situate("1_Volkswagen_van_65000", kia, "$40,000 only.", c).mode == "discount_given_but_not_matched"
    assert _situate("1_Volkswagen_van_65000", None, "What do you want?", c).mode == "car_proposed"


def test_types_2_and_4_run_out_of_patience_after_six_negotiations():
    planted = next(c for c in data.all_cars(data.inventory_for(buyer("2_Volkswagen_van_44000"))) if "Apple CarPlay" in c.features)
    assert _situate("2_Volkswagen_van_44000", planted, "It is $44,000.", Counters(2, 6)).mode == "condition_met"
    assert _situate("2_Volkswagen_van_44000", planted, f"It is ${planted.msrp}.", Counters(2, 6)).mode == ("condition_met" if planted.msrp <= 44000 else "matched_but_not_under_budget")
    assert _situate("2_Volkswagen_van_44000", planted, "It is $44,000.", Counters(2, 7)).mode == "exceed_negotation_limit"
    kia = cars("4_Kia_truck_51000")
    assert _situate("4_Kia_truck_51000", kia[3], "$55,000.", Counters(1, 1)).mode == "condition_met"  # budget + 4,000
    assert _situate("4_Kia_truck_51000", kia[3], "$55,001.", Counters(1, 1)).mode == "matched_but_not_under_budget"
    assert _situate("4_Kia_truck_51000", kia[3], "$55,000.", Counters(1, 7)).mode == "exceed_negotation_limit"


def test_types_3_and_5_refuse_the_first_two_cars():
    vw = cars("3_Volkswagen_van_50000")[0]  # $55,000: within budget + 3,000 at $53,000
    assert _situate("3_Volkswagen_van_50000", vw, "$53,000.", Counters(2, 2)).mode == "initial_car_proposed"
    assert _situate("3_Volkswagen_van_50000", vw, "$53,000.", Counters(3, 3)).mode == "condition_met"
    assert _situate("3_Volkswagen_van_50000", vw, "$53,001.", Counters(3, 3)).mode == "matched_but_not_under_budget"
    two = next(c for c in data.all_cars(data.inventory_for(buyer("5_Kia_truck_77000"))) if {"backup camera", "navigation system"} <= set(c.features))
    assert _situate("5_Kia_truck_77000", two, "$1,000.", Counters(2, 2)).mode == "initial_car_proposed"
    assert _situate("5_Kia_truck_77000", two, f"${min(two.msrp, 77000)}.", Counters(3, 3)).mode == ("condition_met" if two.msrp * 0.9 <= 77000 else "matched_but_not_under_budget")


def test_type6_wants_its_type_expensive_and_few_cars_and_the_quirk_is_an_option():
    kia = cars("6_Kia_truck_60000")
    assert _situate("6_Kia_truck_60000", kia[2], "$60,000.", Counters(2, 2)).mode == "condition_met"
    assert _situate("6_Kia_truck_60000", kia[1], "$54,500.", Counters(2, 2)).mode == "matched_but_not_expensive"
    assert _situate("6_Kia_truck_60000", kia[2], "$60,000.", Counters(3, 3)).mode == "exceed_car_limit"
    # Neither type nor price: agent_prm's else branch "buys"; by default the buyer negotiates.
    assert _situate("6_Kia_truck_60000", None, "Hello", Counters(1, 1)).mode == "car_proposed"
    assert _situate("6_Kia_truck_60000", None, "Hello", Counters(1, 1), quirk=True).mode == "condition_met"


def test_oracle_words_vary_with_the_seed_its_decisions_never(env):
    texts, decisions = set(), set()
    for k in range(12):
        d = Dealership(buyer("1_Volkswagen_van_65000"), data.inventory_for(buyer("1_Volkswagen_van_65000")))
        d.call(ApiCall("no_op"))
        d.answer(parse_reply(offer(0, None, "Welcome!")))
        d.call(ApiCall.make("search_car_by_brand_type", "Volkswagen", "van"))
        said, _ = d.answer(parse_reply(offer(2, d.listing.cars[1], f"Only $70,000 today ({k}).")))
        texts.add(said.answer)
        decisions.add(said.decision)
        assert said.answer.endswith("Can you give me a discount?")
    assert len(texts) > 1 and decisions == {"negotiate"}


def test_llm_buyer_reply_is_parsed_or_refused():
    r = parse_buyer("REASON: it fits\nANSWER: Deal, I'll take it.\nDECISION: Decision=Accept, Buy_Price=$68,600")
    assert (r.answer, r.decision, r.price, r.reason) == ("Deal, I'll take it.", "accept", 68600, "it fits")
    assert parse_buyer("REASON: hm\nANSWER: Cheaper?\nDECISION:\nDecision=Negotiate, Buy_Price=$0").decision == "negotiate"
    for bad, why in [("Sure, sounds good.", "REASON:"), ("REASON: a\nANSWER: b\nDECISION: maybe", "DECISION is not"),
                     ("REASON: a\nANSWER: b\nDECISION: Decision=Accept, Buy_Price=$0", "without a price"),
                     ("REASON: a\nANSWER: Decision=Accept, Buy_Price=$5\nDECISION: Decision=Negotiate, Buy_Price=$0", "holds a decision line")]:
        with pytest.raises(ValueError, match=why):
            parse_buyer(bad)
    assert read_observation(r.observation()) == BuyerReply("Deal, I'll take it.", "accept", 68600)


def test_llm_buyer_request_and_failure(env):
    game = env.game(env.task("1_Volkswagen_van_65000"))
    game.reset()
    assert game.simulator_request(call("no_op")) is None  # the database answers calls
    game.step(call("no_op"))
    req = game.simulator_request(offer(0, None, "Welcome! What are you looking for?"))
    system, user = (m["content"] for m in req.messages)
    assert "Volkswagen van" in system and "$65000" in system and "Decision=Accept" in system
    assert "Welcome! What are you looking for?" in user and "tell the seller the brand, type and features" in user
    step = game.step(offer(0, None, "Welcome! What are you looking for?"), game.simulator_failed("..."))
    assert step.observation[0]["content"] == COULD_NOT_RESPOND and not (step.terminated or step.truncated)


class Says:
    """A model that always writes the same buyer output."""

    backend, model_id = "openai", "says"

    def __init__(self, text):
        self.text, self.calls = text, 0

    def generate(self, convs, sampling, seeds):
        from models.base import Completion

        self.calls += len(convs)
        return [Completion(self.text) for _ in convs]


def test_an_llm_buyer_answers_replies_and_cannot_sell_what_was_not_offered(env):
    from tasks.params import RoleParams
    from tasks.simulator import LLMSimulator

    role = RoleParams(backend="openai", model="m", base_url="http://x/v1", parse_attempts=1)
    eager = Says("REASON: fine\nANSWER: Deal.\nDECISION: Decision=Accept, Buy_Price=$68,600")
    ep = new_episode(env, env.task("1_Volkswagen_van_65000"), 0)
    play([ep], ScriptedAgent(lambda rng: env.policies(NOISE)["expert"]), 0, "t", LLMSimulator(eager, role))
    # Asked once, at the first reply (calls go to the database); it "buys" with no car proposed.
    assert eager.calls == 1 and ep.game.done and not ep.game.success
    assert ep.to_row()["return"] == pytest.approx(penalty(ep.task))
    mute = Says("I am not sure what to say.")
    ep = new_episode(env, env.task("1_Volkswagen_van_65000"), 0)
    play([ep], ScriptedAgent(lambda rng: env.policies(NOISE)["expert"]), 0, "t", LLMSimulator(mute, role))
    assert mute.calls == ep.simulator_failures == 10 and ep.game.state.timed_out
    assert all(m["content"] == COULD_NOT_RESPOND for m in ep.messages[2:] if m["role"] == "user")


# ---- reward ----

def _sale_game(task_id, rule, text, price, decision="accept"):
    """A game where the seller searched the buyer's brand/type and made `text`'s offer, answered with `decision`."""
    b = buyer(task_id)
    d = Dealership(b, data.inventory_for(b), Rules(reward_rule=rule))
    d.call(ApiCall("no_op"))
    d.answer(parse_reply(offer(0, None, "Hi")))
    d.call(ApiCall.make("search_car_by_brand_type", b.brand, b.type))
    d.answer(parse_reply(text(d.listing.cars)), BuyerReply("ok", decision, price))
    return d


@pytest.mark.parametrize("rule", ["paper", "code"])
def test_valid_sale_reward(rule):
    d = _sale_game("1_Volkswagen_van_65000", rule, lambda cs: offer(2, cs[1], "$68,600."), 68600)
    assert d.success and d.outcome.reward == pytest.approx(68600**2 / (65000 * 70000))


def test_paper_and_code_differ_where_the_paper_says(env):
    over = lambda cs: offer(2, cs[1], "$60,000.")  # noqa: E731  more than 10 % off $70,000
    paper, code = _sale_game("1_Volkswagen_van_65000", "paper", over, 60000), _sale_game("1_Volkswagen_van_65000", "code", over, 60000)
    assert (paper.outcome.reward, paper.success) == (0.0, False)
    assert code.success and code.outcome.reward == pytest.approx(0.5 * 60000**2 / (65000 * 70000))
    fake = Car("Volkswagen", "van", ("sunroof",), 70000)  # picked car 2, copied a car that is not in stock
    made_up = lambda cs: render_reply("why", "$68,600.", 2, fake)  # noqa: E731
    paper, code = _sale_game("1_Volkswagen_van_65000", "paper", made_up, 68600), _sale_game("1_Volkswagen_van_65000", "code", made_up, 68600)
    assert (paper.outcome.reward, paper.success) == (0.0, False) and "not in the database" in paper.outcome.reason
    assert (code.outcome.reward, code.success) == (0.0, True)
    b = buyer("1_Volkswagen_van_65000")
    none = lambda cs: offer(0, None, "Bye.")  # noqa: E731
    for rule, expected in (("paper", penalty(b)), ("code", 0.0)):
        assert _sale_game("1_Volkswagen_van_65000", rule, none, 0, "reject").outcome.reward == expected  # nothing proposed
        assert _sale_game("1_Volkswagen_van_65000", rule, lambda cs: offer(1, cs[0], "$55,000."), 0, "reject").outcome.reward == penalty(b)
    assert penalty(b) == pytest.approx(-(65000 - 67000) / 67000)


@pytest.mark.parametrize("rule, expected", [("paper", -(65000 - 67000) / 67000), ("code", 0.0)])
def test_a_timeout_costs_the_penalty_by_the_paper_only(rule, expected):
    env = registry.make("car_dealer", {"reward_rule": rule, "max_turns": 2})
    game = env.game(env.task("1_Volkswagen_van_65000"))
    game.reset()
    steps = [game.step(t) for t in (call("no_op"), offer(0, None, "Hi"), call("search_car_by_brand_type", "Volkswagen", "van"))]
    last = game.step(offer(2, game.state.listing.cars[1], "$70,000."))
    assert [s.reward for s in steps] == [0.0, 0.0, 0.0]
    assert last.truncated and not last.terminated and last.reward == pytest.approx(expected) and not game.success


def test_unmet_conditions_make_a_sale_invalid():
    # Type 3 weighs no car before the third, and the reward wants more than one car proposed.
    d = _sale_game("3_Volkswagen_van_50000", "paper", lambda cs: offer(1, cs[0], "$53,000."), 53000)
    assert not d.success and "only one car was proposed" in d.outcome.reason
    d = _sale_game("6_Kia_truck_60000", "paper", lambda cs: offer(2, cs[1], "$54,500."), 54500)
    assert not d.success and "under the buyer's threshold" in d.outcome.reason


def test_reward_range_bounds_every_sale_and_penalty(env):
    low, high = env.reward_range
    assert low == pytest.approx(-1.2448979591836735) and high == pytest.approx(3.135593220338983)
    assert all(low <= penalty(b) <= high for b in env.buyers.values())
    # A price above list counts at list: a buyer agreeing to any price cannot leave the range.
    d = _sale_game("6_Kia_truck_60000", "paper", lambda cs: offer(3, cs[2], "$900,000."), 900000)
    assert d.success and d.outcome.reward == pytest.approx(60000 / 60000)
    assert env.won(high) and not env.won(max(penalty(b) for b in env.buyers.values()))


# ---- the game in the chat format ----

def _expert_episode(env, task_id, seed=0):
    ep = new_episode(env, env.task(task_id), seed)
    play([ep], ScriptedAgent(lambda rng: env.policies(NOISE)["expert"]), seed, "test")
    return ep


def test_a_seller_turn_is_a_tool_call_a_tool_result_a_reply_and_the_buyer(env):
    ep = _expert_episode(env, "1_Volkswagen_van_65000")
    m = ep.messages
    assert [x["role"] for x in m[:2]] == ["system", "user"]
    body = m[2:]
    assert [x["role"] for x in body] == ["assistant", "tool", "assistant", "user"] * (len(body) // 4)
    for call_msg, tool, reply, user in zip(body[::4], body[1::4], body[2::4], body[3::4]):
        (tc,) = call_msg["tool_calls"]
        assert tc["type"] == "function" and tool["tool_call_id"] == tc["id"] and tool["name"] == tc["function"]["name"]
        assert isinstance(tc["function"]["arguments"], dict) and "tool_calls" not in reply
        assert call_msg["content"].startswith("REASON:") and reply["content"].startswith("REASON:")
    assert body[4]["tool_calls"][0]["function"] == {"name": "search_car_by_brand_type", "arguments": {"car_brand": "Volkswagen", "car_type": "van"}}
    row = ep.to_row()
    assert row["num_turns"] == len(row["turns"]) == len(body) // 2 == 6
    assert row["success"] and row["return"] == pytest.approx(68600**2 / (65000 * 70000))
    assert row["turns"][-1]["observation"].endswith("Decision=Accept, Buy_Price=$68600")
    assert env.max_turns == 20


def _read_back(rows, tmp_path, name="trajectories"):
    """`rows` written as table `name`, read back through the stage checks (none quarantined)."""
    path = tmp_path / f"{name}.parquet"
    write_table(to_table(rows, name), path, name)
    kept, quarantine = read_checked(path, name)
    assert quarantine.to_pylist() == []
    return from_table(kept)


def test_trajectories_round_trip_through_parquet_with_their_tool_calls(env, tmp_path):
    policies, tasks, rows = env.policies(NOISE), env.tasks("train")[::20], []
    for k, name in enumerate(("expert", "noisy", "random")):
        episodes = [new_episode(env, task, k) for task in tasks]
        play(episodes, ScriptedAgent(lambda rng, p=policies[name]: p), k, "test")
        rows += [e.to_row() for e in episodes]
    assert _read_back(rows, tmp_path) == rows  # tool_calls (arguments objects), tool_call_id, name; no keys added
    stored = read_table(tmp_path / "trajectories.parquet").column("messages")[0].as_py()
    assert stored[2]["tool_calls"][0]["function"]["arguments"] == json.dumps(rows[0]["messages"][2]["tool_calls"][0]["function"]["arguments"], separators=(",", ":"))
    assert stored[0] == {**rows[0]["messages"][0], "tool_calls": None, "tool_call_id": None, "name": None}  # absent keys are nulls in the file


def test_messages_read_back_load_as_trl_conversational_data_with_tools(env, tmp_path):
    from datasets import load_dataset
    from trl.data_utils import apply_chat_template, is_conversational

    from models.tiny import train_tokenizer

    ep = _expert_episode(env, "4_Kia_truck_51000")
    [row] = _read_back([ep.to_row()], tmp_path)
    messages = row["messages"]
    assert messages == ep.messages
    tok = train_tokenizer([env.system_prompt(), *(m["content"] for m in messages)], vocab_size=400)
    tools = env.tools()
    # The project's own template: both seller actions are supervised, the tool result is not.
    out = tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    supervised = tok.decode([t for t, keep in zip(out["input_ids"], out["assistant_masks"]) if keep])
    assert "API NAME: search_car_by_brand_type" in supervised and "CAR INDEX:" in supervised and "msrp=$" not in supervised
    # A tool-aware template, in the style of the common ones, sees the structured calls.
    template = (
        "{% if tools %}<|system|>{{ tools | tojson }}<|end|>{% endif %}"
        "{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|>{% generation %}{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}"
        "<|end|>{% endgeneration %}{% elif m.role == 'tool' %}<|tool|><response id=\"{{ m.tool_call_id }}\">{{ m.content }}</response><|end|>"
        "{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    )
    example = {"messages": messages}
    assert is_conversational(example)
    text = apply_chat_template(example, tok, tools=tools, chat_template=template)["text"]
    assert '<tool_call>{"name": "search_car_by_brand_type", "arguments": {"car_brand": "Kia", "car_type": "truck"}}</tool_call>' in text
    assert '<response id="call_2">1. brand=Kia' in text and '"name": "search_car_that_have_features"' in text
    # The export, written from the training table as standardize writes it, loads in datasets as the same chat.
    training = {"trajectory_id": row["trajectory_id"], "task_id": row["task_id"], "split": "train", "source": "policy", "parent_id": None,
                "relabel_id": None, "messages": messages, "reward": row["return"], "standardized_reward": 0.0, "weight": 1.0,
                "group_size": 1, "group_mean": row["return"], "group_std": None, "standardize_status": "singleton"}
    write_table(to_table([training], "training"), tmp_path / "train.parquet", "training")
    training_table = read_table(tmp_path / "train.parquet")
    training_table = training_table.append_column("tools", pa.array([json.dumps(tools)], pa.string()))
    write_table(training_table.select(EXPORT_COLUMNS), tmp_path / "export.parquet", "export")
    assert _read_back(from_table(read_table(tmp_path / "export.parquet")), tmp_path / "again", "export")[0]["messages"] == messages
    loaded = load_dataset("parquet", data_files=str(tmp_path / "export.parquet"), split="train")[0]
    assert loaded["messages"] == messages  # no null keys, arguments as objects
    assert json.loads(loaded["tools"]) == tools  # TRL's SFTTrainer hands it to the chat template
    assert apply_chat_template({"messages": loaded["messages"]}, tok, tools=tools, chat_template=template)["text"] == text


def test_unparseable_actions_cost_their_turn(env):
    game = env.game(env.task("1_Volkswagen_van_65000"))
    game.reset()
    s = game.step("Let me look at our vans.")
    assert not s.info["parsed"] and s.info["message"]["tool_calls"][0]["function"]["name"] == "no_op"
    assert s.info["turn"]["action"].startswith("API NAME: no_op")
    s = game.step("Hello!\nWhat car do you want?")
    assert not s.info["parsed"] and s.info["turn"]["action"].startswith("RESPONSE: Hello! What car do you want?\nCAR INDEX: 0")
    assert game.turn == 2 and not game.done


def test_restore_replays_a_prefix_and_refuses_a_changed_log(env):
    row = _expert_episode(env, "3_Volkswagen_van_50000").to_row()
    for k in (0, 3, 4, row["num_turns"] - 1):
        game = env.game(env.task(row["task_id"]))
        game.restore(row["turns"][:k])
        assert game.turn == k and game.state.phase == ("api" if k % 2 == 0 else "reply")
    tampered = [dict(t) for t in row["turns"][:3]]
    tampered[2]["observation"] = "1. brand=Kia ..."
    with pytest.raises(ValueError, match="shows other cars than logged"):
        env.game(env.task(row["task_id"])).restore(tampered)


def test_the_labeler_recomputes_the_return(env):
    row = _expert_episode(env, "5_Kia_truck_77000").to_row()
    label = env.label(row["task_id"], row["turns"])
    assert label.reward == pytest.approx(row["return"]) and label.success is True
    assert env.label(row["task_id"], row["turns"][:-1]).reward is None
    assert env.label("9_Nowhere_van_1", row["turns"]).reward is None
    # The logged decision stands: the same actions with a buyer who walked away score the penalty.
    walked = [dict(t) for t in row["turns"]]
    walked[-1]["observation"] = "No thanks.\nDecision=Reject, Buy_Price=$0"
    b = env.task(row["task_id"])
    assert env.label(row["task_id"], walked).reward == pytest.approx(penalty(b)) and env.label(row["task_id"], walked).success is False


def test_relabel_window_is_hopes_two_to_t_minus_one(env):
    assert env.relabel_turns(20) == list(range(4, 20))
    assert env.relabel_turns(6) == [4, 5]
    assert env.relabel_turns(4) == []


def test_same_action_compares_moves_not_words(env):
    car = cars("1_Volkswagen_van_65000")[1]
    body = lambda text: env.parse_action(text)[1]  # noqa: E731
    assert env.same_action(body(call("search_car_by_brand", "kia")), body(call("search_car_by_brand", "KIA")))
    assert not env.same_action(body(call("search_car_by_brand", "Kia")), body(call("search_car_by_type", car_type="truck")))
    assert env.same_action(body(offer(2, car, "It is yours for $70,000.")), body(offer(2, car, "Only $70,000!")))
    assert not env.same_action(body(offer(2, car, "$70,000.")), body(offer(2, car, "$68,600.")))


# ---- scripted sellers ----

def test_scripted_sellers_rank_expert_noisy_random(env):
    stats = {}
    for name in ("expert", "noisy", "random"):
        eps = [new_episode(env, t, k) for k, t in enumerate(env.tasks("train")[::4] + env.tasks("test")[::3])]
        play(eps, ScriptedAgent(lambda rng, n=name: env.policies(NOISE)[n]), 0, name)
        assert all(e.parse_failures == 0 for e in eps)
        stats[name] = sum(e.game.success for e in eps) / len(eps)
    assert stats["expert"] == 1.0 and stats["expert"] > stats["noisy"] > stats["random"]


def test_noise_rates_are_checked(env):
    with pytest.raises(ValueError, match="noise probabilities"):
        env.policies({"p_random": 0.8, "p_repeat": 0.3, "p_early_guess": 0.0})


# ---- oracle roles ----

def _noisy_row(env, task_id, seed):
    ep = new_episode(env, env.task(task_id), seed)
    play([ep], ScriptedAgent(lambda rng: env.policies({"p_random": 0.5, "p_repeat": 0.1, "p_early_guess": 0.2})["noisy"]), seed, "test")
    return ep.to_row()


def test_the_proposer_proposes_justified_actions_ranked_by_hindsight(env):
    b = env.task("2_Volkswagen_van_44000")
    game = env.game(b)
    game.reset()
    for text in (call("no_op"), offer(0, None, "Welcome!"), call("search_car_by_brand_type", "Volkswagen", "van")):
        game.step(text)
    game.step(offer(4, game.state.listing.cars[3], "$70,000."))
    prefix = records(game.state)
    assert "at least one of these features" in prefix[-1]["observation"]
    cfs = env.propose(b, prefix, 2)
    assert len(cfs) == 2 and cfs[0].text == env.render_action(cfs[0].reason, cfs[0].action)
    # Hindsight picks the planted feature, one the buyer named; nothing hidden enters the action.
    assert cfs[0].action == 'API NAME: search_car_that_have_features\nAPI BRAND: None\nAPI TYPE: None\nAPI FEATURES: ["Apple CarPlay"]'
    assert "44000" not in cfs[0].text and "type 2" in cfs[0].rationale and "a sale" in cfs[0].rationale
    game.step(cfs[0].text)
    replies = env.propose(b, records(game.state), 3)
    best = parse_reply(replies[0].text)
    assert len(replies) == 3 and "Apple CarPlay" in best.copied.features and best.copied in game.state.listing.cars
    assert all(str(b.budget) not in r.text.replace(",", "") or "$44,000" in r.text for r in replies)


def test_the_controller_names_the_worst_action(env):
    row = _noisy_row(env, "1_Volkswagen_van_65000", 3)
    places = env.critique(env.task(row["task_id"]), row["turns"], 2)
    assert places and all(not env.same_action(row["turns"][k]["action"], cf.action) for k, cf in places)


def test_the_summary_has_hopes_five_sections(env):
    row = _noisy_row(env, "6_Kia_truck_60000", 1)
    text = env.summarize(env.task(row["task_id"]), row["turns"], row["success"])
    assert parse_summary(text) == text and "Buyer type 6" in text


# ---- LLM roles: prompts and parsers ----

def test_llm_proposer_output_is_checked(env):
    b = env.task("1_Volkswagen_van_65000")
    row = _expert_episode(env, b.id).to_row()
    at_reply = row["turns"][:3]
    req = env.proposer_request(b, at_reply, 2, "The buyer wanted a discount.")
    assert "What it listed:\n1. brand=Volkswagen" in req.messages[1]["content"] and "The buyer wanted a discount." in req.messages[0]["content"]
    listed = env.dealership(b, at_reply).listing.cars[1]
    car = {"brand": listed.brand, "type": listed.type, "features": list(listed.features), "msrp": listed.msrp}
    good = json.dumps([{"teacher_reason": "t", "response": "It is $70,000.", "car_idx": 2, "proposed_car": car, "seller_reason": "the priciest van"}])
    (cf,) = req.parse(f"```json\n{good}\n```")
    assert cf.reason == "the priciest van" and cf.rationale == "t" and parse_reply(cf.text).car_index == 2
    for item, why in [
        ({"car_idx": 5}, "car_idx 5 is not 0 or a car of the 4 listed"),
        ({"proposed_car": {**car, "msrp": 1}}, "not car 2 of the list as listed"),
        ({"response": "For you, $60,000."}, "more than 10% off"),
        ({"seller_reason": "their budget is $65,000"}, "names \\$65000, which the buyer never said"),
    ]:
        bad = json.dumps([{"teacher_reason": "t", "response": "It is $70,000.", "car_idx": 2, "proposed_car": car, "seller_reason": "s", **item}])
        with pytest.raises(ValueError, match=why):
            req.parse(bad)
    api = env.proposer_request(b, row["turns"][:2], 1, "summary")
    (cf,) = api.parse('[{"teacher_reason": "t", "api_call": {"api_name": "search_car_by_brand", "api_brand": "volkswagen", "api_type": "", "api_features": []}, "seller_reason": "s"}]')
    assert cf.action.startswith("API NAME: search_car_by_brand\nAPI BRAND: Volkswagen")
    with pytest.raises(ValueError, match="without its brand or type"):
        api.parse('[{"teacher_reason": "t", "api_call": {"api_name": "search_car_by_brand", "api_brand": "", "api_type": "", "api_features": []}, "seller_reason": "s"}]')


def test_llm_controller_forward_labeler_judge_and_summary_parsers(env):
    b = env.task("1_Volkswagen_van_65000")
    row = _expert_episode(env, b.id).to_row()
    turns = row["turns"]
    ctl = env.controller_request(b, turns, 1)
    places = ctl.parse('[{"action": 3, "critique": "c", "replacement": {"api_call": {"api_name": "search_car_by_type", "api_brand": "", "api_type": "van", "api_features": []}, "seller_reason": "s"}}]')
    assert places[0][0] == 2 and places[0][1].action.startswith("API NAME: search_car_by_type")
    with pytest.raises(ValueError, match="action 99"):
        ctl.parse('[{"action": 99, "critique": "c", "replacement": {}}]')
    game = env.game(b)
    game.restore(turns[:3])
    fwd = env.forward_request(game)
    car = game.state.listing.cars[1]
    rest = [{"response": "$68,600 for you.", "car": {"brand": car.brand, "type": car.type, "features": list(car.features)}, "seller_reason": "s",
             "buyer": {"answer": "Deal.", "decision": "Accept", "price": 68600}}]
    (pair,) = fwd.parse(json.dumps(rest))
    assert pair[1] == BuyerReply("Deal.", "accept", 68600) and parse_reply(pair[0]).car_index == 2
    game.step(*pair)
    assert game.success and game.turn == 4
    with pytest.raises(ValueError, match="before the game ends"):
        fwd.parse(json.dumps([{**rest[0], "buyer": {"answer": "Hm.", "decision": "Negotiate", "price": 0}}]))
    lab = env.labeler_request(turns, [(turns, 0.7)])
    assert "Reward: 0.7" in lab.messages[1]["content"] and lab.parse("Reward: 1.25") == 1.25
    with pytest.raises(ValueError, match="outside"):
        lab.parse("Reward: 9")
    judge = env.judge_request(b.id, turns)
    scores = judge.parse("Needs: 8\nSearch: 7\nOffers: 9\nHonesty: 10\nOutcome: 9\nOverall: 9")
    assert scores["Overall"] == 9
    summary = env.summary_request(b, turns, True)
    assert "## Failure reason (if any)\nNone: the car was sold." in summary.messages[1]["content"]
    with pytest.raises(ValueError, match="missing sections"):
        summary.parse("### Summary of the buyer\nfine")
    assert all(len(env.prompt_hash(r)) == 12 for r in ("simulator", "summarizer", "proposer", "controller", "forward", "labeler", "judge"))


def test_the_forward_models_target_is_the_logged_rest_in_its_json_format_and_reads_back(env):
    b = env.task("1_Volkswagen_van_65000")
    row = _expert_episode(env, b.id).to_row()
    game = env.game(b)
    game.restore(row["turns"][:2])  # after the greeting: the next action is a call
    reply = env.forward_reply(game, row["turns"][2:])
    items = json.loads(reply.removeprefix("```json").removesuffix("```"))
    assert len(items) == row["num_turns"] - 2 and items[0]["api_call"]["api_name"] == "search_car_by_brand_type"
    assert items[-1]["buyer"] == {**items[-1]["buyer"], "decision": "Accept"} and items[-1]["buyer"]["price"] > 0
    pairs = env.forward_request(game).parse(reply)
    for text, answer in pairs:
        game.step(text, answer)
    assert game.success and records(game.state) == [{"action": t["action"], "observation": t["observation"]} for t in row["turns"]]
    # What the format cannot write is refused with the action named, never written otherwise.
    game = env.game(b)
    game.restore(row["turns"][:2])
    offer_at = next(i for i, t in enumerate(row["turns"]) if "CAR INDEX: 2" in t["action"])
    miscopied = [dict(t) for t in row["turns"]]
    miscopied[offer_at]["action"] = miscopied[offer_at]["action"].replace("PROPOSED CAR MSRP: 70000", "PROPOSED CAR MSRP: 60000")
    with pytest.raises(ValueError, match=f"logged action {offer_at + 1}: the reply's car 2 is not copied from the list shown"):
        env.forward_reply(game, miscopied[2:])
    sloppy = [dict(t) for t in row["turns"]]
    sloppy[2]["reason"] = ""  # an unparseable call, logged as a no_op without a reason
    with pytest.raises(ValueError, match="logged action 3 did not follow the seller's format"):
        env.forward_reply(game, sloppy[2:])
    # A continuation that stops early is the parser's unfinished: an answer, not a parse failure.
    with pytest.raises(Unfinished, match="before the game ends"):
        env.forward_request(game).parse("```json\n" + json.dumps(items[:2]) + "\n```")


def test_registered_with_its_options(env):
    assert "car_dealer" in registry.available()
    assert (env.options.max_turns, env.options.reward_rule, env.options.max_cars_shown, env.options.type6_quirk) == (10, "paper", 8, False)
    with pytest.raises(ValueError, match="reward_rule"):
        registry.make("car_dealer", {"reward_rule": "fancy"})
    with pytest.raises(ValueError, match="extra"):
        registry.make("car_dealer", {"show_candidates": True})


# ---- the real stages with env.name: car_dealer ----


def test_bootstrap_and_collect_store_car_dealer_trajectories(tmp_path):
    """Scripted demonstrations, the tiny model trained on them and its collect, on the tiny settings:
    the rows are written, read back through the checks and equal what was played. The demonstrations
    are longer than the tiny model's 1,024 positions: SFT cuts them, and counts them."""
    from transformers import AutoTokenizer

    from conftest import tiny_params
    from tasks.bootstrap import demonstrations, run_bootstrap
    from tasks.collect import run_collect
    from tasks.params import Params

    tokens = {"max_new_tokens": 100}  # the longest scripted action (97 tokens on this tokenizer) fits
    raw = tiny_params({"bootstrap": {"eval_sampling": tokens, "model": {"max_length": 1024}},  # positions some dialogues outgrow
                       "collect": {"splits": ["train"], "m": 1, "limit_tasks": 2}})
    raw["env"] = {"name": "car_dealer"}
    p = Params.model_validate(raw)
    m = run_bootstrap(p, tmp_path / "bootstrap")
    demos = [e.to_row() for e in demonstrations(p)]
    kept, quarantine = read_checked(tmp_path / "bootstrap/demos.parquet", "trajectories")
    assert quarantine.num_rows == 0 and sorted(from_table(kept), key=lambda r: r["trajectory_id"]) == sorted(demos, key=lambda r: r["trajectory_id"])
    tok = AutoTokenizer.from_pretrained(tmp_path / "bootstrap/model")
    lengths = [len(tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"]) for r in demos]
    assert m["demonstrations"]["truncated"] == sum(n > 1024 for n in lengths) > 0

    c = run_collect(p, tmp_path / "bootstrap/model", tmp_path / "collect")
    kept, quarantine = read_checked(tmp_path / "collect/trajectories.parquet", "trajectories")
    rows = from_table(kept)
    assert quarantine.num_rows == 0 and c["trajectories"] == len(rows) == 2
    for r in rows:
        body = r["messages"][2:]
        assert r["env"] == "car_dealer" and [x["role"] for x in body] == ["assistant", "tool", "assistant", "user"] * (len(body) // 4)
        assert all(tool["tool_call_id"] == call["tool_calls"][0]["id"] and isinstance(call["tool_calls"][0]["function"]["arguments"], dict)
                   for call, tool in zip(body[::4], body[1::4]))
    # The dialogues outgrow the model's positions too: the hf backend reads them whole and counts them.
    assert c["prompt_tokens"]["prompts_over_positions"] > 0

    # bench/seller_copy.py reads the same bootstrap output: every copied field of the first expert sales counted
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "bench/seller_copy.py", str(tmp_path / "bootstrap"), "--sales", "1"], cwd=root, check=True)
    probe = json.loads((tmp_path / "bootstrap/seller_copy.json").read_text())
    assert probe["sales"] == 1 and set(probe["fields"]) == {"API BRAND:", "API TYPE:", "CAR INDEX:", "PROPOSED CAR BRAND:", "PROPOSED CAR MSRP:", " for $"}
    assert all(0 <= f["right"] <= f["of"] for f in probe["fields"].values()) and probe["fields"]["API BRAND:"]["of"] >= 1


def test_scripted_sales_go_through_the_hindsight_stages_and_the_export_carries_the_tools(tmp_path, tiny_model_dir):
    """summarize, relabel (HOPE's window [2, T-1]), regenerate with a model, label and standardize
    on CarDealer, with its oracle roles: every row passes the checks, and the export holds the
    database APIs beside each dialogue, as TRL reads them."""
    from datasets import load_dataset

    from conftest import tiny_params
    from tasks.bootstrap import demonstrations
    from tasks.label import run_label
    from tasks.params import Params
    from tasks.regenerate import run_regenerate
    from tasks.relabel import run_relabel
    from tasks.standardize import run_standardize
    from tasks.summarize import run_summarize

    tokens = {"max_new_tokens": 100}
    raw = tiny_params({"bootstrap": {"demos_per_task": 1, "limit_tasks": 2, "eval_sampling": tokens,
                                     "behaviour_mix": {"expert": 0.4, "noisy": 0.3, "random": 0.3}},
                       "regenerate": {"sampling": tokens}})
    raw["env"] = {"name": "car_dealer"}
    p = Params.model_validate(raw)
    env = p.env.environment()
    demos = demonstrations(p)
    write_table(to_table([e.to_row() for e in demos], "trajectories"), tmp_path / "trajectories.parquet", "trajectories")
    logged = {r["trajectory_id"]: r for r in from_table(read_table(tmp_path / "trajectories.parquet"))}
    n = len(logged)

    assert run_summarize(p, tmp_path / "trajectories.parquet", tmp_path)["summaries"] == n
    summaries = read_table(tmp_path / "summaries.parquet").to_pylist()
    assert all("### Summary of the buyer" in s["summary"] for s in summaries)
    m = run_relabel(p, tmp_path / "trajectories.parquet", tmp_path / "summaries.parquet", tmp_path / "relabel")
    relabels = read_table(tmp_path / "relabel/relabels.parquet").to_pylist()
    assert m["relabels"] == len(relabels) > 0
    for r in relabels:
        assert 2 <= r["branch_turn"] <= logged[r["trajectory_id"]]["num_turns"] - 1

    run_regenerate(p, tmp_path / "trajectories.parquet", tmp_path / "relabel/relabels.parquet", tiny_model_dir, tmp_path / "regen")
    kept, quarantine = read_checked(tmp_path / "regen/trajectories.parquet", "trajectories")
    regens = from_table(kept)
    assert quarantine.num_rows == 0 and len(regens) == len(relabels)
    for g in regens:
        parent = logged[g["parent_id"]]
        # The logged prefix is kept as it was, tool calls and results included, up to the branch.
        assert g["source"] == "regeneration" and g["turns"][: g["branch_turn"]] == parent["turns"][: g["branch_turn"]]
    labels = run_label(p, [tmp_path / "trajectories.parquet", tmp_path / "regen/trajectories.parquet"], tmp_path / "label")
    assert labels["labels"] == n + len(regens) and labels["logged_return_mismatches"] == 0

    run_standardize(p, [tmp_path / "trajectories.parquet", tmp_path / "regen/trajectories.parquet"], tmp_path / "label/labels.parquet", tmp_path / "std")
    kept, quarantine = read_checked(tmp_path / "std/export/train.parquet", "export")
    assert quarantine.num_rows == 0 and kept.num_rows == n + len(regens)
    loaded = load_dataset("parquet", data_files=str(tmp_path / "std/export/train.parquet"), split="train")
    assert all(json.loads(t) == env.tools() for t in loaded["tools"])
    assert any(m.get("tool_calls") for m in loaded[0]["messages"])
