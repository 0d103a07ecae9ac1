"""The environment interface: the registry over entry points, and an environment from outside
this repository (defined below, installed through a fake distribution) running through collect."""
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import tiny_params, twenty_questions
from envs import registry
from envs.base import EMPTY_REPLY, Environment, Game, Step
from storage.schema import from_table
from tasks.collect import run_collect
from tasks.params import Params, ParamsError, load_params


class Digit:
    def __init__(self, split: str, n: int):
        self.split, self.id = split, f"{split}-{n}"


class GuessGame(Game):
    """Name the secret digit in three tries: -1 a miss, 0 the hit."""

    max_turns = 3

    def __init__(self, task: Digit):
        self.task, self._turn, self._won = task, 0, False

    turn = property(lambda self: self._turn)
    success = property(lambda self: self._won)
    done = property(lambda self: self._won or self._turn == self.max_turns)

    def reset(self):
        return [{"role": "user", "content": "Name a digit."}], {}

    def step(self, text: str, answer=None) -> Step:
        self._turn += 1
        self._won = text.strip() == self.task.id[-1]
        said = "hit" if self._won else "miss"
        info = {"message": {"role": "assistant", "content": text}, "turn": {"reason": "", "action": text, "observation": said},
                "parsed": text.strip().isdigit(), "success": self._won}
        return Step([{"role": "user", "content": said}], 0.0 if self._won else -1.0, self._won, self.done and not self._won, info)


class GuessDigit(Environment):
    name = "guess_digit"
    splits = ("train", "val", "test")
    max_turns = GuessGame.max_turns
    reward_range = (-3.0, 0.0)
    tasks = staticmethod(lambda split: [Digit(split, n) for n in range(3)])
    task = staticmethod(lambda task_id: Digit(*task_id.split("-")))
    game = staticmethod(GuessGame)
    render_action = staticmethod(lambda reason, action: action)
    parse_action = staticmethod(lambda text: ("", text))
    won = staticmethod(lambda reward: reward > -3)


class Misnamed(GuessDigit):
    name = "not_what_the_entry_point_says"


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A distribution on sys.path declaring this module's environments in `retrosight.envs`, as a
    user's installed package would."""
    dist = tmp_path / "guess_digit-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: guess-digit\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[retrosight.envs]\nguess_digit = test_envs:GuessDigit\nmisnamed = test_envs:Misnamed\nnot_an_env = test_envs:Digit\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))


def test_the_registry_finds_environments_by_entry_point(installed):
    assert {"twenty_questions", "guess_digit"} <= set(registry.available())
    assert registry.get("guess_digit") is GuessDigit
    assert registry.make("twenty_questions", {"max_turns": 7}).max_turns == 7
    with pytest.raises(ValueError, match="whose name is 'not_what_the_entry_point_says'"):
        registry.get("misnamed")
    with pytest.raises(TypeError, match="not an envs.base.Environment subclass"):
        registry.get("not_an_env")


def test_an_unknown_environment_is_an_error_listing_the_known_ones(installed, tmp_path):
    # persuasion is listed once the project's metadata is reinstalled with its entry point
    with pytest.raises(KeyError, match="unknown environment 'chess'; known: car_dealer, guess_digit, guess_my_city, misnamed, not_an_env, (persuasion, )?(qa_teacher, )?(scienceworld, )?twenty_questions"):
        registry.get("chess")
    raw = tiny_params({"env": {"name": "chess"}})
    with pytest.raises(ParamsError, match=r"env: .*unknown environment 'chess'; known: .*twenty_questions"):
        load_params(_write(tmp_path / "p.yaml", raw))


def test_the_environment_validates_its_own_params(tmp_path):
    with pytest.raises(ParamsError, match=r"env\.show_candidatez: unknown key"):
        load_params(_write(tmp_path / "p.yaml", tiny_params({"env": {"show_candidatez": True}})))
    with pytest.raises(ParamsError, match=r"env\.max_turns: Input should be greater than or equal to 1"):
        load_params(_write(tmp_path / "q.yaml", tiny_params({"env": {"max_turns": 0}})))


def test_an_environment_from_a_users_package_runs_through_collect(installed, tiny_model_dir, tmp_path):
    raw = tiny_params()
    raw["env"] = {"name": "guess_digit"}  # none of TwentyQuestions' keys: they are its own
    m = run_collect(Params.model_validate(raw), tiny_model_dir, tmp_path)
    rows = from_table(pq.read_table(tmp_path / "trajectories.parquet"))
    assert m["trajectories"] == len(rows) > 0
    for r in rows:
        assert r["env"] == "guess_digit" and r["task_id"].startswith(r["split"] + "-")
        assert r["messages"][0] == {"role": "user", "content": "Name a digit."}
        assert r["num_turns"] == len(r["turns"]) <= 3 and r["return"] == -sum(t["observation"] == "miss" for t in r["turns"])


def test_twenty_questions_steps_in_gymnasiums_shape():
    env = twenty_questions(3)
    game = env.game(env.task("Cat"))
    opening, _ = game.reset()
    assert [m["role"] for m in opening] == ["system", "user"]
    step = game.step("no format at all")  # unparseable: the turn is spent, never a crash
    assert (step.reward, step.terminated, step.truncated, step.info["parsed"]) == (-1.0, False, False, False)
    assert step.info["turn"] == {"reason": "", "action": "no format at all", "observation": "unknown"}
    step = game.step(env.render_action("Guess.", "Is it Dog?"))
    assert (step.terminated, step.truncated) == (False, False)
    step = game.step(EMPTY_REPLY)  # the last turn runs out: truncated, not terminated
    assert (step.reward, step.terminated, step.truncated, game.done, game.success) == (-1.0, False, True, True, False)
    won = env.game(env.task("Cat"))
    step = won.step(env.render_action("Guess.", "Is it a cat?"))
    assert (step.reward, step.terminated, step.truncated, step.info["success"]) == (0.0, True, False, True)
    assert step.observation == [{"role": "user", "content": "Answer: yes. You found it."}]
    assert env.reward_range == (-3.0, 0.0) and env.won(-2.0) and not env.won(-3.0)


def _write(path: Path, raw: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("name", ["twenty_questions", "guess_my_city", "car_dealer"])
def test_message_is_what_step_records_without_playing(name):
    """Game.message gives the chat message a text would be recorded as (a critic scores it), tool
    calls included, and leaves the game as it was."""
    import random

    env = registry.make(name, {})
    policy = env.policies({"p_random": 0.3, "p_repeat": 0.1, "p_early_guess": 0.1})["noisy"]
    game, rng = env.game(env.tasks("train")[0]), random.Random(1)
    game.reset()
    seen_tool_call = False
    while not game.done:
        text = policy.act(game, rng)
        before = (game.turn, game.message(text))
        assert game.message(text) == before[1] and game.turn == before[0]
        step = game.step(text)
        assert step.info["message"] == before[1]
        seen_tool_call |= "tool_calls" in before[1]
    assert seen_tool_call == (name == "car_dealer")
