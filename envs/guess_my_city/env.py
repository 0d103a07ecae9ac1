"""GuessMyCity behind the environment interface (envs/base.py): HOPE's rules (game.py) against the
knowledge-base simulator (oracle.py), in HOPE's REASON/QUESTION action format, the one
TwentyQuestions uses; the oracle roles and the LLM roles' prompts of this package."""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from pydantic import Field

from envs.base import EMPTY_REPLY, Counterfactual, Environment, Label, Options, Policy, Request, Step, fraction_window, recorded_reply
from envs.base import Game as BaseGame
from envs.question_roles import QuestionRoleRequests, dialogue, history, parse_proposals, parse_summary, replay_continuation
from envs.reason_question import ActionParseError, ReasonQuestionActions, parse_action, render_action

from . import proposer, summarizer
from .cities import SPLITS, City, load_cities
from .facts import fact_sheets
from .format import final_message, observation_message, system_prompt
from .game import MAX_TURNS, Answer, Game, guessed_city
from .llm_roles import chat, parse_continuation, parse_simulator, read_answer, template_hash
from .oracle import UNKNOWN, load_oracle, topic
from .policies import ExpertPolicy, NoisyPolicy, PlayerView, RandomPolicy

LABELER_VERSION = "guess-my-city-oracle-labeler-v1"
ORACLE_VERSIONS = {"summarizer": summarizer.VERSION, "proposer": proposer.VERSION, "controller": proposer.VERSION, "labeler": LABELER_VERSION}
TEMPLATES = {
    "simulator": "simulator.j2", "summarizer": "summary.j2", "proposer": "proposer.j2", "controller": "controller.j2",
    "forward": "forward.j2", "labeler": "labeler.j2", "judge": "judge.j2",
}


class GuessMyCityOptions(Options):
    max_turns: int = Field(MAX_TURNS, ge=1, le=100)  # HOPE: 10 questions, the last one a forced guess
    show_candidates: bool = True  # list every city in the prompts, as HOPE does: ~900 tokens of bootstrap's BPE, too many for the tiny model
    facts_per_object: int = Field(0, ge=0)  # fact sheets: riddles about every city of every split (bootstrap trains on them)
    fact_breadth: int = Field(3, ge=1)  # fact sheets: each statement drawn from this many of the most telling


def hidden(city: City) -> list[str]:
    """What an answer must not say: the city's names and its country (HOPE's simulator rule)."""
    return [*city.names, city.country]


class GuessMyCityGame(BaseGame):
    def __init__(self, env: GuessMyCity, task: City):
        self.env, self.task, self.max_turns = env, task, env.max_turns
        self.state = Game(env.cities, task, env.oracle.answer, max_turns=env.max_turns)

    turn = property(lambda self: self.state.turn)
    done = property(lambda self: self.state.done)
    success = property(lambda self: self.state.success)

    def reset(self):
        return [
            {"role": "system", "content": system_prompt(self.max_turns, self.env.shown())},
            {"role": "user", "content": observation_message(None, 0, self.max_turns)},
        ], {}

    def read(self, text: str) -> tuple[str, str, bool]:
        """(reason, question, parsed). An unparseable text is asked as it is, as a sloppy player
        would be heard; an empty one is the question EMPTY_REPLY."""
        try:
            action = parse_action(text)
            return action.reason, action.question, True
        except ActionParseError:
            return "", recorded_reply(text).strip(), False

    def step(self, text: str, answer: Answer | None = None) -> Step:
        reason, question, parsed = self.read(text)
        said, reward = self.state.step(question, answer)
        s = self.state
        content = final_message(said, s.success) if s.done else observation_message(said, s.turn, self.max_turns)
        info = {
            "message": {"role": "assistant", "content": text},
            "turn": {"reason": reason, "action": question, "observation": said},
            "parsed": parsed,
            "success": s.success,
        }
        # A guess, right or wrong, ends the task (terminated); ten questions without one run out.
        return Step([{"role": "user", "content": content}], reward, s.done and s.guessed, s.done and not s.guessed, info)

    def restore(self, turns) -> None:
        self.state.restore(history(turns))

    def view(self) -> PlayerView:
        return PlayerView(self.env.candidates, list(self.state.history), self.state.turn, self.max_turns)

    def simulator_request(self, text: str) -> Request[Answer] | None:
        question = self.read(text)[1]
        if question == EMPTY_REPLY or guessed_city(self.env.cities, question) is not None:
            # It asks nothing, or it guesses, and the rules answer a guess (HOPE overwrote the
            # simulator's answer to one): no LLM makes an answer up.
            return None
        prompt = chat("simulator.j2", city=self.task.name, country=self.task.country, question=question)
        return Request(prompt, lambda reply: Answer(parse_simulator(reply, hidden(self.task)), is_guess=False, correct=False))

    def simulator_failed(self, text: str) -> Answer:
        return Answer(UNKNOWN, is_guess=False, correct=False)  # a guess never reaches the LLM simulator


class Scripted:
    """A knowledge-base policy (policies.py) acting on a game and answering in the action format."""

    def __init__(self, policy):
        self.policy, self.name = policy, policy.name

    def act(self, game: GuessMyCityGame, rng: random.Random) -> str:
        action = self.policy.act(game.view(), rng)
        return render_action(action.reason, action.question)


class GuessMyCity(QuestionRoleRequests, ReasonQuestionActions, Environment):
    name = "guess_my_city"
    secret_key = "city"  # what the role templates call it
    Options = GuessMyCityOptions
    options: GuessMyCityOptions
    splits = SPLITS

    def __init__(self, options: GuessMyCityOptions):
        super().__init__(options)
        self.cities = load_cities()
        self.oracle = load_oracle(self.cities)
        self.proposer = proposer.OracleProposer(self.oracle)
        # HOPE's player chooses among every listed city, test cities included, whether or not
        # the prompts list them.
        self.candidates = list(self.cities.cities)

    @property
    def max_turns(self) -> int:
        return self.options.max_turns

    def shown(self) -> list[str] | None:
        """The candidate list as the prompts show it ("City, Country"), or None when they do not."""
        return [c.id for c in self.candidates] if self.options.show_candidates else None

    def tasks(self, split: str) -> list[City]:
        return self.cities.split(split)

    def task(self, task_id: str) -> City:
        return self.cities.get(task_id)

    def game(self, task: City) -> GuessMyCityGame:
        return GuessMyCityGame(self, task)

    def view(self, prefix: Sequence[Mapping]) -> PlayerView:
        """What the player saw before question number len(prefix)."""
        return PlayerView(self.candidates, history(prefix), len(prefix), self.max_turns)

    # ---- action format ----

    def same_action(self, a: str, b: str) -> bool:
        return proposer.same_action(self.oracle, a, b)

    # ---- rewards: -1 a question, 0 for the right guess, -max_turns for a loss ----

    @property
    def reward_range(self) -> tuple[float, float]:
        return -float(self.max_turns), 0.0

    def won(self, reward: float) -> bool:
        return reward > -self.max_turns  # every loss, a wrong guess included, returns exactly -max_turns

    def relabel_turns(self, num_turns: int) -> list[int]:
        return fraction_window(num_turns, 0.3, 0.8)  # HOPE's GuessMyCity window [0.3T, 0.8T)

    # ---- scripted behaviour ----

    def policies(self, noise: Mapping[str, float]) -> dict[str, Policy]:
        return {
            "expert": Scripted(ExpertPolicy(self.oracle)),
            "noisy": Scripted(NoisyPolicy(**noise, oracle=self.oracle)),
            "random": Scripted(RandomPolicy(self.oracle)),
        }

    def tokenizer_corpus(self) -> list[str]:
        # Held-out games' observations too (every city's answers), so they encode as compactly.
        names = [n for c in self.candidates for n in c.names]
        answers = [a for c in self.candidates for a in self.oracle.answers(c).values()]
        return names + answers + [system_prompt(self.max_turns, [c.id for c in self.candidates])]

    def fact_sheets(self, seed: int) -> list[list[dict]]:
        return fact_sheets(self.oracle, self.options.facts_per_object, seed, self.options.fact_breadth)

    # ---- oracle roles ----

    def oracle_version(self, role: str) -> str:
        return ORACLE_VERSIONS[role]

    def _counterfactual(self, p: proposer.Proposal) -> Counterfactual:
        return Counterfactual(render_action(p.action.reason, p.action.question), p.action.question, p.action.reason, p.rationale)

    def summarize(self, task: City, turns, success: bool) -> str:
        return summarizer.summarize_game(self.oracle, task, history(turns), success, self.max_turns)

    def propose(self, task: City, prefix, n: int, original: str | None = None) -> list[Counterfactual]:
        return [self._counterfactual(p) for p in self.proposer.propose(task, self.view(prefix), n)]

    def critique(self, task: City, turns, top: int) -> list[tuple[int, Counterfactual]]:
        places = self.proposer.critique(task, self.candidates, history(turns), self.max_turns, top)
        return [(turn, self._counterfactual(p)) for turn, p, _ in places]

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

    # ---- LLM roles ----

    def prompt_hash(self, role: str) -> str:
        return template_hash(TEMPLATES[role])

    def _player_move(self, task: City, view: PlayerView, question: str) -> str | None:
        """Why `question` is not a move the player could have made at `view` (it guesses the secret
        with hindsight, or asks for a name the rules forbid), or None."""
        if topic(question) == "name":
            return "asks for the name of the city or its country, which the rules forbid"
        return proposer.unjustified_guess(self.oracle, task, view, question)

    def summary_request(self, task: City, turns, success: bool) -> Request[str]:
        prompt = chat("summary.j2", history=dialogue(history(turns)), city=task.name, country=task.country, continent=task.continent,
                      success=success, max_turns=self.max_turns, candidates=self.shown())
        return Request(prompt, parse_summary)

    def proposer_request(self, task: City, prefix, n: int, summary: str) -> Request[list[Counterfactual]]:
        view = self.view(prefix)
        prompt = chat("proposer.j2", n=n, summary=summary, history=dialogue(view.history), turn=view.turn, max_turns=self.max_turns, candidates=self.shown())

        def parse(text: str) -> list[Counterfactual]:
            """parse_proposals, refusing a question the player could not have asked: the action
            enters the trajectory as the player's move."""
            out = []
            for i, p in enumerate(parse_proposals(text, n, {"city": task.names})):
                if (why := self._player_move(task, view, p.question)) is not None:
                    raise ValueError(f"proposal {i}: the question {why}")
                out.append(Counterfactual(render_action(p.player_reason, p.question), p.question, p.player_reason, p.teacher_reason))
            return out

        return Request(prompt, parse)

    def forward_request(self, game: GuessMyCityGame) -> Request[list[tuple[str, Answer]]]:
        task, start = game.task, game.turn + 1
        prompt = chat("forward.j2", city=task.name, country=task.country, max_turns=self.max_turns,
                      dialogue=dialogue(list(game.state.history)), start=start, candidates=self.shown())

        def answer(replay: Game, question: str, text: str) -> Answer:
            """A guess is answered by the rules; no other answer may name the city or its country."""
            return replay.answer(question) if guessed_city(self.cities, question) is not None else Answer(read_answer(text, hidden(task)), False, False)

        def parse(text: str) -> list[tuple[str, Answer]]:
            replay = Game(self.cities, task, self.oracle.answer, max_turns=self.max_turns)
            replay.restore(list(game.state.history))
            return replay_continuation(
                parse_continuation(text, start, self.max_turns), start, replay,
                view=lambda r: PlayerView(self.candidates, list(r.history), r.turn, self.max_turns),
                refused=lambda view, q: self._player_move(task, view, q),
                answer=answer,
            )

        return Request(prompt, parse)

    def prompt(self, template: str, **values) -> list[dict]:
        return chat(template, **values)

    def refused(self, task: City, prefix, question: str) -> str | None:
        return self._player_move(task, self.view(prefix), question)
