"""GuessMyCity behind the environment interface (envs/base.py): HOPE's rules (game.py) against the
knowledge-base simulator (oracle.py), in HOPE's REASON/QUESTION action format, the one
TwentyQuestions uses."""
from __future__ import annotations

from pathlib import Path

import jinja2
from pydantic import Field

from envs.base import Environment, Label, Options, Step, fraction_window, recorded_reply
from envs.base import Game as BaseGame
from envs.reason_question import ActionParseError, parse_action, render_action

from .cities import SPLITS, City, load_cities
from .game import MAX_TURNS, Answer, Game
from .oracle import load_oracle

_TEMPLATES = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "prompts"),
                                undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, autoescape=False)
LABELER_VERSION = "guess-my-city-oracle-labeler-v1"


def _render(name: str, **context: object) -> str:
    return _TEMPLATES.get_template(name).render(**context).strip()


class GuessMyCityOptions(Options):
    max_turns: int = Field(MAX_TURNS, ge=1, le=100)  # HOPE: 10 questions, the last one a forced guess


class GuessMyCityGame(BaseGame):
    def __init__(self, env: GuessMyCity, task: City):
        self.env, self.task, self.max_turns = env, task, env.max_turns
        self.state = Game(env.cities, task, env.oracle.answer, max_turns=env.max_turns)

    turn = property(lambda self: self.state.turn)
    done = property(lambda self: self.state.done)
    success = property(lambda self: self.state.success)

    def reset(self):
        return [
            {"role": "system", "content": _render("agent_system.j2", max_turns=self.max_turns, candidates=self.env.candidates)},
            {"role": "user", "content": _render("observation.j2", answer=None, turn=0, max_turns=self.max_turns, finished=False)},
        ], {}

    def step(self, text: str, answer: Answer | None = None) -> Step:
        # An unparseable text is asked as it is, as a sloppy player would be heard.
        try:
            action = parse_action(text)
            reason, question, parsed = action.reason, action.question, True
        except ActionParseError:
            reason, question, parsed = "", recorded_reply(text).strip(), False
        said, reward = self.state.step(question, answer)
        s = self.state
        content = _render("observation.j2", answer=said, turn=s.turn, max_turns=self.max_turns, finished=s.done, success=s.success)
        info = {
            "message": {"role": "assistant", "content": text},
            "turn": {"reason": reason, "action": question, "observation": said},
            "parsed": parsed,
            "success": s.success,
        }
        # A guess, right or wrong, ends the task (terminated); ten questions without one run out.
        return Step([{"role": "user", "content": content}], reward, s.done and s.guessed, s.done and not s.guessed, info)

    def restore(self, turns) -> None:
        self.state.restore([(t["action"], t["observation"]) for t in turns])


class GuessMyCity(Environment):
    name = "guess_my_city"
    Options = GuessMyCityOptions
    options: GuessMyCityOptions
    splits = SPLITS

    def __init__(self, options: GuessMyCityOptions):
        super().__init__(options)
        self.cities = load_cities()
        self.oracle = load_oracle(self.cities)
        # HOPE shows every listed city, test cities included, in every prompt.
        self.candidates = [c.id for c in self.cities.cities]

    @property
    def max_turns(self) -> int:
        return self.options.max_turns

    def tasks(self, split: str) -> list[City]:
        return self.cities.split(split)

    def task(self, task_id: str) -> City:
        return self.cities.get(task_id)

    def game(self, task: City) -> GuessMyCityGame:
        return GuessMyCityGame(self, task)

    def render_action(self, reason: str, action: str) -> str:
        return render_action(reason, action)

    def parse_action(self, text: str) -> tuple[str, str]:
        action = parse_action(text)
        return action.reason, action.question

    # ---- rewards: -1 a question, 0 for the right guess, -max_turns for a loss ----

    @property
    def reward_range(self) -> tuple[float, float]:
        return -float(self.max_turns), 0.0

    def won(self, reward: float) -> bool:
        return reward > -self.max_turns  # every loss, a wrong guess included, returns exactly -max_turns

    def relabel_turns(self, num_turns: int) -> list[int]:
        return fraction_window(num_turns, 0.3, 0.8)  # HOPE's GuessMyCity window [0.3T, 0.8T)

    def oracle_version(self, role: str) -> str:
        if role != "labeler":
            raise NotImplementedError(f"GuessMyCity has no oracle {role} yet")
        return LABELER_VERSION

    def label(self, task_id: str, turns) -> Label:
        """The return recomputed by replaying the questions against the oracle."""
        try:
            game = Game(self.cities, self.cities.get(task_id), self.oracle.answer, max_turns=self.max_turns)
        except KeyError:
            return Label(None, None, f"task {task_id!r} is not a GuessMyCity city")
        for i, t in enumerate(turns):
            if game.done:
                return Label(None, None, f"the game ended at turn {i} but the trajectory has {len(turns)} turns")
            game.step(t["action"])
        if not game.done:
            return Label(None, None, f"the trajectory stops after {len(turns)} turns, before the game ends")
        outcome = f"found {task_id} in {game.turn} questions" if game.success else f"did not find {task_id} ({game.turn} questions)"
        return Label(game.total, game.success, f"environment return: {outcome}")
