"""Role calls: unparseable output is sampled again, then recorded with its reason; backend
failures are recorded; a stage fails past its failure rate."""
import pytest

from models.base import Completion, SamplingParams
from tasks.params import RoleParams
from tasks.roles import RoleFailure, account, call_parsed, check_failure_rate

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=8)


class Scripted:
    """Answers from a script per (prompt, attempt): a stand-in for a model's outputs, which the
    real backends' own tests cover."""

    backend, model_id = "openai", "scripted"

    def __init__(self, script: dict[str, list[str | None]]):
        self.script, self.seen = script, {}

    def generate(self, convs, sampling, seeds):
        out = []
        for conv in convs:
            key = conv[-1]["content"]
            k = self.seen.get(key, 0)
            self.seen[key] = k + 1
            text = self.script[key][min(k, len(self.script[key]) - 1)]
            out.append(Completion("", error="HTTP 500 after 5 attempts") if text is None else Completion(text))
        return out


def parse_score(text: str) -> int:
    value = int(text.removeprefix("Score:").strip())  # ValueError on anything else
    if not 0 <= value <= 10:
        raise ValueError(f"score {value} outside 0..10")
    return value


def _prompts(*keys):
    return [[{"role": "user", "content": k}] for k in keys]


def test_outcomes_ok_retried_invalid_and_failed():
    gen = Scripted({"a": ["Score: 7"], "b": ["Score: eleven", "Score: 11", "Score: 4"], "c": ["nonsense"], "d": [None]})
    out = call_parsed(gen, _prompts("a", "b", "c", "d"), [1, 2, 3, 4], parse_score, SAMPLING, attempts=3)
    assert [(o.status, o.value, o.attempts) for o in out] == [("ok", 7, 1), ("ok", 4, 3), ("invalid", None, 3), ("failed", None, 1)]
    assert "unparseable after 3 attempts" in out[2].reason and out[2].text == "nonsense"
    assert out[3].reason == "HTTP 500 after 5 attempts"
    stats = account(out)
    assert stats == {"requests": 4, "ok": 2, "invalid": 1, "failed": 1, "attempts": 8, "failure_rate": 0.5, "top_reasons": [[1, out[2].reason], [1, out[3].reason]]}


def test_failure_rate_threshold():
    role = RoleParams(backend="openai", model="m", base_url="http://x/v1", max_failure_rate=0.25)
    gen = Scripted({"a": ["Score: 1"], "b": ["Score: 2"], "c": ["Score: 3"], "d": [None]})
    stats = account(call_parsed(gen, _prompts("a", "b", "c", "d"), [0] * 4, parse_score, SAMPLING, 1))
    check_failure_rate("label", "labeler", role, stats)  # 1 of 4 is at the threshold, not over
    gen = Scripted({"a": ["Score: 1"], "b": ["bad"], "c": ["Score: 3"], "d": [None]})
    stats = account(call_parsed(gen, _prompts("a", "b", "c", "d"), [0] * 4, parse_score, SAMPLING, 1))
    with pytest.raises(RoleFailure, match=r"label: the labeler role failed on 2 of 4 requests \(1 unparseable, 1 with no answer"):
        check_failure_rate("label", "labeler", role, stats)


def _logged_games(tmp_path, n_tasks: int):
    """Noisy scripted games, 2 per task on the first n_tasks train tasks, 6 turns at most."""
    from envs.twenty_questions.kb import load_kb
    from envs.twenty_questions.env import Scripted
    from envs.twenty_questions.policies import NoisyPolicy
    from storage.parquet import write_table
    from storage.schema import to_table
    from conftest import twenty_questions
    from tasks.rollout import ScriptedAgent, new_episode, play

    kb = load_kb()
    eps = [new_episode(twenty_questions(6), task, k) for task in kb.split("train")[:n_tasks] for k in range(2)]
    play(eps, ScriptedAgent(lambda rng: Scripted(NoisyPolicy(0.4, 0.2, 0.1))), 0, "logged")
    trajs = tmp_path / "trajectories.parquet"
    write_table(to_table([e.to_row() for e in eps], "trajectories"), trajs, "trajectories")
    return trajs


def _llm_role(model_dir) -> dict:
    """The untrained tiny model on hf, allowed to fail: these tests check the accounting."""
    return {"backend": "hf", "model": str(model_dir), "sampling": {"max_new_tokens": 12}, "parse_attempts": 2, "max_failure_rate": 1.0}


def test_llm_summarizer_and_labeler_on_hf_account_for_every_row(tiny_model_dir, tmp_path):
    """The summarize and label stages with an LLM role (the untrained tiny model on hf): its
    output is gibberish, so rows end invalid with their reasons, the stage fails past its failure
    rate, and a rerun is served entirely from the cache."""
    import pyarrow.parquet as pq

    from conftest import tiny_params
    from tasks.label import run_label
    from tasks.params import Params
    from tasks.summarize import run_summarize

    trajs, llm = _logged_games(tmp_path, 3), _llm_role(tiny_model_dir)
    p = Params.model_validate(tiny_params({"env": {"max_turns": 6}, "roles": {"summarizer": llm, "labeler": {**llm, "few_shot": 2}}}))

    m = run_summarize(p, trajs, tmp_path / "summarize")
    rows = pq.read_table(tmp_path / "summarize/summaries.parquet").to_pylist()
    assert len(rows) == 6 == m["trajectories"] == m["summaries"] + m["not_summarized"]
    assert all((r["status"] == "ok") == (r["summary"] is not None) for r in rows)
    assert all(r["reason"] for r in rows if r["status"] != "ok") and {r["backend"] for r in rows} == {"hf"}
    calls = m["calls"]
    assert calls["requests"] == 6 and calls["ok"] + calls["invalid"] + calls["failed"] == 6
    assert calls["cache"]["misses"] == calls["attempts"] > 0

    from tasks.relabel import run_relabel

    hope = Params.model_validate(tiny_params({"env": {"max_turns": 6}, "roles": {"proposer": llm}, "relabel": {"k": 2, "t": 1, "n": 2, "window": [0.0, 1.0]}}))
    m = run_relabel(hope, trajs, tmp_path / "summarize/summaries.parquet", tmp_path / "relabel")
    relabels = pq.read_table(tmp_path / "relabel/relabels.parquet").to_pylist()
    assert m["timesteps"] == m["calls"]["requests"] == 6  # 3 tasks x k=2 x t=1
    failed = [r for r in relabels if r["status"] != "ok"]
    assert len(failed) == m["not_proposed"] == m["calls"]["invalid"] + m["calls"]["failed"]
    assert all(r["reason"] and r["counterfactual_text"] is None for r in failed)

    m = run_label(p, [trajs], tmp_path / "label")
    labels = pq.read_table(tmp_path / "label/labels.parquet").to_pylist()
    assert len(labels) == 6 and m["calls"]["requests"] == 6
    assert all(r["reward"] is None for r in labels if r["status"] != "ok")
    assert m["calibration"]["pairs"] == sum(r["status"] == "ok" for r in labels)

    again = run_summarize(p, trajs, tmp_path / "again")
    assert again["calls"]["cache"] == {**again["calls"]["cache"], "misses": 0, "hits": calls["attempts"]}
    assert pq.read_table(tmp_path / "again/summaries.parquet").equals(pq.read_table(tmp_path / "summarize/summaries.parquet"))

    strict = Params.model_validate(tiny_params({"env": {"max_turns": 6}, "roles": {"labeler": {**llm, "max_failure_rate": 0.0}}}))
    assert m["calls"]["ok"] < 6  # an untrained model's gibberish is not a "Reward: <number>" line
    with pytest.raises(RoleFailure, match="label: the labeler role failed on"):
        run_label(strict, [trajs], tmp_path / "strict")


class SaysYes:
    """A model that answers yes to everything."""

    backend, model_id = "openai", "yes-man"

    def generate(self, convs, sampling, seeds):
        return [Completion("Yes.") for _ in convs]


def test_llm_simulator_cannot_hand_out_wins():
    from envs.twenty_questions.kb import load_kb
    from conftest import twenty_questions
    from tasks.rollout import new_episode
    from tasks.simulator import LLMSimulator

    kb = load_kb()
    secret, other = kb.split("train")[:2]
    role = RoleParams(backend="openai", model="m", base_url="http://x/v1")
    sim = LLMSimulator(SaysYes(), role)
    eps = [new_episode(twenty_questions(20), secret, s) for s in range(3)]
    questions = ["Is it an animal?", f"Is it {other.name}?", f"Is it {secret.name}?"]
    answers = sim.answer(eps, questions)
    assert [a.text for a in answers] == ["yes", "yes", "yes"]
    assert [(a.is_guess, a.correct) for a in answers] == [(False, False), (True, False), (True, True)]
    for ep, q, a in zip(eps, questions, answers):
        ep.apply(f"REASON: r\nQUESTION: {q}", a)
    assert [ep.done for ep in eps] == [False, False, True] and eps[2].game.success


def test_collect_with_an_llm_simulator_counts_every_answer(tiny_model_dir, tmp_path):
    from conftest import tiny_params
    from tasks.collect import run_collect
    from tasks.params import Params

    llm = {"backend": "hf", "model": str(tiny_model_dir), "sampling": {"max_new_tokens": 4}, "parse_attempts": 1, "max_failure_rate": 1.0}
    p = Params.model_validate(tiny_params({"env": {"max_turns": 4}, "roles": {"simulator": llm}, "collect": {"splits": ["train"], "m": 1, "limit_tasks": 2}}))
    m = run_collect(p, tiny_model_dir, tmp_path)
    calls = m["simulator_calls"]
    assert calls["requests"] == round(m["train"]["mean_turns"] * m["train"]["episodes"]) > 0  # one answer per turn
    assert m["train"]["simulator_failures"] == calls["invalid"] + calls["failed"]


def test_hr_controller_and_rubric_judge_on_hf(tiny_model_dir, tmp_path):
    """HR's hindsight controller and Refit's rubric judge as LLM roles: every dialogue gets a
    relabel row and every trajectory a label row, ok or with the reason it is not."""
    import pyarrow.parquet as pq

    from conftest import tiny_params
    from tasks.label import run_label
    from tasks.params import Params
    from tasks.relabel import run_relabel
    from tasks.summarize import run_summarize

    trajs, llm = _logged_games(tmp_path, 2), _llm_role(tiny_model_dir)
    p = Params.model_validate(tiny_params({
        "env": {"max_turns": 6},
        "roles": {"proposer": llm, "labeler": {**llm, "mode": "rubric"}},
        "relabel": {"mode": "hr"},
    }))
    run_summarize(p, trajs, tmp_path)  # the oracle summarizer
    m = run_relabel(p, trajs, tmp_path / "summaries.parquet", tmp_path / "relabel")
    rows = pq.read_table(tmp_path / "relabel/relabels.parquet").to_pylist()
    assert m["calls"]["requests"] == 4 == len(rows) + m["dropped_equal"]  # one call, one row per dialogue
    assert all(r["reason"] and r["branch_turn"] is None for r in rows if r["status"] != "ok")
    assert all(r["counterfactual_text"].startswith("REASON:") for r in rows if r["status"] == "ok")

    m = run_label(p, [trajs], tmp_path / "label")
    labels = pq.read_table(tmp_path / "label/labels.parquet").to_pylist()
    assert len(labels) == 4 and m["calls"]["requests"] == 4
    assert all((r["scores"] is None) == (r["status"] != "ok") for r in labels)
    assert m["calibration"]["pairs"] == 0 or m["calibration"]["mae"] is None  # rubric scores are not on the return's scale
