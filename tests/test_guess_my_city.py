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


# ---- scripted policies ----

NOISE = {"p_random": 0.15, "p_repeat": 0.10, "p_early_guess": 0.10}


def GuessMyCityEnv(**options):
    from envs import registry

    return registry.make("guess_my_city", options)


@pytest.fixture(scope="module")
def env():
    return GuessMyCityEnv()


def _play(env, policy, task, seed: int) -> list[dict]:
    """One game of a scripted policy; its turn records as a trajectory stores them."""
    import random

    game, rng, turns = env.game(task), random.Random(seed), []
    game.reset()
    while not game.done:
        step = game.step(policy.act(game, rng))
        turns.append({**step.info["turn"], "reward": step.reward})
    return turns


def _turns(env, task, topics: list[str]) -> list[dict]:
    """Turn records of the oracle's questions on `topics` about `task`, answered as the oracle does."""
    from envs.guess_my_city.oracle import QUESTIONS

    text = {q.topic: q.text for q in QUESTIONS}
    return [{"action": text[t], "observation": env.oracle.says(task, t)} for t in topics]


@pytest.mark.parametrize("split", SPLITS)
def test_the_expert_wins_every_game_on_every_split(env, split):
    expert = env.policies(NOISE)["expert"]
    for task in env.tasks(split):
        turns = _play(env, expert, task, 0)
        assert env.label(task.id, turns).success, f"{task.id}: {[t['action'] for t in turns]}"
        assert len(turns) <= 6  # general to specific, it needs at most five questions


def test_the_expert_goes_general_to_specific_and_its_guess_says_what_the_answers_established(env):
    turns = _play(env, env.policies(NOISE)["expert"], env.task("Busan, South Korea"), 0)
    assert [t["action"] for t in turns] == [
        "What part of the world is it in?", "What language do people speak there?", "How many people live there?",
        "Does it lie on the sea, a river or a lake?", "Is the city Busan?",
    ]
    assert turns[0]["reason"] == "Ask about the part of the world."
    assert turns[-1]["reason"] == "in East Asia, speaks Korean, 3-10M people, coastal: only Busan fits."


def test_the_expert_beats_noisy_which_beats_random(env):
    policies = env.policies(NOISE)
    tasks = env.tasks("train")[:40]
    wins = {name: sum(env.label(t.id, _play(env, p, t, k)).success for t in tasks for k in range(2)) for name, p in policies.items()}
    assert wins["expert"] == 80 > wins["noisy"] > wins["random"]


def test_policies_are_deterministic_given_the_seed_and_write_the_action_format(env):
    import random

    from envs.reason_question import parse_action

    task = env.task("Quito, Ecuador")
    for name, policy in env.policies(NOISE).items():
        turns = _play(env, policy, task, 7)
        assert turns == _play(env, policy, task, 7), name
        assert all(t["reason"] for t in turns)
    game = env.game(task)
    text = env.policies(NOISE)["noisy"].act(game, random.Random(0))
    assert parse_action(text).question


def test_the_noisy_policy_validates_its_probabilities(env):
    with pytest.raises(ValueError, match="sum to at most 1"):
        env.policies({"p_random": 0.6, "p_repeat": 0.5, "p_early_guess": 0.0})


def test_answers_outside_the_knowledge_base_settle_nothing(env):
    from envs.guess_my_city.policies import PlayerView, consistent, known

    quito = env.task("Quito, Ecuador")
    history = [("What part of the world is it in?", env.oracle.says(quito, "continent")), ("What is the name of the city?", "I can't say."),
               ("What is the weather like?", "Lovely, mostly."), ("Who is the mayor?", "unknown")]
    left = consistent(env.oracle, PlayerView(env.candidates, history, 4, 10))
    assert {c.country for c in left} == {"Ecuador"} and len(left) > 1
    assert known(env.oracle, history) == "in the Andes of South America"


# ---- oracle proposer and controller ----


def _prefixes(env):
    """Every prefix of noisy and random games on a few cities of each split."""
    for split in SPLITS:
        for task in env.tasks(split)[:8]:
            for name in ("noisy", "random"):
                turns = _play(env, env.policies({"p_random": 0.3, "p_repeat": 0.2, "p_early_guess": 0.2})[name], task, 1)
                for j in range(len(turns)):
                    yield task, turns[:j]


def test_the_proposer_guesses_only_the_one_city_left_before_the_last_turn(env):
    from envs.guess_my_city.game import guessed_city
    from envs.guess_my_city.policies import consistent

    guesses = 0
    for task, prefix in _prefixes(env):
        view = env.view(prefix)
        left = consistent(env.oracle, view)
        for c in env.propose(task, prefix, 3):
            city = guessed_city(env.cities, c.action)
            if city is not None:
                guesses += 1
                assert view.is_final_turn or left == [city], f"{task.id} after {[t['action'] for t in prefix]}: guessed {city.name}"
                assert c.reason.endswith(f"only {city.name} fits.") or view.is_final_turn
            else:
                assert c.action not in [t["action"] for t in prefix]
    assert guesses > 0


def test_a_last_turn_guess_is_the_rules_pick_whatever_the_secret(env):
    topics = ["continent", "language"]  # ten Korean cities fit
    busan, seoul = env.task("Busan, South Korea"), env.task("Seoul, South Korea")
    short = GuessMyCityEnv(max_turns=3)
    for task in (busan, seoul):
        [c] = short.propose(task, _turns(short, busan, topics), 2)
        assert c.action == "Is the city Seoul?" and c.reason == "Last turn, guess Seoul."
    assert "right" in short.propose(seoul, _turns(short, busan, topics), 1)[0].rationale
    assert "wrong" in short.propose(busan, _turns(short, busan, topics), 1)[0].rationale


def test_hindsight_chooses_which_question_among_those_the_player_could_justify(env):
    from envs.guess_my_city.policies import best_questions, consistent

    topics = ["continent", "language"]
    firsts = {}
    for name in ("Busan, South Korea", "Daegu, South Korea", "Seoul, South Korea"):
        task = env.task(name)
        prefix = _turns(env, task, topics)
        view = env.view(prefix)
        allowed = {q.text for q in best_questions(env.oracle, consistent(env.oracle, view), view.history)}
        proposals = env.propose(task, prefix, 3)
        assert len(proposals) == 3 and {c.action for c in proposals} <= allowed
        assert all(name.split(",")[0] not in c.reason for c in proposals) and name.split(",")[0] in proposals[0].rationale
        firsts[name] = proposals[0].action
    assert firsts["Daegu, South Korea"] == "What is the climate like?"  # leaves Daegu alone
    assert firsts["Busan, South Korea"] == "How many people live there?"  # leaves Busan and Incheon


def test_one_city_left_is_guessed_with_what_established_it(env):
    busan = env.task("Busan, South Korea")
    [c] = env.propose(busan, _turns(env, busan, ["continent", "language", "size", "water"]), 2)
    assert c.action == "Is the city Busan?"
    assert c.reason == "in East Asia, speaks Korean, 3-10M people, coastal: only Busan fits."


def test_a_guess_of_the_secret_is_refused_where_the_answers_do_not_single_it_out(env):
    from envs.guess_my_city.proposer import unjustified_guess

    busan = env.task("Busan, South Korea")
    view = env.view(_turns(env, busan, ["continent", "language"]))
    assert "while 10 cities still fit" in unjustified_guess(env.oracle, busan, view, "Is the city Busan?")
    assert unjustified_guess(env.oracle, busan, view, "Is the city Seoul?") is None  # a wrong guess uses no hindsight
    assert unjustified_guess(env.oracle, busan, view, "How many people live there?") is None
    done = env.view(_turns(env, busan, ["continent", "language", "size", "water"]))
    assert unjustified_guess(env.oracle, busan, done, "Is it Pusan?") is None


def test_the_controller_names_the_turns_that_lost_most(env):
    busan = env.task("Busan, South Korea")
    # The time zone tells Korea from China as well as the language would; the language after it
    # tells nothing new, where the city's size would have.
    turns = _turns(env, busan, ["hemisphere", "continent", "time_zone", "language"])
    places = env.critique(busan, turns, 3)
    assert [turn for turn, _ in places] == [0, 3]
    assert places[1][1].action == "How many people live there?"
    assert places[0][1].action == "What part of the world is it in?" and "Busan" in places[0][1].rationale
    assert all("Busan" not in c.reason for _, c in places)


def test_same_action_reads_topics_and_guesses(env):
    assert env.same_action("What is the weather like?", "What is the climate like?")
    assert env.same_action("Is it Pusan?", "Is the city Busan?")
    assert not env.same_action("Is the city Busan?", "Is the city Seoul?")
    assert not env.same_action("What is the weather like?", "Who is the mayor?")
    assert not env.same_action("Who is the mayor?", "Who runs the football club?")


# ---- oracle summarizer ----


def test_the_summary_names_the_city_what_was_established_and_what_went_wrong(env):
    busan = env.task("Busan, South Korea")
    turns = _turns(env, busan, ["hemisphere", "hemisphere"]) + [
        {"action": "Who is the mayor?", "observation": "unknown"},
        {"action": "Which city is it?", "observation": "I can't tell you."},
        {"action": "Is the city Seoul?", "observation": "no"},
    ]
    summary = env.summarize(busan, turns, False)
    assert summary.startswith("The secret city was Busan, in South Korea (Asia). The answers established: northern hemisphere.")
    for part in ("never asked what part of the world the city is in (East Asia)", "repeated 1 question", "asked 1 question the answerer could not answer",
                 "asked for the name of the city or its country 1 time", "guessed Seoul while 128 cities still fit the answers, wrongly",
                 "failed to find the city in 5 questions"):
        assert part in summary, part


def test_the_summary_of_a_win_and_of_a_game_that_never_guessed(env):
    busan = env.task("Busan, South Korea")
    won = _turns(env, busan, ["continent", "language", "size", "water"]) + [{"action": "Is the city Busan?", "observation": "yes"}]
    summary = env.summarize(busan, won, True)
    assert "At question 5 it guessed Busan once only that city fit the answers, rightly." in summary
    assert summary.endswith("It found the city in 5 questions.") and "The player" not in summary
    never = _turns(env, busan, ["continent", "language", "size", "water", "climate"])
    assert "Only one city fit the answers after question 4, but it never guessed." in env.summarize(busan, never, False)


# ---- fact sheets ----


def test_fact_sheets_are_true_identify_their_city_and_go_general_to_specific(env):
    import random

    from envs.guess_my_city.facts import identifying_facts

    rng = random.Random(0)
    for city in env.candidates:
        facts = identifying_facts(env.oracle, city, rng)
        fits = [c for c in env.candidates if all(env.oracle.says(c, q.topic) == env.oracle.says(city, q.topic) for q in facts)]
        assert fits == [city], f"{city.id}: {[c.id for c in fits]}"
        assert [q.level for q in facts] == sorted(q.level for q in facts)


def test_fact_sheets_cover_every_split_in_the_words_of_a_guess(env):
    import re

    from envs import registry
    from envs.guess_my_city.facts import FACTS_SYSTEM

    env = registry.make("guess_my_city", {"facts_per_object": 2})
    sheets = env.fact_sheets(7)
    assert sheets == env.fact_sheets(7) != env.fact_sheets(8)
    by_name = {c.name: c for c in env.candidates}
    labels = {label: t for (t, _), label in env.oracle.labels.items()}
    named = []
    for sheet in sheets:
        assert sheet[0] == {"role": "system", "content": FACTS_SYSTEM}
        for user, assistant in zip(sheet[1::2], sheet[2::2], strict=True):
            city = by_name[re.fullmatch(r"only (.+) fits\.", assistant["content"]).group(1)]
            named.append(city)
            for label in user["content"].removesuffix(":").split(", "):
                assert env.oracle.labels[(labels[label], env.oracle.says(city, labels[label]))] == label, (city.id, label)
    assert sorted(c.id for c in named) == sorted(c.id for c in env.candidates for _ in range(2))
    assert {c.split for c in named} == set(SPLITS)
    assert all(len(s) <= 17 for s in sheets)  # 8 riddles and the system message


# ---- the LLM roles: prompts and parsers on hand-written replies ----


def test_every_role_has_a_prompt_hash_and_every_oracle_role_a_version(env):
    from envs.guess_my_city.env import TEMPLATES

    assert len({env.prompt_hash(role) for role in TEMPLATES}) == len(TEMPLATES)
    assert {env.oracle_version(role) for role in ("summarizer", "proposer", "controller", "labeler")}


def test_the_llm_simulator_answers_questions_and_leaves_guesses_to_the_rules(env):
    from envs.base import EMPTY_REPLY

    game = env.game(env.task("Busan, South Korea"))
    game.reset()
    assert game.simulator_request(env.render_action("", "Is the city Busan?")) is None
    assert game.simulator_request("Is it Pusan?") is None
    assert game.simulator_request(EMPTY_REPLY) is None
    request = game.simulator_request(env.render_action("start broad", "Is it by the sea?"))
    system, user = (m["content"] for m in request.messages)
    assert "Busan, in South Korea" in system and user == "Is it by the sea?"
    answer = request.parse("REASON: Busan is a port on the south-east coast of Korea.\nANSWER: Yes, it is a big port city.\nANSWER: more")
    assert (answer.text, answer.is_guess, answer.correct) == ("Yes, it is a big port city.", False, False)
    step = game.step(env.render_action("start broad", "Is it by the sea?"), answer)
    assert step.info["turn"]["observation"] == "Yes, it is a big port city." and step.reward == -1.0
    assert game.simulator_failed("Is it by the sea?").text == "unknown"


@pytest.mark.parametrize(
    "reply, message",
    [
        ("Yes, it is by the sea.", "missing 'ANSWER:'"),
        ("REASON: it is a port.\nANSWER:   ", "empty answer"),
        ("REASON: x\nANSWER: It is Busan, of course.", "names 'Busan'"),
        ("REASON: x\nANSWER: They call it pusan.", "names 'Pusan'"),
        ("REASON: x\nANSWER: It is in south korea.", "names 'South Korea'"),
        ("REASON: x\nANSWER: " + "very " * 80 + "big", "over 300"),
        ("## Questions and answers\nANSWER: yes", "repeats the prompt"),
    ],
)
def test_the_llm_simulators_bad_replies_are_refused(env, reply, message):
    game = env.game(env.task("Busan, South Korea"))
    with pytest.raises(ValueError, match=message):
        game.simulator_request("Is it by the sea?").parse(reply)


def test_the_llm_summarizer_is_told_the_city_and_the_game(env):
    busan = env.task("Busan, South Korea")
    turns = _turns(env, busan, ["continent"])
    request = env.summary_request(busan, turns, False)
    system, user = (m["content"] for m in request.messages)
    assert "Busan, in South Korea (Asia)" in user and "Q1: What part of the world is it in?" in user
    assert "Portoviejo, Ecuador" in system and "The player did not find it." in user
    assert request.parse("  The secret city was Busan.\nThe player asked one question. ") == "The secret city was Busan. The player asked one question."
    with pytest.raises(ValueError, match="repeats the prompt"):
        request.parse(user)
    assert "Portoviejo" not in GuessMyCityEnv(show_candidates=False).summary_request(busan, turns, False).messages[0]["content"]


def _proposals(*items) -> str:
    import json

    return "```json\n" + json.dumps([dict(zip(("teacher_reason", "question", "player_reason"), item, strict=True)) for item in items]) + "\n```"


def test_the_llm_proposer_parses_moves_the_player_could_make(env):
    busan = env.task("Busan, South Korea")
    prefix = _turns(env, busan, ["continent", "language"])
    request = env.proposer_request(busan, prefix, 2, "The secret city was Busan.")
    system, user = (m["content"] for m in request.messages)
    assert "The secret city was Busan." in system and "Q2: What language do people speak there?" in user and "question 3 of 10" in user
    out = request.parse(_proposals(
        ("Busan is a big port: the coast splits the Korean cities.", "Is it on the coast?", "Ten Korean cities are left; the coast splits them."),
        ("Size narrows Busan to two.", "How big is it?", "Size comes next."),
    ))
    assert [c.action for c in out] == ["Is it on the coast?", "How big is it?"]
    assert out[0].text == "REASON: Ten Korean cities are left; the coast splits them.\nQUESTION: Is it on the coast?"
    assert "Busan" in out[0].rationale and out[0].reason == "Ten Korean cities are left; the coast splits them."
    done = _turns(env, busan, ["continent", "language", "size", "water"])
    [guess] = env.proposer_request(busan, done, 1, "").parse(_proposals(("Only Busan is left.", "Is the city Busan?", "Only one city fits.")))
    assert guess.action == "Is the city Busan?"


@pytest.mark.parametrize(
    "item, message",
    [
        (("t", "Is the city Busan?", "A big Korean port."), "proposal 0: the question guesses the secret while 10 cities still fit"),
        (("t", "What is the name of the city?", "Just ask."), "proposal 0: the question asks for the name of the city"),
        (("t", "Which country is it in?", "Just ask."), "asks for the name"),
        (("t", "Is it on the coast?", "It could be Busan."), "player_reason names the hidden city"),
        (("t", "Is it on the coast?", "It could be Pusan."), "player_reason names the hidden city"),
    ],
)
def test_the_llm_proposers_bad_moves_are_refused(env, item, message):
    busan = env.task("Busan, South Korea")
    request = env.proposer_request(busan, _turns(env, busan, ["continent", "language"]), 1, "")
    with pytest.raises(ValueError, match=message):
        request.parse(_proposals(item))


def test_the_llm_controller_parses_places_and_refuses_hindsight_guesses(env):
    busan = env.task("Busan, South Korea")
    turns = _turns(env, busan, ["hemisphere", "continent", "language"])
    request = env.controller_request(busan, turns, 2)
    assert "The secret city was Busan." in request.messages[1]["content"]
    out = request.parse('1. "Which hemisphere is it in?";too broad;"What part of the world is it in?"/\n2. "What language do people speak there?";fine;"How big is it?"/')
    assert [(turn, c.action, c.reason) for turn, c in out] == [(0, "What part of the world is it in?", ""), (2, "How big is it?", "")]
    assert out[0][1].rationale == "too broad"
    with pytest.raises(ValueError, match="place 1: the replacement guesses the secret while 20 cities"):
        request.parse('1. "What language do people speak there?";x;"Is the city Busan?"/')
    with pytest.raises(ValueError, match="asks for the name"):
        request.parse('1. "Which hemisphere is it in?";x;"What is the city called?"/')
    with pytest.raises(ValueError, match="never asked"):
        request.parse('1. "Is it big?";x;"How big is it?"/')


def _forward_game(env, topics):
    busan = env.task("Busan, South Korea")
    game = env.game(busan)
    game.reset()
    for t in _turns(env, busan, topics):
        game.step(env.render_action("", t["action"]))
    return game


def test_the_llm_forward_model_replays_to_the_end_of_the_game(env):
    game = _forward_game(env, ["continent", "language"])
    request = env.forward_request(game)
    assert "Busan, in South Korea" in request.messages[0]["content"] and "from Q3" in request.messages[1]["content"]
    pairs = request.parse("Q3: How big is it?\nA3: Very big, several million people.\nQ4: Is it on the coast?\nA4: Yes, a port.\n"
                          "Q5: Is the city Seoul?\nA5: yes")
    assert [a.text for _, a in pairs] == ["Very big, several million people.", "Yes, a port.", "no"]  # the rules answer a guess
    assert pairs[-1][1].is_guess and not pairs[-1][1].correct
    assert pairs[0][0] == "REASON: \nQUESTION: How big is it?"
    # Answers in the knowledge base's words single Busan out, so the player may guess it.
    won = request.parse(f"Q3: How big is it?\nA3: {env.oracle.says(game.task, 'size')}\nQ4: Coast?\nA4: It lies on the sea coast.\n"
                        "Q5: Is the city Busan?\nA5: yes")
    assert won[-1][1].correct
    with pytest.raises(ValueError, match="Q5 guesses the secret while 3 cities still fit"):  # "3-10M people" is no answer it knows
        request.parse("Q3: How big is it?\nA3: 3-10M people.\nQ4: Coast?\nA4: It lies on the sea coast.\nQ5: Is the city Busan?\nA5: yes")


@pytest.mark.parametrize(
    "text, message",
    [
        ("Q3: How big is it?\nA3: big", "stops at Q3 before the game ends"),
        ("Q3: Is the city Busan?\nA3: yes", "Q3 guesses the secret while 10 cities still fit"),
        ("Q3: How big is it?\nA3: As big as Busan gets.\nQ4: Is the city Seoul?\nA4: no", "A3: the answer names 'Busan'"),
        ("Q3: Is the city Seoul?\nA3: no\nQ4: How big is it?\nA4: big", "Q4 comes after the game ended"),
        ("Q3: What is its name?\nA3: I can't say.\nQ4: Is the city Seoul?\nA4: no", "Q3 asks for the name"),
        ("Q3: How big is it?\nA3:\nQ4: Is the city Seoul?\nA4: no", "expected 'A3: <answer>'"),
        ("Q4: How big is it?\nA4: big", "expected 'Q3"),
    ],
)
def test_the_llm_forward_models_bad_continuations_are_refused(env, text, message):
    with pytest.raises(ValueError, match=message):
        env.forward_request(_forward_game(env, ["continent", "language"])).parse(text)


def test_the_llm_labeler_and_judge_parse_their_replies(env):
    busan = env.task("Busan, South Korea")
    turns = _turns(env, busan, ["continent"]) + [{"action": "Is the city Seoul?", "observation": "no"}]
    request = env.labeler_request(turns, [(turns, -10.0)])
    assert "<Game 1>" in request.messages[1]["content"] and "Reward: -10" in request.messages[1]["content"]
    assert request.parse("Reward: -10") == -10.0
    with pytest.raises(ValueError, match=r"outside \[-10, 0\]"):
        request.parse("Reward: -20")
    judge = env.judge_request(busan.id, turns)
    assert "The secret city: Busan, South Korea" in judge.messages[1]["content"]
    scores = judge.parse("Progress: 2\nQuestion quality: 6\nConsistency: 8\nEfficiency: 1\nOutcome: 0\nOverall: 2")
    assert scores["Overall"] == 2.0
    with pytest.raises(ValueError, match="missing scores: Question quality"):
        judge.parse("Progress: 2")


def test_the_tokenizer_corpus_holds_every_citys_names_and_answers(env):
    corpus = "\n".join(env.tokenizer_corpus())
    for city in env.tasks("test"):
        assert all(n in corpus for n in city.names) and env.oracle.says(city, "landmark") in corpus
    assert "REASON:" in corpus


# ---- the real stages with env.name: guess_my_city ----


def _params(**overrides):
    from conftest import tiny_params
    from tasks.params import Params

    # No candidate list: the tiny untrained model reads short prompts. Every policy sampling may
    # write the longest scripted action (a guess lists what the answers established).
    tokens = {"max_new_tokens": 64}
    raw = tiny_params({"env": {"name": "guess_my_city", "max_turns": 10, "show_candidates": False},
                       "bootstrap": {"behaviour_mix": {"expert": 0.2, "noisy": 0.4, "random": 0.4}, "demos_per_task": 3, "eval_sampling": tokens},
                       "collect": {"sampling": tokens}, "regenerate": {"sampling": tokens}, **overrides})
    return Params.model_validate(raw)


def test_scripted_demonstrations_go_through_summarize_relabel_regenerate_and_label(tmp_path, tiny_model_dir):
    from storage.parquet import read_table, write_table
    from storage.schema import to_table
    from tasks.bootstrap import demonstrations
    from tasks.label import run_label
    from tasks.regenerate import run_regenerate
    from tasks.relabel import run_relabel
    from tasks.summarize import run_summarize

    p = _params()
    demos = demonstrations(p)
    assert len(demos) == 9 and {e.task.split for e in demos} == {"train"}
    write_table(to_table([e.to_row() for e in demos], "trajectories"), tmp_path / "trajectories.parquet", "trajectories")
    logged = read_table(tmp_path / "trajectories.parquet").to_pylist()
    assert {r["env"] for r in logged} == {"guess_my_city"} and {r["policy_id"] for r in logged} >= {"scripted:noisy", "scripted:random"}

    assert run_summarize(p, tmp_path / "trajectories.parquet", tmp_path)["summaries"] == 9
    m = run_relabel(p, tmp_path / "trajectories.parquet", tmp_path / "summaries.parquet", tmp_path / "relabel")
    relabels = read_table(tmp_path / "relabel/relabels.parquet").to_pylist()
    assert m["proposed"] == m["relabels"] + m["dropped_equal"] and m["relabels"] == len(relabels) > 0
    by_id = {r["trajectory_id"]: r for r in logged}
    for r in relabels:
        assert 0.3 * by_id[r["trajectory_id"]]["num_turns"] <= r["branch_turn"] < 0.8 * by_id[r["trajectory_id"]]["num_turns"]

    run_regenerate(p, tmp_path / "trajectories.parquet", tmp_path / "relabel/relabels.parquet", tiny_model_dir, tmp_path / "regen")
    regens = read_table(tmp_path / "regen/trajectories.parquet").to_pylist()
    assert len(regens) == len(relabels) and all(t["source"] == "regeneration" and t["env"] == "guess_my_city" for t in regens)
    labels = run_label(p, [tmp_path / "trajectories.parquet", tmp_path / "regen/trajectories.parquet"], tmp_path / "label")
    assert labels["labels"] == 9 + len(regens) and labels["status"] == {"ok": 9 + len(regens)} and labels["logged_return_mismatches"] == 0


def test_collect_plays_guess_my_city_with_a_model(tmp_path, tiny_model_dir):
    from storage.parquet import read_table
    from tasks.collect import run_collect

    m = run_collect(_params(), tiny_model_dir, tmp_path)
    rows = read_table(tmp_path / "trajectories.parquet").to_pylist()
    assert m["trajectories"] == len(rows) == 12  # 3 tasks of train and of val, 2 each
    for r in rows:
        assert r["env"] == "guess_my_city" and r["messages"][0]["content"].startswith("You are playing a game where you must guess where")
        assert r["num_turns"] == len(r["turns"]) <= 10 and -10.0 <= r["return"] <= 0.0
