"""The QA teacher (Refit/Swift's reasoning setting) behind the environment interface (envs/base.py).

A scripted teacher walks the answerer through a four-option multiple-choice question in
`env.turns` turns (the paper's n = 3): the question and a first analysis, why the other options
fail, then the final answer with its justification (for n > 3 the paper's intermediate turns come
between the last two). The answerer writes in the system prompt's format in one of the paper's two
modes (`env.mode`: thinking, reasoning inside <thinking></thinking> tags; or standard). The
conversation ends after the answerer's last turn, and the reward, on that step, is the oracle
judge's Overall / 10 (judge.py); `success` is exact-match accuracy, the final answer's letter
against the key (format.read_answer). The labeler is the same judge, as oracle or as an LLM on the
paper's rubric (`roles.labeler: {mode: rubric}`).

Tasks: questions generated from the project's data (generators.py, `env.generators`, sizes
`env.train_questions` / `val_questions` / `test_questions`, seeded by `env.question_seed`) or a
user's JSONL file (`env.questions_file`, mcq_file.py).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import Field

from envs.base import Counterfactual, Environment, Label, Options, Policy, Request, Step
from envs.base import Game as BaseGame

from . import llm_roles
from .format import read_answer, reasoning, system_prompt, teacher_turn
from .generators import GENERATORS, generate
from .judge import VERSION, describe, judge, states
from .mcq_file import load_mcq_file
from .policies import FILLER, Expert, Noisy, Random, Unjustified, Wrong, expert
from .questions import LETTERS, SPLITS, Question

Generator = Literal["twenty_questions", "cities", "car_dealer", "arithmetic"]
VERSIONS = {"labeler": VERSION, "summarizer": "qa-teacher-summary-v1", "proposer": "qa-teacher-proposer-v1", "controller": "qa-teacher-proposer-v1"}


class QATeacherOptions(Options):
    mode: Literal["thinking", "standard"] = "thinking"  # the paper's two modes: reasoning inside <thinking></thinking> tags, or plain
    turns: int = Field(3, ge=3, le=10)  # the answerer's turns, n (paper: 3; its ablation 4 to 10 adds intermediate turns)
    generators: tuple[Generator, ...] = Field(tuple(GENERATORS), min_length=1)  # each split's questions shared among these
    train_questions: int = Field(400, ge=1)  # paper: 400 train / 100 test a dataset
    val_questions: int = Field(50, ge=1)  # checkpoint choices (critic, actor, StepAgent) play val; the paper has none
    test_questions: int = Field(100, ge=1)
    question_seed: int = 0  # the generators' draws (which questions, the order of their options)
    questions_file: str | None = None  # a user's JSONL of questions instead of the generators (mcq_file.py)


class QAGame(BaseGame):
    def __init__(self, env: QATeacher, task: Question):
        self.env, self.task, self.max_turns, self.mode = env, task, env.max_turns, env.options.mode
        self.replies: list[str] = []

    turn = property(lambda self: len(self.replies))
    done = property(lambda self: len(self.replies) >= self.max_turns)

    @property
    def success(self) -> bool:
        return self.done and read_answer(self.replies[-1])[0] == self.task.answer

    def reset(self):
        return [{"role": "system", "content": system_prompt(self.mode)},
                {"role": "user", "content": teacher_turn(self.task, self.mode, 0, self.max_turns)}], {}

    def step(self, text: str, answer: object | None = None) -> Step:
        """The teacher is scripted: whatever the reply, it asks its next question, and after the
        last turn the judge scores the whole conversation (the step's reward)."""
        if self.done:
            raise RuntimeError(f"the conversation on {self.task.id} is over; start a new one")
        self.replies.append(text)
        letter = read_answer(text)[0]
        reward, observation = 0.0, []
        if self.done:
            reward = judge(self.task, self.replies, self.mode == "thinking").reward
        else:
            observation = [{"role": "user", "content": teacher_turn(self.task, self.mode, self.turn, self.max_turns)}]
        info = {
            "message": {"role": "assistant", "content": text},
            "turn": {"reason": reasoning(text), "action": " ".join(text.split()), "observation": observation[0]["content"] if observation else ""},
            "parsed": letter is not None,
            "success": self.success,
        }
        # the conversation has n turns by the setting's rules: its end is the task's, not a limit run out
        return Step(observation, reward, self.done, False, info)

    def restore(self, turns) -> None:
        if self.replies:
            raise RuntimeError("restore() needs a fresh game")
        if len(turns) >= self.max_turns:
            raise ValueError(f"a prefix of {len(turns)} turns leaves no turn of {self.max_turns}")
        self.replies = [t["action"] for t in turns]

    def simulator_request(self, text: str) -> None:
        return None  # the teacher is scripted (the paper's reasoning setting): no LLM answers for it


class QATeacher(Environment):
    name = "qa_teacher"
    Options = QATeacherOptions
    options: QATeacherOptions
    splits = SPLITS
    reward_bin = 0.1

    def __init__(self, options: QATeacherOptions):
        super().__init__(options)
        o = options
        sizes = {"train": o.train_questions, "val": o.val_questions, "test": o.test_questions}
        self.questions = load_mcq_file(o.questions_file, sizes) if o.questions_file else generate(o.generators, sizes, o.question_seed)
        self.by_id = {q.id: q for qs in self.questions.values() for q in qs}

    @property
    def max_turns(self) -> int:
        return self.options.turns

    @property
    def thinking(self) -> bool:
        return self.options.mode == "thinking"

    def tasks(self, split: str) -> list[Question]:
        if split not in SPLITS:
            raise KeyError(f"unknown split {split!r}; expected one of {list(SPLITS)}")
        return list(self.questions[split])

    def task(self, task_id: str) -> Question:
        try:
            return self.by_id[task_id]
        except KeyError:
            raise KeyError(f"unknown QA teacher question {task_id!r}") from None

    def game(self, task: Question) -> QAGame:
        return QAGame(self, task)

    # ---- action format: the action is the whole reply (the paper's a_t), its reasoning inside ----

    def render_action(self, reason: str, action: str) -> str:
        return action

    def parse_action(self, text: str) -> tuple[str, str]:
        letter, why = read_answer(text)
        if letter is None:
            raise ValueError(why)
        return reasoning(text), " ".join(text.split())

    # ---- rewards: the judge's Overall / 10, at the end ----

    @property
    def reward_range(self) -> tuple[float, float]:
        return 0.0, 1.0

    def won(self, reward: float) -> bool:
        return reward >= 0.5  # the oracle judge's Overall is at least 5 exactly when the final answer is right

    def relabel_turns(self, num_turns: int) -> list[int]:
        return list(range(num_turns))  # three turns, each can go wrong: the answer, the eliminations, the justification

    # ---- scripted behaviour ----

    def policies(self, noise: Mapping[str, float]) -> dict[str, Policy]:
        return {p.name: p for p in (Expert(), Noisy(**noise), Wrong(), Unjustified(), Random())}

    def tokenizer_corpus(self) -> list[str]:
        first = [teacher_turn(q, self.options.mode, 0, self.max_turns) for qs in self.questions.values() for q in qs]
        any_q = next(iter(self.by_id.values()))
        later = [teacher_turn(any_q, self.options.mode, t, self.max_turns) for t in range(1, self.max_turns)]
        facts = [f for q in self.by_id.values() for f in (*q.facts, *q.false_facts)]
        return [system_prompt(self.options.mode), *first, *later, *facts, *FILLER]

    # ---- oracle roles: they see the key ----

    def oracle_version(self, role: str) -> str:
        return VERSIONS[role]

    def _replies(self, turns: Sequence[Mapping]) -> list[str]:
        return [t["action"] for t in turns]

    def summarize(self, task: Question, turns, success: bool) -> str:
        replies = self._replies(turns)
        letters = ", ".join(read_answer(r)[0] or "none" for r in replies)
        head = f"The question ({task.source}) asks: {task.question} The key is {task.answer} ({task.option(task.answer)}). Answers by turn: {letters}."
        if len(replies) < self.max_turns:
            return f"{head} The conversation stopped after {len(replies)} of {self.max_turns} turns."
        verdict = judge(task, replies, self.thinking)
        said = [L for i, L in enumerate(LETTERS) if any(states(r, task.facts[i]) for r in replies)]
        wrong = [L for i, L in enumerate(LETTERS) if any(states(r, task.false_facts[i]) for r in replies)]
        return (f"{head} It stated the facts of options {', '.join(said) or 'none'} and false claims about {', '.join(wrong) or 'none'}; "
                f"{describe(task, verdict)}.")

    def propose(self, task: Question, prefix, n: int, original: str | None = None) -> list[Counterfactual]:
        """The expert's reply at the prefix's next turn: the key, with the facts that turn asks
        for; none where the reply given was that already."""
        better = expert(task, self.options.mode, len(prefix), self.max_turns)
        if original is not None and self.same_action(original, " ".join(better.split())):
            return []
        return [llm_roles.counterfactual(better, self._rationale(task, original))]

    def _rationale(self, task: Question, original: str | None) -> str:
        said = read_answer(original)[0] if original is not None else None
        was = "" if original is None else f" The reply given stated {said or 'no answer'}" + (" and left out the facts that settle it." if said == task.answer else ".")
        return f"The key is {task.answer}: {task.facts[task.key]}{was}"

    def critique(self, task: Question, turns, top: int) -> list[tuple[int, Counterfactual]]:
        """HR's controller: the turns whose reply is not the expert's, those stating a wrong
        letter (or none) first, later turns first (the final answer decides accuracy), each
        with the expert's reply."""
        places = []
        for t, reply in enumerate(self._replies(turns)):
            better = expert(task, self.options.mode, t, self.max_turns)
            if not self.same_action(reply, " ".join(better.split())):
                places.append((read_answer(reply)[0] == task.answer, -t, better, reply))
        places.sort(key=lambda p: p[:2])
        return [(-t, llm_roles.counterfactual(better, self._rationale(task, reply))) for _, t, better, reply in places[:top]]

    def label(self, task_id: str, turns) -> Label:
        if task_id not in self.by_id:
            return Label(None, None, f"task {task_id!r} is not a QA teacher question")
        if len(turns) != self.max_turns:
            return Label(None, None, f"{len(turns)} turns, but the conversation has {self.max_turns}")
        q = self.by_id[task_id]
        verdict = judge(q, self._replies(turns), self.thinking)
        return Label(verdict.reward, verdict.correct, describe(q, verdict), verdict.scores)

    # ---- LLM roles ----

    def prompt_hash(self, role: str) -> str:
        if role not in llm_roles.TEMPLATES:
            raise NotImplementedError(f"QATeacher has no LLM {role} prompt")
        return llm_roles.PROMPTS.hash(*llm_roles.TEMPLATES[role])

    def summary_request(self, task: Question, turns, success: bool) -> Request[str]:
        return llm_roles.summary_request(task, self.options.mode, self.max_turns, turns)

    def proposer_request(self, task: Question, prefix, n: int, summary: str) -> Request[list[Counterfactual]]:
        return llm_roles.proposer_request(task, self.options.mode, self.max_turns, prefix, n, summary)

    def proposer_reply(self, proposals: Sequence[Counterfactual]) -> str:
        return llm_roles.proposal_reply(proposals)

    def judge_request(self, task_id: str, turns) -> Request[dict[str, float]]:
        return llm_roles.judge_request(self.task(task_id), self.options.mode, self.max_turns, turns)
