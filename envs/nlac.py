"""NLAC's language roles (Natural Language Actor-Critic; notes/nlac.md sections 2 and 4): the
critique's format and its parser, and the requests of the roles an LLM plays.

Every NLAC prompt continues the agent's own conversation, as the paper appends each instruction to
the history: the state s_t, the action a_t, then a user message asking for
- the critique Q_L(s_t, a_t) (A.1): `Future:` one possible future up to the task's end, then
  `Optimality:` Yes, or No and how to improve the action in one sentence;
- the bootstrapped future d_{t+1} (p_pred at s_{t+1}, A.2 step 1): the response to the action,
  then one possible future from there;
- the backup's target (p_tpred, A.2 step 2): the response and d_{t+1} combined into the critique's
  format; at a terminal transition there is no d_{t+1}, and the message gives the episode's end and
  its final reward instead, so the target is grounded in the environment's reward;
- the refined action (A.3): after the critique, an action in the agent's own format that replaces
  the one critiqued (it may copy it when it was optimal).

An environment words the instructions as templates beside its other prompts (its `nlac_*.j2`) and
renders them in `nlac_instruction`; `NlacRequests` puts them into the conversation.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from envs.base import Message, Request

FUTURE, OPTIMALITY = "Future:", "Optimality:"


@dataclass(frozen=True)
class Critique:
    """A language critic's output: a predicted future, whether the action was optimal, and (when
    not) how to improve it."""

    future: str
    optimal: bool
    reason: str = ""  # why not, and what would be better; "" for an optimal action

    @property
    def text(self) -> str:
        """The critique in A.1's format: what the critic is trained to write (L1's target)."""
        verdict = "Yes" if self.optimal else f"No. {self.reason}"
        return f"{FUTURE}\n{self.future}\n{OPTIMALITY}\n{verdict}"


def parse_critique(text: str) -> Critique:
    """A.1's format read back; ValueError saying what is wrong with anything else (the caller
    samples again, then counts the request a parse failure with that reason)."""
    body = text.strip()
    if not body.startswith(FUTURE):
        raise ValueError(f"the critique must begin with {FUTURE!r}, got {body[:40]!r}")
    for tag in (FUTURE, OPTIMALITY):
        if (n := body.count(tag)) > 1:
            raise ValueError(f"{n} {tag!r} tags; a critique has one")
    if OPTIMALITY not in body:
        raise ValueError(f"no {OPTIMALITY!r} after the future")
    future, verdict = (part.strip() for part in body[len(FUTURE):].split(OPTIMALITY))
    if not re.search(r"[A-Za-z]{2,}", future):
        raise ValueError("the future is empty")
    m = re.match(r"(yes|no)\b[\s.,:;!-]*(.*)", verdict, re.I | re.S)
    if not m:
        raise ValueError(f"{OPTIMALITY!r} must begin with Yes or No, got {verdict[:40]!r}")
    optimal, reason = m.group(1).lower() == "yes", " ".join(m.group(2).split())
    if not optimal and not re.search(r"[A-Za-z]{2,}", reason):
        raise ValueError("'No' without how the action could be improved")
    return Critique(" ".join(future.split()), optimal, reason)


def parse_future(text: str, max_chars: int = 2000) -> str:
    """A bootstrapped future d_{t+1}: a few sentences of prose, not a critique or an action."""
    future = " ".join(text.split())
    if not re.search(r"[A-Za-z]{3,}", future):
        raise ValueError("the future is empty")
    if len(future) > max_chars:
        raise ValueError(f"a future of {len(future)} characters, over {max_chars}")
    if OPTIMALITY in future:
        raise ValueError(f"the future already judges the action ({OPTIMALITY!r}); it should only predict")
    return future


def _user(content: str) -> Message:
    return {"role": "user", "content": content}


def _assistant(content: str) -> Message:
    return {"role": "assistant", "content": content}


def observation_text(observation: Sequence[Message]) -> str:
    """The messages that answered the action (a question's answer, a tool's result), as one text."""
    return "\n".join(m["content"] for m in observation if m.get("content")) or "(no response)"


class NlacRequests:
    """NLAC's LLM roles for an environment that words their instructions (`nlac_instruction`); the
    refiner's parser is the environment's own `parse_action`. Listed before Environment among its bases."""

    def nlac_instruction(self, template: str, **values) -> str:
        raise NotImplementedError

    def critic_request(self, state: Sequence[Message], action: Message) -> Request[Critique]:
        """Q_L(s_t, a_t) (A.1): the critic's prompt, also the one L1 trains under."""
        return Request([*state, action, _user(self.nlac_instruction("nlac_critic.j2"))], parse_critique)

    def future_request(self, state: Sequence[Message], action: Message, observation: Sequence[Message]) -> Request[str]:
        """d_{t+1} ~ M(p_pred(s_{t+1})) (A.2 step 1): the response to the action, and one possible future from there."""
        ask = self.nlac_instruction("nlac_future.j2", observation=observation_text(observation))
        return Request([*state, action, _user(ask)], parse_future)

    def target_request(
        self, state: Sequence[Message], action: Message, observation: Sequence[Message], future: str | None, reward: float, terminal: bool,
    ) -> Request[Critique]:
        """B_L's target (p_tpred, A.2 step 2): the response (and, before the end, the bootstrapped
        future d_{t+1}) combined into a critique of the action. At a terminal transition the
        instruction gives the episode's end and its final reward in place of a future."""
        seen = observation_text(observation)
        if terminal:
            ask = self.nlac_instruction("nlac_target.j2", terminal=True, observation=seen, reward=reward)
            return Request([*state, action, _user(ask)], parse_critique)
        if future is None:
            raise ValueError("a non-terminal transition's target needs the bootstrapped future d_{t+1}")
        first = self.nlac_instruction("nlac_future.j2", observation=seen)
        ask = self.nlac_instruction("nlac_target.j2", terminal=False, observation=seen, reward=reward)
        return Request([*state, action, _user(first), _assistant(future), _user(ask)], parse_critique)

    def refine_request(self, state: Sequence[Message], action: Message, critique: str) -> Request[str]:
        """a_t^r ~ pi^r(. | s_t, a_t, Q_L(s_t, a_t)) (A.3): after the critique, a revised action in
        the agent's format (refused unless parse_action reads it)."""
        messages = [*state, action, _user(self.nlac_instruction("nlac_critic.j2")), _assistant(critique), _user(self.nlac_instruction("nlac_refine.j2"))]

        def parse(text: str) -> str:
            self.parse_action(text)  # ValueError (the format's own) when it is not an action
            return text.strip()

        return Request(messages, parse)
