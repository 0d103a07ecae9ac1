"""TwentyQuestions behind the environment interface (envs/base.py): the knowledge-base game,
HOPE's REASON/QUESTION format, the oracle roles and the LLM roles' prompts of this package."""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import Field

from envs.base import (
    EMPTY_REPLY,
    Counterfactual,
    Environment,
    Label,
    Options,
    Policy,
    Request,
    Step,
    fraction_window,
    recorded_reply,
)
from envs.base import Game as BaseGame
from envs.nlac import Critique, NlacRequests
from envs.question_roles import QuestionRoleRequests, dialogue, history, parse_proposals, parse_summary, replay_continuation
from envs.reason_question import ReasonQuestionActions

from . import critic, labeler, proposer, summarizer
from .facts import fact_sheets
from .format import PROMPTS, ActionParseError, final_message, observation_message, parse_action, render_action, system_prompt
from .game import MAX_TURNS, Answer, Game
from .kb import EXPECTED_COUNTS, Entity, KnowledgeBase, load_kb
from .llm_roles import chat, parse_continuation, parse_yes_no, template_hash
from .policies import ExpertPolicy, NoisyPolicy, PlayerView, RandomPolicy, known

TEMPLATES = {
    "simulator": "simulator.j2", "summarizer": "summary.j2", "proposer": "proposer.j2", "controller": "controller.j2",
    "forward": "forward.j2", "labeler": "labeler.j2", "judge": "judge.j2",
    "language_critic": "nlac_critic.j2", "backup": ("nlac_future.j2", "nlac_target.j2"), "refiner": ("nlac_critic.j2", "nlac_refine.j2"),
}
ORACLE_VERSIONS = {
    "summarizer": summarizer.VERSION, "proposer": proposer.VERSION, "controller": proposer.VERSION, "labeler": labeler.VERSION,
    "language_critic": critic.VERSION, "backup": critic.VERSION, "refiner": proposer.VERSION,
}


class TwentyQuestionsOptions(Options):
    max_turns: int = Field(MAX_TURNS, ge=1, le=100)  # HOPE: 20, the last one a forced guess
    show_candidates: bool = False  # list the split's objects in the prompts (HOPE does; costs tokens)
    facts_per_object: int = Field(0, ge=0)  # fact sheets: riddles about every object of every split (bootstrap trains on them; 8 to a sequence)
    fact_breadth: int = Field(3, ge=1)  # fact sheets: each statement drawn from this many of the most telling
    fact_form: Literal["statements", "guess", "known"] = "statements"  # statements given, written as a guess's reason, or an observation's list then the guess
    fact_order: Literal["telling", "expert", "mixed"] = "telling"  # fact sheets: statements drawn from the fact_breadth most telling, the expert's path to the object, or every other riddle each way
    # answer: each observation is the oracle's answer; known: it is followed by what all the
    # answers so far established ("Known: not hand-sized, outdoor."), and a guess's reason only
    # names the object (the list stands in the observation before it)
    observation: Literal["answer", "known"] = "answer"


def llm_answer(kb: KnowledgeBase, secret: Entity, question: str, text: str) -> Answer:
    """A model's yes/no/unknown as the game's answer: a win needs a yes to a guess that names the
    secret, so a model that says yes to everything cannot hand out wins."""
    guess = kb.resolve_guess(question)
    return Answer(text, is_guess=guess is not None, correct=text == "yes" and guess == secret)


class TwentyQuestionsGame(BaseGame):
    def __init__(self, env: TwentyQuestions, task: Entity):
        self.env, self.task, self.max_turns = env, task, env.max_turns
        # A player shown the split's list narrows to it; one not shown it must consider every
        # object it knows, so scripted players then search the whole knowledge base.
        self.candidates = env.candidates(task.split)
        self.state = Game(env.kb, task, max_turns=env.max_turns)

    @property
    def turn(self) -> int:
        return self.state.turn

    @property
    def done(self) -> bool:
        return self.state.done

    @property
    def success(self) -> bool:
        return self.state.success

    def reset(self):
        names = [c.name for c in self.candidates] if self.env.options.show_candidates else None
        return [
            {"role": "system", "content": system_prompt(max_turns=self.max_turns, candidates=names)},
            {"role": "user", "content": observation_message(None, 0, self.max_turns)},
        ], {}

    def read(self, text: str) -> tuple[str, str, bool]:
        """(reason, question, parsed). An unparseable text is asked as it is: the simulator hears
        the raw text, as a sloppy agent would be treated; an empty one is the question EMPTY_REPLY."""
        try:
            action = parse_action(text)
            return action.reason, action.question, True
        except ActionParseError:
            return "", recorded_reply(text).strip(), False

    def step(self, text: str, answer: Answer | None = None) -> Step:
        reason, question, parsed = self.read(text)
        s = self.state.step(question, answer)
        known_so_far = known(self.env.kb, self.state.history) if self.env.options.observation == "known" else ""
        content = final_message(s.observation, s.success) if s.done else observation_message(s.observation, self.turn, self.max_turns, known_so_far)
        info = {
            "message": {"role": "assistant", "content": text},
            "turn": {"reason": reason, "action": question, "observation": s.observation},
            "parsed": parsed,
            "success": s.success,
        }
        # Only a right guess ends the game early; a non-guess on the final turn runs out of turns.
        return Step([{"role": "user", "content": content}], s.reward, s.success, s.done and not s.success, info)

    def restore(self, turns) -> None:
        self.state.restore(history(turns))

    def view(self) -> PlayerView:
        return PlayerView(self.candidates, list(self.state.history), self.state.turn, self.max_turns)

    def simulator_request(self, text: str) -> Request[Answer] | None:
        question = self.read(text)[1]
        if question == EMPTY_REPLY:
            return None  # it asks nothing: the oracle's "unknown" stands, no LLM makes an answer up
        prompt = chat("simulator.j2", secret=self.task.name, category=self.task.category, question=question)
        return Request(prompt, lambda reply: llm_answer(self.env.kb, self.task, question, parse_yes_no(reply)))

    def simulator_failed(self, text: str) -> Answer:
        return Answer("unknown", is_guess=self.env.kb.resolve_guess(self.read(text)[1]) is not None, correct=False)


class Scripted:
    """A knowledge-base policy (policies.py) acting on a game and answering in the action format."""

    def __init__(self, policy):
        self.policy, self.name = policy, policy.name

    def act(self, game: TwentyQuestionsGame, rng: random.Random) -> str:
        action = self.policy.act(game.view(), rng)
        return render_action(action.reason, action.question)


class TwentyQuestions(NlacRequests, QuestionRoleRequests, ReasonQuestionActions, Environment):
    name = "twenty_questions"
    secret_key = "secret"  # what the role templates call it
    Options = TwentyQuestionsOptions
    options: TwentyQuestionsOptions
    splits = tuple(EXPECTED_COUNTS)

    def __init__(self, options: TwentyQuestionsOptions):
        super().__init__(options)
        self.kb = load_kb()
        self.oracle = proposer.OracleProposer(self.kb, listed=self.listed)

    @property
    def listed(self) -> bool:
        """A guess's reason lists what the answers established, unless the observations do."""
        return self.options.observation == "answer"

    @property
    def max_turns(self) -> int:
        return self.options.max_turns

    def tasks(self, split: str) -> list[Entity]:
        return self.kb.split(split)

    def task(self, task_id: str) -> Entity:
        return self.kb.get(task_id)

    def candidates(self, split: str) -> list[Entity]:
        return self.kb.split(split) if self.options.show_candidates else list(self.kb.entities)

    def game(self, task: Entity) -> TwentyQuestionsGame:
        return TwentyQuestionsGame(self, task)

    def view(self, task: Entity, prefix: Sequence[Mapping]) -> PlayerView:
        """What the player saw before action number len(prefix)."""
        return PlayerView(self.candidates(task.split), history(prefix), len(prefix), self.max_turns)

    def _names(self, task: Entity) -> list[str] | None:
        return [e.name for e in self.kb.split(task.split)] if self.options.show_candidates else None

    # ---- action format ----

    def same_action(self, a: str, b: str) -> bool:
        return proposer.same_action(self.kb, a, b)

    # ---- rewards: -1 a turn, 0 for the right guess ----

    @property
    def reward_range(self) -> tuple[float, float]:
        return -float(self.max_turns), 0.0

    def won(self, reward: float) -> bool:
        return reward > -self.max_turns  # a failed game returns exactly -max_turns

    def relabel_turns(self, num_turns: int) -> list[int]:
        # HOPE's [0.3T, 0.6T): too early and nothing is narrowed yet; too late and the proposer
        # could just name the secret.
        return fraction_window(num_turns, 0.3, 0.6)

    # ---- scripted behaviour ----

    def policies(self, noise: Mapping[str, float]) -> dict[str, Policy]:
        return {
            "expert": Scripted(ExpertPolicy(self.kb, listed=self.listed)),
            "noisy": Scripted(NoisyPolicy(**noise, kb=self.kb, listed=self.listed)),
            "random": Scripted(RandomPolicy(self.kb)),
        }

    def tokenizer_corpus(self) -> list[str]:
        names = [n for e in self.kb.entities for n in (e.name, *e.aliases)]
        return names + [system_prompt(self.max_turns, [x.name for x in self.kb.split(s)]) for s in self.splits]

    def fact_sheets(self, seed: int) -> list[list[dict]]:
        return fact_sheets(self.kb, self.options.facts_per_object, seed, self.options.fact_breadth, form=self.options.fact_form, order=self.options.fact_order)

    # ---- oracle roles ----

    def oracle_version(self, role: str) -> str:
        return ORACLE_VERSIONS[role]

    def _counterfactual(self, p: proposer.Proposal) -> Counterfactual:
        return Counterfactual(render_action(p.action.reason, p.action.question), p.action.question, p.action.reason, p.rationale)

    def summarize(self, task: Entity, turns, success: bool) -> str:
        return summarizer.summarize_game(self.kb, task, history(turns), success)

    def propose(self, task: Entity, prefix, n: int, original: str | None = None) -> list[Counterfactual]:
        return [self._counterfactual(p) for p in self.oracle.propose(task, self.view(task, prefix), n, original)]

    def critique(self, task: Entity, turns, top: int) -> list[tuple[int, Counterfactual]]:
        places = self.oracle.critique(task, self.candidates(task.split), history(turns), self.max_turns, top)
        return [(turn, self._counterfactual(p)) for turn, p, _ in places]

    def label(self, task_id: str, turns) -> Label:
        return labeler.label_trajectory(self.kb, task_id, [t["action"] for t in turns], self.max_turns)

    def oracle_critique(self, task: Entity, turns, text: str) -> Critique:
        return critic.critique(self.kb, self.oracle, task, self.view(task, turns), text, self.listed)

    def oracle_backup(self, task: Entity, turns, turn, terminal: bool, final_return: float) -> Critique:
        return critic.critique(self.kb, self.oracle, task, self.view(task, turns), self.render_action(turn["reason"], turn["action"]), self.listed,
                               answer=turn["observation"], reward=final_return if terminal else None)

    # ---- LLM roles ----

    def prompt_hash(self, role: str) -> str:
        names = TEMPLATES[role]
        return template_hash(*((names,) if isinstance(names, str) else names))

    def summary_request(self, task: Entity, turns, success: bool) -> Request[str]:
        prompt = chat("summary.j2", history=dialogue(history(turns)), secret=task.name, category=task.category, success=success, candidates=self._names(task))
        return Request(prompt, parse_summary)

    def proposer_request(self, task: Entity, prefix, n: int, summary: str) -> Request[list[Counterfactual]]:
        view = self.view(task, prefix)
        names = [e.name for e in view.candidates] if self.options.show_candidates else None
        prompt = chat("proposer.j2", n=n, summary=summary, history=dialogue(view.history), turn=view.turn, max_turns=self.max_turns, candidates=names)

        def parse(text: str) -> list[Counterfactual]:
            """parse_proposals, refusing a question that guesses the secret with hindsight: the
            action enters the trajectory as the player's move."""
            out = []
            for i, p in enumerate(parse_proposals(text, n, {"secret": [task.name], "category": [task.category]})):
                if (why := proposer.unjustified_guess(self.kb, task, view, p.question)) is not None:
                    raise ValueError(f"proposal {i}: the question {why}")
                out.append(Counterfactual(render_action(p.player_reason, p.question), p.question, p.player_reason, p.teacher_reason))
            return out

        return Request(prompt, parse)

    def forward_request(self, game: TwentyQuestionsGame) -> Request[list[tuple[str, Answer]]]:
        task, start = game.task, game.turn + 1
        prompt = chat("forward.j2", secret=task.name, category=task.category, max_turns=self.max_turns, dialogue=dialogue(list(game.state.history)), start=start)

        def parse(text: str) -> list[tuple[str, Answer]]:
            replay = Game(self.kb, task, max_turns=self.max_turns)
            replay.restore(list(game.state.history))
            return replay_continuation(
                parse_continuation(text, start, self.max_turns), start, replay,
                view=lambda r: PlayerView(game.candidates, list(r.history), r.turn, self.max_turns),
                refused=lambda view, q: proposer.unjustified_guess(self.kb, task, view, q),
                answer=lambda r, q, a: llm_answer(self.kb, task, q, a),
            )

        return Request(prompt, parse)

    def prompt(self, template: str, **values) -> list[dict]:
        return chat(template, **values)

    def nlac_instruction(self, template: str, **values) -> str:
        return PROMPTS.render(template, **values)

    def refused(self, task: Entity, prefix, question: str) -> str | None:
        return proposer.unjustified_guess(self.kb, task, self.view(task, prefix), question)
