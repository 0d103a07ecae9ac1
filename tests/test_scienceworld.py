"""ScienceWorld: tasks and splits from the variations table, ETO's Thought/Action format, the
score map, the step limit, the history knob, the scripted agents, the pool's replay after a
JVM's death and the missing-Java error, all on real episodes recorded once
(tests/data/scienceworld_episodes.json, written by `python -m envs.scienceworld.record
tests/data/scienceworld_episodes.json`) with no
JVM; the oracle hindsight roles and the LLM roles' parsers on hand-made turns; then, in the
system tier, the real simulator: a train variation's gold path played to 1.0 through the
environment interface, the table and the recording checked against it, a killed and a hung JVM,
every JVM closed, the one-line error of a run without Java, and the proposer bringing an agent
back to the gold path."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from envs import registry
from envs.scienceworld import simulator
from envs.scienceworld.env import DEFAULT_TASK_TYPES, STEP_LIMITS, ScienceWorld, ScienceWorldOptions
from envs.scienceworld.format import ActionParseError, cut, parse_action, render_action
from envs.scienceworld.policies import expert_path, next_gold, thought
from envs.scienceworld.record import GOLD_ERROR, Recorded
from envs.scienceworld.tables import gold_table, stored, table

ROOT = Path(__file__).resolve().parents[1]
RECORDING = ROOT / "tests" / "data" / "scienceworld_episodes.json"
NOISE = {"p_random": 0.0, "p_repeat": 0.0, "p_early_guess": 0.0}


def recorded_env(crash_at: int | None = None, restarts: int = 2, **options) -> tuple[ScienceWorld, Recorded]:
    env = ScienceWorld(ScienceWorldOptions(**options))
    backend = Recorded(RECORDING, crash_at=crash_at)
    env.use_pool(backend.pool(restarts))
    return env, backend


def expert_episode(env: ScienceWorld, task_id: str):
    game = env.game(env.task(task_id))
    opening, _ = game.reset()
    expert, rng = env.policies(NOISE)["expert"], random.Random(0)
    steps = []
    while not game.done:
        steps.append(game.step(expert.act(game, rng)))
    return game, opening, steps


def recording() -> list[dict]:
    return json.loads(RECORDING.read_text())["episodes"]


# ---- tasks and splits: no JVM ----


def test_the_environment_is_registered_and_builds_without_a_jvm():
    assert "scienceworld" in registry.available()
    env = registry.make("scienceworld", {})
    assert env.options.task_types == DEFAULT_TASK_TYPES and env.splits == ("train", "val", "test")
    assert simulator.running_jvms() == []  # building (as params validation does) starts nothing


def test_tasks_are_the_simulators_variations_per_split_interleaved():
    env = ScienceWorld(ScienceWorldOptions())
    assert {s: len(env.tasks(s)) for s in env.splits} == {"train": 4 * 150 + 3 * 62, "val": 4 * 75 + 3 * 31, "test": 4 * 75 + 3 * 32}
    assert [t.id for t in env.tasks("train")[:8]] == [*(f"{t}-0" for t in DEFAULT_TASK_TYPES), "find-animal-1"]
    # the simulator's dev variations are val (ETO's seen ones), its test variations test
    assert table()["find-animal"] == {"train": tuple(range(150)), "val": tuple(range(150, 225)), "test": tuple(range(225, 300))}
    for split in env.splits:
        tasks = env.tasks(split)
        assert len({t.id for t in tasks}) == len(tasks) and all(env.task(t.id) == t for t in tasks)
    assert env.task("lifespan-shortest-lived-93").split == "test"
    assert env.task("boil-3").split == "train"  # any task type's id is known (logged rows of other types)
    for bad in ("find-animal-300", "find-animal", "fly-0", "find-animal-x"):
        with pytest.raises(KeyError, match="unknown ScienceWorld task"):
            env.task(bad)
    small = ScienceWorld(ScienceWorldOptions(task_types=("power-component",)))
    assert [t.id for t in small.tasks("val")] == [f"power-component-{v}" for v in range(10, 15)]


def test_options_name_what_is_wrong():
    for options, said in (
        ({"task_types": ["find-animals"]}, r"unknown task type\(s\) \['find-animals'\]"),
        ({"task_types": []}, "at least one task type"),
        ({"max_steps": {"boil": 0}}, "step limits must be >= 1"),
        ({"max_steps": {"boiling": 3}}, "unknown task type"),
        ({"simplifications": "easy,fast"}, r"unknown simplification\(s\) \['fast'\]"),
        ({"observation_words": 0}, "greater than or equal to 1"),
        ({"max_turns": 10}, "Extra inputs are not permitted"),
    ):
        with pytest.raises(ValueError, match=said):
            registry.make("scienceworld", options)


def test_the_stored_gold_paths_cover_every_task_of_the_default_types():
    env = ScienceWorld(ScienceWorldOptions())
    paths = gold_table()["paths"]
    assert sorted(paths) == sorted(t.id for s in env.splits for t in env.tasks(s)) and gold_table()["simplifications"] == "easy"
    # without its door openings (the doors are open) every expert path fits its step limit
    assert all(0 < len(expert_path(p, True)) <= env.step_limit(env.task(k).task_type) for k, p in paths.items())


def test_step_limits_are_etos_per_task_type_and_can_be_set():
    assert set(STEP_LIMITS) == set(table())  # every task type has one
    env = ScienceWorld(ScienceWorldOptions(max_steps={"find-plant": 25}))
    assert env.step_limit("find-animal") == 15 and env.step_limit("lifespan-longest-lived") == 10 and env.step_limit("find-plant") == 25
    assert env.max_turns == 25


# ---- the turn format ----


def test_thought_and_action_parse():
    assert parse_action("Thought: The door is open.\nAction: go to kitchen") == ("The door is open.", "go to kitchen")
    assert parse_action("Thought: first\n  second line\nAction:   open   door to kitchen  \nObservation: made up") == ("first second line", "open door to kitchen")
    assert parse_action("Thought:\nAction: look around") == ("", "look around")
    assert parse_action(render_action("I wait.", "wait1")) == ("I wait.", "wait1")
    for text, said in (
        ("Action: look around", "missing 'Thought:'"),
        ("Sure! Thought: x\nAction: look around", "unexpected text before 'Thought:'"),
        ("Thought: I will look around.", "missing 'Action:' after the thought"),
        ("Thought: x\nAction:   \n", "empty action after 'Action:'"),
        ("Thought: x\nAction: " + "open " * 50, "over 200"),
    ):
        with pytest.raises(ActionParseError, match=said):
            parse_action(text)


def test_each_action_gets_a_short_templated_thought():
    assert thought("open door to kitchen") == "The way to the kitchen is through this door, so I open it."
    assert thought("focus on dove") == "The dove is what the task is about, so I focus on it."
    assert thought("move egg dove egg in inventory to red box") == "I move the egg dove egg in inventory to the red box, as the task asks."
    assert thought("pour cup containing blue paint in art studio in jug") == "I pour the cup containing blue paint in art studio into the jug."
    assert thought("0") == "Several things have that name; I choose number 0."
    assert thought("flap wings") == "Next I flap wings."
    assert next_gold(["a", "b", "c"], ["a", "x", "a", "b"]) == 2  # a detour matches nothing
    gold = ["open door to kitchen", "go to kitchen", "Open door to outside", "focus on bee"]
    assert expert_path(gold, doors_open=True) == ["go to kitchen", "focus on bee"] and expert_path(gold, doors_open=False) == gold


# ---- the game on recorded episodes ----


def test_the_expert_plays_a_recorded_gold_path_to_score_one_through_the_interface():
    env, backend = recorded_env()
    game, opening, steps = expert_episode(env, "find-animal-0")
    rec = recording()[0]
    assert [m["role"] for m in opening] == ["system", "user"]
    assert "at most 15 actions" in opening[0]["content"] and "teleport to LOC" in opening[0]["content"]  # ETO's easy world
    assert opening[1]["content"] == f"{rec['description']}\nObservation: {rec['first']}"
    # the gold path, generated on load (no error string), less its door openings: the doors are open
    assert [s.info["turn"]["action"] for s in steps] == expert_path(rec["gold_path"], True) == [r["action"] for r in rec["steps"]]
    assert len(rec["gold_path"]) == 10 and len(steps) == 7
    assert all(s.info["parsed"] for s in steps) and all(s.info["turn"]["reason"] for s in steps)
    assert [s.info["turn"]["observation"] for s in steps] == [r["observation"] for r in rec["steps"]]
    # each step's reward is its change of score / 100; the return is the final score / 100
    scores = [r["score"] for r in rec["steps"]]
    assert [s.reward for s in steps] == [(b - a) / 100 for a, b in zip([0, *scores], scores)]
    assert sum(s.reward for s in steps) == pytest.approx(1.0) and env.won(sum(s.reward for s in steps))
    assert (steps[-1].terminated, steps[-1].truncated, game.success, game.done) == (True, False, True, True)
    assert all(not (s.terminated or s.truncated) for s in steps[:-1])
    assert steps[-1].observation == [{"role": "user", "content": f"Observation: {rec['steps'][-1]['observation']}\nThe task is complete: score 100 of 100."}]
    assert steps[0].observation == [{"role": "user", "content": "Observation: You move to the greenhouse."}]
    assert backend.loads == 1  # one world held the episode throughout: no replay


def test_a_recorded_episode_runs_through_the_rollout_as_collect_plays_it():
    from tasks.rollout import ScriptedAgent, new_episode, play

    env, _ = recorded_env()
    expert = env.policies(NOISE)["expert"]
    eps = [new_episode(env, env.task(t), seed) for seed, t in enumerate(("find-animal-0", "lifespan-longest-lived-62", "find-non-living-thing-225"))]
    play(eps, ScriptedAgent(lambda rng: expert), run_seed=0)
    rows = [e.to_row() for e in eps]
    assert [r["split"] for r in rows] == ["train", "val", "test"]
    assert [r["num_turns"] for r in rows] == [7, 3, 5]  # lifespan completes before its gold path's last "wait1"
    assert all(r["success"] and r["return"] == pytest.approx(1.0) for r in rows)
    assert [m["role"] for m in rows[1]["messages"]] == ["system", "user"] + ["assistant", "user"] * 3


def test_the_score_map_a_failed_task_and_the_best_score():
    actions = recording()[2]["steps"]
    for score, expected_return in (("final", 0.0), ("best", 0.25)):
        env, _ = recorded_env(score=score)
        game = env.game(env.task("find-animal-0"))
        game.reset()
        steps = [game.step(render_action("Try.", s["action"])) for s in actions]
        assert [s.info["turn"]["observation"] for s in steps] == [s["observation"] for s in actions]
        # a wrong focus scores -100 and ends the task: terminated, no success
        assert (steps[-1].terminated, steps[-1].truncated, game.success, game.score) == (True, False, False, -100)
        assert sum(s.reward for s in steps) == pytest.approx(expected_return)
        assert steps[-1].reward == pytest.approx(-0.25 if score == "final" else 0.0)
        assert steps[-1].observation[0]["content"].endswith("The task failed: score 0 of 100.")
        assert not env.won(expected_return)
    assert [s.reward for s in steps[:5]] == [0.08, 0.0, 0.0, 0.0, 0.17]  # an unknown action, an ambiguity and its answer score nothing


def test_the_step_limit_truncates_and_a_parse_failure_spends_a_step_without_the_world():
    env, backend = recorded_env(max_steps={"find-animal": 4})
    game = env.game(env.task("find-animal-0"))
    game.reset()
    expert, rng = env.policies(NOISE)["expert"], random.Random(0)
    asked = backend.steps
    bad = game.step("I think I should open the door.")
    assert (bad.reward, bad.terminated, bad.truncated, bad.info["parsed"], backend.steps) == (0.0, False, False, False, asked)
    assert bad.info["turn"] == {"reason": "", "action": "I think I should open the door.",
                                "observation": "Invalid action (missing 'Thought:'): nothing happened. Write 'Thought: ...' then 'Action: ...'."}
    steps = [game.step(expert.act(game, rng)) for _ in range(3)]  # the expert goes on from the gold path's start
    assert [s.info["turn"]["action"] for s in steps] == ["go to greenhouse", "go to outside", "look around"]
    assert (steps[-1].terminated, steps[-1].truncated, game.done, game.success, game.turn) == (False, True, True, False, 4)
    assert sum(s.reward for s in [bad, *steps]) == pytest.approx(0.17)
    assert steps[-1].observation[0]["content"].endswith("No actions left: score 17 of 100.")
    with pytest.raises(RuntimeError, match="is over"):
        game.step(render_action("x", "look around"))


def test_observation_words_cuts_what_the_chat_shows_and_the_turn_keeps_it_whole():
    assert cut("a b\n\tc d e", 3) == "a b\n\tc ... (2 more words)" and cut("a b", 3) == "a b" and cut("a b c d", None) == "a b c d"
    env, _ = recorded_env(observation_words=12)
    game, opening, steps = expert_episode(env, "find-animal-0")
    rec = recording()[0]
    assert opening[1]["content"].startswith(f"{rec['description']}\nObservation: This room is called the hallway.")
    assert opening[1]["content"].endswith(f"... ({len(rec['first'].split()) - 12} more words)")
    look = steps[2]
    assert look.info["turn"]["action"] == "look around" and look.info["turn"]["observation"] == rec["steps"][2]["observation"]  # whole in the turn record
    assert look.observation[0]["content"].endswith("more words)") and len(look.observation[0]["content"].split()) == 1 + 12 + 4


def test_a_dead_jvm_is_replaced_by_replay_and_past_the_restarts_it_is_one_clear_error():
    # The 4th world step (after the first look and two actions) dies, as a JVM would.
    env, backend = recorded_env(crash_at=4)
    game, _, steps = expert_episode(env, "find-animal-0")
    assert game.success and sum(s.reward for s in steps) == pytest.approx(1.0) and game.sim.restarts == 1
    assert [s.info["turn"]["observation"] for s in steps] == [r["observation"] for r in recording()[0]["steps"]]
    assert backend.loads == 2  # the task loaded again and its two actions replayed on a fresh world
    env, _ = recorded_env(crash_at=4, restarts=0)
    with pytest.raises(simulator.SimulatorCrashed, match=r"ScienceWorld find-animal-0, action 2 \('look around'\) \(after 2 actions\): .*gave up after 0 restarts"):
        expert_episode(env, "find-animal-0")


def test_games_beyond_the_pools_worlds_replay_to_get_theirs_back():
    env, _ = recorded_env()
    backend = Recorded(RECORDING, capacity=1)  # one world for two games
    env.use_pool(backend.pool())
    expert, rng = env.policies(NOISE)["expert"], random.Random(0)
    a, b = env.game(env.task("find-animal-0")), env.game(env.task("lifespan-longest-lived-62"))
    a.reset(), b.reset()
    while not (a.done and b.done):
        for g in (a, b):
            if not g.done:
                g.step(expert.act(g, rng))
    # two resets, then every turn while both played took the world back from the other game (7)
    assert a.success and b.success and backend.loads == 9


def test_restore_resumes_after_logged_turns_and_the_labeler_replays_them():
    env, _ = recorded_env()
    _, _, steps = expert_episode(env, "find-animal-0")
    turns = [{**s.info["turn"], "reward": s.reward} for s in steps]
    game = env.game(env.task("find-animal-0"))
    game.reset()
    game.restore(turns[:4])
    assert (game.turn, game.score, game.credited) == (4, 67, 67)
    expert, rng = env.policies(NOISE)["expert"], random.Random(0)
    rest = []
    while not game.done:
        rest.append(game.step(expert.act(game, rng)))
    assert [s.info["turn"] for s in rest] == [{k: t[k] for k in ("reason", "action", "observation")} for t in turns[4:]]
    assert game.success and sum(s.reward for s in rest) == pytest.approx(0.33)
    label = env.label("find-animal-0", turns)
    assert (label.reward, label.success) == (pytest.approx(1.0), True)
    assert env.label("find-animal-0", turns[:3]).reward == pytest.approx(0.17)
    assert env.label("chess-1", turns).reward is None
    assert env.oracle_version("labeler")


def test_the_noisy_and_random_agents_act_on_the_worlds_valid_actions():
    env, _ = recorded_env()
    valid = set(recording()[0]["valid_actions"])
    policies = env.policies({"p_random": 0.0, "p_repeat": 0.0, "p_early_guess": 1.0})
    game = env.game(env.task("find-animal-0"))
    game.reset()
    for name, starts in (("noisy", "focus on"), ("random", "")):
        reason, action = parse_action(policies[name].act(game, random.Random(3)))
        assert action in valid and action.startswith(starts) and reason == thought(action)
    detour = env.policies({"p_random": 1.0, "p_repeat": 0.0, "p_early_guess": 0.0})["noisy"]
    assert not parse_action(detour.act(game, random.Random(3)))[1].startswith("focus on")
    game.step(render_action("x", "go to greenhouse"))
    repeat = env.policies({"p_random": 0.0, "p_repeat": 1.0, "p_early_guess": 0.0})["noisy"]
    assert parse_action(repeat.act(game, random.Random(3)))[1] == "go to greenhouse"
    with pytest.raises(ValueError, match="sum to at most 1"):
        env.policies({"p_random": 0.6, "p_repeat": 0.6, "p_early_guess": 0.0})


def test_a_finished_game_crosses_processes_without_its_pool():
    import pickle

    env, _ = recorded_env()
    game, _, _ = expert_episode(env, "find-animal-0")
    copy = pickle.loads(pickle.dumps(game))  # what evaluate's worker processes send back
    assert (copy.success, copy.done, copy.turn, copy.score, copy.sim.actions) == (True, True, 7, 100, game.sim.actions)
    assert copy.env._pool is None and copy.sim.pool is not env.pool and not copy.sim.pool.slots  # its own process's pool, no world held


def test_the_gold_path_is_stored_or_generated_on_load_never_the_packages_error_string():
    env, backend = recorded_env()
    game = env.game(env.task("find-animal-0"))
    game.reset()
    assert game.gold_path() == stored("find-animal", 0, "easy") == recording()[0]["gold_path"]  # the stored path (gold.py)
    assert backend.loads == 1  # no load for the gold path
    # Where no path is stored (here: other simplifications), the task is loaded with its gold path.
    env.use_pool(Recorded(RECORDING).pool(simplifications="openDoors"))
    game = env.game(env.task("find-animal-0"))
    game.reset()
    assert game.gold_path() == recording()[0]["gold_path"] and GOLD_ERROR not in game.gold_path()
    world = backend.new_world()
    world.load("find-animal", 0, "easy", gold=False)
    assert world.gold_path() == [GOLD_ERROR]  # what the package answers without generateGoldPath=True
    assert stored("boil", 0, "easy") is None and stored("find-animal", 0, "") is None


def test_no_java_is_one_clear_error_before_any_jvm(tmp_path, monkeypatch):
    from flows.common import expected_failure

    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no java on it
    monkeypatch.delenv("JAVA_HOME", raising=False)
    with pytest.raises(simulator.SimulatorUnavailable, match=r"needs a Java runtime: no `java` is on PATH\. Install one \(Debian/Ubuntu: apt-get install default-jre-headless\)") as e:
        simulator.find_java()
    assert expected_failure(e.value)  # a BackendUnavailable: the CLI says it in one `error:` line
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "jdk"))
    with pytest.raises(simulator.SimulatorUnavailable, match=r"JAVA_HOME=.*jdk has no bin/java, and no `java` is on PATH"):
        simulator.find_java()
    env = ScienceWorld(ScienceWorldOptions(simulators=1, worlds=3))  # settings no other test's pool has
    try:
        with pytest.raises(simulator.SimulatorUnavailable, match="apt-get install default-jre-headless"):
            env.game(env.tasks("train")[0]).reset()
        assert simulator.running_jvms() == []
    finally:
        simulator.close_all()


def test_the_tokenizer_corpus_holds_the_prompts_and_thoughts():
    env = ScienceWorld(ScienceWorldOptions())
    corpus = env.tokenizer_corpus()
    assert any("Thought: <your reasoning>" in c for c in corpus) and "find-animal" in corpus
    assert env.reward_range == (0.0, 1.0) and env.won(1.0) and not env.won(0.99)


# ---- the oracle hindsight roles and their LLM prompts, on hand-made states ----

GOLD = ["open door to greenhouse", "go to greenhouse", "open door to outside", "go to outside", "look around", "focus on dove",
        "pick up dove", "open door to kitchen", "go to kitchen", "move dove to red box"]
FIRST = "This room is called the hallway. In it, you see: \n\tthe agent\nYou also see:\n\tA door to the greenhouse (that is open)"


def hand_known(teleport: bool = True):
    from envs.scienceworld import roles

    return roles.known("find-animal-0", "Your task is to find a(n) animal.  First, focus on the thing.", FIRST, GOLD, True, teleport)


def turn(action: str, observation: str = "", reward: float = 0.0) -> dict:
    moved = {"go to": "move", "teleport to": "teleport"}
    for verb, said in moved.items():
        if action.startswith(verb) and not observation:
            observation = f"You {said} to the {action[len(verb) + 1:]}."
    return {"action": action, "observation": observation or "Done.", "reward": reward}


ON_PATH = [turn("go to greenhouse", reward=0.17), turn("go to outside"), turn("look around", "This outside location is called the outside. Here you see: a dove"),
           turn("focus on dove", "You focus on the dove egg.", 0.5), turn("pick up dove", reward=0.08), turn("go to kitchen", reward=0.08),
           turn("move dove to red box", reward=0.17)]
NOT_UNDERSTOOD = "No known action matches that input."


def test_the_oracle_knows_the_tasks_description_start_room_and_the_experts_path():
    k = hand_known()
    assert k.description == "Your task is to find a(n) animal. First, focus on the thing." and k.start == "hallway"
    assert k.gold == ("go to greenhouse", "go to outside", "look around", "focus on dove", "pick up dove", "go to kitchen", "move dove to red box")


def test_the_proposer_proposes_the_gold_paths_next_action_where_the_agent_left_it():
    from envs.scienceworld.roles import propose

    k = hand_known()
    assert propose(k, [], "go to greenhouse") is None  # the turn followed the gold path: nothing better
    p = propose(k, [], "look around")
    assert (p.action, p.thought) == ("go to greenhouse", "The door is open, so I go to the greenhouse.")
    assert "has 7 actions; the agent had got through 0 of them, and the next is 'go to greenhouse'" in p.rationale
    assert p.counterfactual().text == "Thought: The door is open, so I go to the greenhouse.\nAction: go to greenhouse"
    # a detour the world did not understand, or one that stays in the room, leaves the next gold action
    assert propose(k, [turn("go to greenhouse"), turn("dance", NOT_UNDERSTOOD)]).action == "go to outside"
    # a gold action the simulator did not understand was not played
    outside = ON_PATH[:3]
    assert propose(k, [*outside, turn("focus on dove", NOT_UNDERSTOOD)]).action == "focus on dove"
    # away from the gold path's room: teleport back where the world allows it, or do the gold move by teleport
    away = propose(k, [*outside, turn("teleport to kitchen")])
    assert away.action == "teleport to outside" and "in the kitchen but the gold path of find-animal-0 is in the outside" in away.rationale
    assert propose(k, [turn("teleport to bedroom")]).action == "teleport to greenhouse"
    assert propose(hand_known(teleport=False), [*outside, turn("teleport to kitchen")]).action == "focus on dove"
    # standing where the gold moves lead makes them needless; a move the world refused moved nobody
    assert propose(k, [turn("teleport to outside")]).action == "look around"
    assert propose(k, [turn("teleport to outside"), ON_PATH[2]]).action == "focus on dove"  # and the walk goes on from there
    assert propose(k, [turn("go to greenhouse"), turn("go to outside", "It's not clear how to get there from here.")]).action == "teleport to outside"
    assert propose(k, ON_PATH) is None  # the gold path is played out


def test_the_controller_names_the_turns_that_left_the_path_those_that_lost_score_first():
    from envs.scienceworld.roles import critique

    k = hand_known()
    failed = [turn("go to greenhouse", reward=0.17), turn("teleport to kitchen", reward=0.08), turn("focus on red box", "You focus on the red box.", -0.25)]
    places = critique(k, failed, 3)
    assert [(j, p.action) for j, p in places] == [(2, "teleport to outside"), (1, "go to outside")]
    assert [j for j, _ in critique(k, failed, 1)] == [2] and critique(k, ON_PATH, 3) == []


def test_the_summarizer_states_the_goal_the_gold_paths_progress_the_score_and_the_outcome():
    from envs.scienceworld.roles import summarize

    k = hand_known()
    assert summarize(k, ON_PATH, True, 15) == (
        "Task find-animal-0: Your task is to find a(n) animal. First, focus on the thing. The gold path takes 7 actions; the agent got through 7 "
        "of them. Its score rose to 17 at step 1 (go to greenhouse); rose to 67 at step 4 (focus on dove); rose to 75 at step 5 "
        "(pick up dove); rose to 83 at step 6 (go to kitchen); rose to 100 at step 7 (move dove to red box). It completed the task at score "
        "100 in 7 steps.")
    failed = [turn("go to greenhouse", reward=0.17), turn("teleport to kitchen", reward=0.08), turn("focus on red box", "You focus on the red box.", -0.25)]
    said = summarize(k, failed, False, 15)
    assert "the agent got through 1 of them, and first left it at step 2 with 'teleport to kitchen' where the gold path does 'go to outside'." in said
    assert "rose to 25 at step 2 (teleport to kitchen); fell to 0 at step 3 (focus on red box)." in said
    assert said.endswith("Its last action, 'focus on red box' at step 3, focused on the wrong thing, which ended the task: the score fell to 0.")
    lost = [turn("I think I should look.", "Invalid action (missing 'Thought:'): nothing happened."), turn("look around", FIRST),
            turn("look around", FIRST), turn("dance wildly", NOT_UNDERSTOOD)]
    said = summarize(k, lost, False, 4)
    assert "first left it at step 1 with a turn off the Thought/Action format where the gold path does 'go to greenhouse'" in said
    assert "Its score never rose above 0. 1 of its turns did not follow the Thought/Action format; the simulator did not understand 1 of its actions; it repeated 'look around' 2 times." in said
    assert said.endswith("It ran out of its 4 steps at score 0 of 100; the gold path's next action was 'go to greenhouse'.")


def test_the_llm_proposers_reply_reads_back_and_its_parser_refuses_what_the_agent_could_not_write():
    from envs.base import Counterfactual
    from envs.scienceworld.llm_roles import parse_proposals, proposal_reply
    from envs.scienceworld.roles import propose

    proposal = propose(hand_known(), [turn("teleport to bedroom")]).counterfactual()
    assert parse_proposals(proposal_reply([proposal]), 1) == [proposal]
    two = [proposal, Counterfactual("Thought: I look.\nAction: look around", "look around", "I look.", "Hindsight.")]
    assert parse_proposals("Here:\n" + proposal_reply(two), 1) == [proposal]  # at most n
    item = {"teacher_reason": "t", "thought": "I go.", "action": "go to kitchen"}
    for bad, said in (
        ({**item, "thought": "The gold path goes there."}, "mentions the gold path"),
        ({**item, "action": "go to kitchen\nlook around"}, "not one line"),
        ({**item, "thought": "I go. Action: look around"}, "do not read back as one turn"),
        ({**item, "action": ""}, "missing or empty 'action'"),
    ):
        with pytest.raises(ValueError, match=said):
            parse_proposals("```json\n" + json.dumps([bad]) + "\n```", 1)
    with pytest.raises(ValueError, match="repeats the prompt"):
        parse_proposals("## Gold path\n" + proposal_reply([proposal]), 1)


def test_the_environment_serves_its_oracle_and_llm_roles_on_a_recorded_task():
    env, backend = recorded_env()
    _, _, steps = expert_episode(env, "find-animal-0")
    turns = [{**s.info["turn"], "reward": s.reward} for s in steps]
    task = env.task("find-animal-0")
    loads = backend.loads
    k = env.known(task)
    assert (k.start, k.gold, backend.loads) == ("hallway", tuple(expert_path(recording()[0]["gold_path"], True)), loads + 1)
    assert env.known(task) is k and backend.loads == loads + 1  # one load a task, kept
    assert env.summarize(task, turns, True).endswith("It completed the task at score 100 in 7 steps.")
    assert env.propose(task, turns[:2], 1, turns[2]["action"]) == []  # the expert's own turn: nothing better
    [cf] = env.propose(task, turns[:2], 2, "dance")
    assert cf.action == "look around" and env.parse_action(cf.text) == (cf.reason, cf.action)
    assert env.critique(task, turns, 3) == [] and env.relabel_turns(4) == [0, 1, 2, 3]
    assert {env.oracle_version(r) for r in ("summarizer", "proposer", "controller", "labeler")} >= {"scienceworld-summary-1", "scienceworld-proposer-1"}
    with pytest.raises(NotImplementedError, match="no oracle judge"):
        env.oracle_version("judge")
    # the LLM roles: the summarizer's and the proposer's prompts show the description and the gold path
    summary = env.summary_request(task, turns, True)
    assert "move egg dove egg in inventory to red box" in summary.messages[1]["content"] and "Completed at score 100" in summary.messages[1]["content"]
    assert summary.parse("  The agent  followed the path. ") == "The agent followed the path."
    request = env.proposer_request(task, turns[:2], 1, "It wandered.")
    assert "Observation 2: You move to the outside." in request.messages[1]["content"] and "It wandered." in request.messages[0]["content"]
    assert request.parse(env.proposer_reply([cf])) == [cf]  # the distilled proposer's target reads back (tasks/proposer.py)
    assert len({env.prompt_hash("summarizer"), env.prompt_hash("proposer")}) == 2
    with pytest.raises(NotImplementedError, match="no LLM labeler prompt"):
        env.prompt_hash("labeler")


# ---- the real simulator (system tier) ----


def _java_children() -> list[str]:
    """This process's java children, each with its state (Z: a zombie, not reaped)."""
    out = subprocess.run(["ps", "-o", "pid=,stat=,comm=", "--ppid", str(os.getpid())], capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines() if line.split()[-1] == "java"]


@pytest.fixture
def real():
    """The real simulator; every JVM closed and reaped afterwards."""
    yield
    simulator.close_all()
    assert simulator.running_jvms() == [] and _java_children() == []


@pytest.mark.system
def test_the_real_simulator_plays_each_default_types_first_gold_paths_to_one(real):
    """The first variation of each default type in each split (the stored paths, gold.py)."""
    env = registry.make("scienceworld", {})
    for task in [t for split in env.splits for t in env.tasks(split)[: len(DEFAULT_TASK_TYPES)]]:
        game, opening, steps = expert_episode(env, task.id)
        assert opening[1]["content"].startswith("Your task is to")
        assert game.success and steps[-1].terminated and sum(s.reward for s in steps) == pytest.approx(1.0), task.id
        assert env.won(sum(s.reward for s in steps)) and len(steps) <= env.step_limit(task.task_type)
    assert len(simulator.running_jvms()) == 1  # one JVM held every game


@pytest.mark.system
def test_the_variations_table_and_the_recording_match_the_simulator(real, tmp_path):
    from envs.scienceworld.record import record
    from envs.scienceworld.tables import VARIATIONS
    from envs.scienceworld.variations import from_simulator

    assert from_simulator()["task_types"] == json.loads(VARIATIONS.read_text())["task_types"]
    record(tmp_path / "episodes.json")
    again = json.loads((tmp_path / "episodes.json").read_text())["episodes"]
    assert again == recording()  # the same actions get the same answers (the paths are the stored ones)


@pytest.mark.system
def test_a_killed_jvm_is_replayed_and_a_hung_one_ends_in_an_error_not_a_hang(real):
    env = ScienceWorld(ScienceWorldOptions(simulators=1, worlds=4))
    game = env.game(env.task("find-animal-0"))
    game.reset()
    expert, rng = env.policies(NOISE)["expert"], random.Random(0)
    for _ in range(3):
        game.step(expert.act(game, rng))
    [pid] = simulator.running_jvms()
    os.kill(pid, 9)
    while not game.done:
        game.step(expert.act(game, rng))
    assert game.success and game.sim.restarts == 1 and simulator.running_jvms() not in ([], [pid])
    simulator.close_all()
    import time

    hung = ScienceWorld(ScienceWorldOptions(simulators=1, worlds=5, call_timeout=0.001, restarts=1))
    t0 = time.monotonic()
    with pytest.raises(simulator.SimulatorCrashed, match=r"no answer within 0\.001 s, so it was killed; gave up after 1 restarts"):
        hung.game(hung.task("find-animal-0")).reset()
    assert time.monotonic() - t0 < 60


@pytest.mark.system
def test_a_run_without_java_ends_in_one_error_line(tmp_path):
    """`retrosight stage bootstrap` (what `dvc repro` runs) with ScienceWorld and no java on PATH."""
    from conftest import BIN, make_project, run

    project = make_project(tmp_path, env={"name": "scienceworld"}, overrides={"bootstrap": {"limit_tasks": 1, "demos_per_task": 1}})
    nojava = tmp_path / "bin"
    nojava.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):  # every program on PATH but java
        for p in Path(d).glob("*") if Path(d).is_dir() else []:
            if p.name != "java" and not (nojava / p.name).exists():
                (nojava / p.name).symlink_to(p)
    result = run([str(BIN / "retrosight"), "stage", "bootstrap"], project, check=False,
                 env_extra={"PATH": f"{BIN}{os.pathsep}{nojava}", "JAVA_HOME": ""})
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and "Traceback" not in output, output[-4000:]
    assert len(errors) == 1 and "needs a Java runtime" in errors[0] and "apt-get install default-jre-headless" in errors[0], output[-4000:]


@pytest.mark.system
def test_the_proposer_brings_an_agent_back_to_the_gold_path_after_a_teleport_away(real):
    """Each of the first 28 val tasks (4 of each default type): the expert's episode sent by a
    teleport to a random room at a random step, then finished by the oracle proposer played as a
    policy (the expert where it proposes nothing), and by the expert alone, which goes on with
    its next gold action wherever it stands (docs/environments.md quotes both counts)."""
    from envs.scienceworld.roles import propose

    rooms = ["kitchen", "foundry", "workshop", "bathroom", "outside", "living room", "bedroom", "greenhouse", "art studio", "hallway"]
    env = registry.make("scienceworld", {})
    expert = env.policies(NOISE)["expert"]
    finished = {"proposer": 0, "expert": 0}
    tasks = env.tasks("val")[:28]
    for i, task in enumerate(tasks):
        rng = random.Random(i)
        k = env.known(task)
        cut, room = rng.randrange(len(k.gold) - 1), rng.choice(rooms)
        for name in finished:
            game, turns = env.game(task), []
            game.reset()
            while not game.done:
                p = propose(k, turns) if name == "proposer" else None
                text = (render_action("I go elsewhere.", f"teleport to {room}") if len(turns) == cut
                        else render_action(p.thought, p.action) if p is not None else expert.act(game, rng))
                step = game.step(text)
                turns.append({**step.info["turn"], "reward": step.reward})
            finished[name] += game.success
    print(f"of {len(tasks)} val episodes sent away by a teleport: {finished}")
    assert finished["proposer"] == len(tasks) and finished["expert"] < len(tasks)
