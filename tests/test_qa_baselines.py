"""Refit/Swift's baselines (issue 44, item 4): STaR-GATE's selection and its ties, the DPO and
StepDPO pairs on a hand-made group of three runs, distillation's loss on a hand-computed batch,
and the QA miniature's preset."""
from __future__ import annotations

import math

import polars as pl
import pytest
import torch
import yaml
from pydantic import ValidationError

from models.tiny import IGNORE
from tasks.params import MethodParams, Params, TrainStageParams, lay_preset, read_preset
from tasks.train import dpo, star_gate, step_dpo
from tasks.train.star_gate_d import distill_loss

from conftest import ROOT


def chat(*replies: str) -> list[dict]:
    """A three-turn QA dialogue: the system prompt, then teacher and answerer in turn."""
    out = [{"role": "system", "content": "Answer as asked."}]
    for i, reply in enumerate(replies):
        out += [{"role": "user", "content": f"teacher turn {i + 1}"}, {"role": "assistant", "content": reply}]
    return out


def table(rows: list[tuple]) -> pl.DataFrame:
    """(trajectory_id, task_id, reward, replies) rows of the training table's columns the baselines read."""
    return pl.DataFrame(
        [{"trajectory_id": t, "task_id": q, "split": "train", "source": "policy", "reward": r, "messages": chat(*replies)} for t, q, r, replies in rows],
        schema_overrides={"reward": pl.Float64},
    )


# q1: three runs, two tied at the top; q2: one unjudged run beside a judged one; q3: none judged;
# q4: every run tied.
GROUP = table([
    ("t2", "q1", 0.9, ("A1", "A2", "A3 right")),
    ("t1", "q1", 0.9, ("A1", "B2", "A3 also right")),
    ("t3", "q1", 0.2, ("A1", "B2", "C3 wrong")),
    ("u1", "q2", None, ("x", "y", "z")),
    ("u2", "q2", 0.4, ("x", "y", "w")),
    ("v1", "q3", None, ("x", "y", "z")),
    ("w1", "q4", 0.5, ("p", "q", "r")),
    ("w2", "q4", 0.5, ("p", "q", "s")),
])


def test_star_gate_takes_each_questions_best_run_ties_to_the_lowest_trajectory_id():
    kept = star_gate.select(GROUP)
    assert kept["trajectory_id"].to_list() == ["t1", "u2", "w1"]  # q1's tie: t1 < t2; q2: the judged run; q3: none
    assert kept.columns == GROUP.columns
    # the rule does not depend on the table's order
    assert star_gate.select(GROUP.reverse())["trajectory_id"].to_list() == ["t1", "u2", "w1"]


def test_dpo_pairs_the_best_runs_final_turn_over_the_worsts_at_the_question():
    pairs, counts = dpo.pairs(GROUP)
    assert counts == {"questions": 3, "pairs": 1, "tied": 2, "same_text": 0}  # q2: one judged run; q4: tied
    (p,) = pairs
    assert (p["task_id"], p["chosen_id"], p["rejected_id"]) == ("q1", "t1", "t3")
    assert p["prompt"] == chat("A1")[:2]  # the question as the dialogue opens, nothing after it
    assert (p["chosen"]["content"], p["rejected"]["content"]) == ("A3 also right", "C3 wrong")


def test_step_dpo_from_the_logs_pairs_runs_that_share_a_prefix_and_differ_at_a_step():
    pairs, counts = step_dpo.logged_pairs(GROUP)
    got = [(p["step"], p["chosen_id"], p["rejected_id"], p["chosen"]["content"], p["rejected"]["content"]) for p in pairs]
    # q1, best t1 against worst t3: at steps 0 and 1 all three share the prefix, and t1 and t3 wrote
    # the same (A1, then B2); at step 2 only t1 and t3 share [A1, B2], and differ. q4 is tied at
    # each of its three steps; q2's judged run is alone.
    assert got == [(2, "t1", "t3", "A3 also right", "C3 wrong")]
    assert counts == {"sites": 6, "pairs": 1, "tied": 3, "same_text": 2}
    assert pairs[0]["prompt"] == [*chat("A1", "B2"), {"role": "user", "content": "teacher turn 3"}]  # the shared prefix before step 2


def test_step_dpo_branch_pairs_by_trajectory_reward_ties_skipped():
    parents = [{"trajectory_id": "t1", "reward": 0.9, "messages": chat("A1", "B2", "A3")},
               {"trajectory_id": "t3", "reward": 0.2, "messages": chat("A1", "B2", "C3")}]
    branches = [
        {"trajectory_id": "b1", "parent_id": "t3", "branch_turn": 1, "reward": 0.8, "messages": chat("A1", "A2", "A3")},  # better than its parent
        {"trajectory_id": "b2", "parent_id": "t1", "branch_turn": 2, "reward": 0.3, "messages": chat("A1", "B2", "D3")},  # worse
        {"trajectory_id": "b3", "parent_id": "t1", "branch_turn": 0, "reward": 0.9, "messages": chat("C1", "B2", "A3")},  # tied
        {"trajectory_id": "b4", "parent_id": "t3", "branch_turn": 0, "reward": 0.5, "messages": chat("A1", "C2", "C3")},  # same action
        {"trajectory_id": "b5", "parent_id": "t1", "branch_turn": 1, "reward": None, "messages": chat("A1", "C2", "C3")},  # unjudged
        {"trajectory_id": "b6", "parent_id": "gone", "branch_turn": 1, "reward": 0.1, "messages": chat("A1", "C2", "C3")},
    ]
    pairs, counts = step_dpo.branch_pairs(parents, branches)
    assert [(p["chosen_id"], p["rejected_id"], p["step"], p["chosen"]["content"], p["rejected"]["content"]) for p in pairs] == [
        ("b1", "t3", 1, "A2", "B2"), ("t1", "b2", 2, "A3", "D3")]
    assert pairs[0]["prompt"] == chat("A1")[:4] + [{"role": "user", "content": "teacher turn 2"}]  # the parent's prefix before step 1
    assert counts == {"branches": 6, "pairs": 2, "tied": 1, "same_text": 1, "unjudged": 1, "parent_not_trained_on": 1}


def test_step_dpo_sites_are_every_step_or_a_seeded_draw_that_grows():
    parents = [{"trajectory_id": f"t{i}", "num_turns": 3} for i in range(4)]
    assert len(step_dpo.sites(parents, None, 0)) == 12
    few, more = step_dpo.sites(parents, 4, 0), step_dpo.sites(parents, 8, 0)
    key = lambda s: (s[0]["trajectory_id"], s[1])  # noqa: E731
    assert len(few) == 4 and {key(s) for s in few} <= {key(s) for s in more}


def test_distillation_loss_on_a_hand_computed_batch():
    """One supervised token (label 0) between two masked positions, two-word vocabulary, T = 2:
    the teacher's logits (2 ln 3, 0) soften to (3/4, 1/4), the student's (0, 0) to (1/2, 1/2)."""
    T, alpha = 2.0, 0.5
    student = torch.tensor([[[0.0, 0.0], [5.0, -5.0], [1.0, 2.0]]])
    teacher = torch.tensor([[[2 * math.log(3), 0.0], [-7.0, 7.0], [0.0, 3.0]]])  # the masked positions differ wildly
    labels = torch.tensor([[IGNORE, 0, IGNORE]])  # position 0 predicts token 1, the agent's
    loss, kl, ce = distill_loss(student, teacher, labels, alpha, T)
    want_kl = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    assert kl.item() == pytest.approx(want_kl, abs=1e-6)
    assert ce.item() == pytest.approx(math.log(2), abs=1e-6)
    assert loss.item() == pytest.approx(alpha * T**2 * want_kl + (1 - alpha) * math.log(2), abs=1e-6)
    # alpha 0: the SFT loss alone; a teacher equal to the student: the KL vanishes
    assert distill_loss(student, teacher, labels, 0.0, T)[0].item() == pytest.approx(math.log(2), abs=1e-6)
    assert distill_loss(student, student, labels, alpha, T)[1].item() == pytest.approx(0.0, abs=1e-7)


def test_baseline_knobs_belong_to_their_methods_and_the_teacher_trains_first():
    with pytest.raises(ValidationError, match="distill applies to algorithm star_gate_d only"):
        MethodParams(algorithm="star_gate", distill={"alpha": 0.3})
    with pytest.raises(ValidationError, match="step_dpo applies to algorithm step_dpo only"):
        MethodParams(algorithm="dpo", step_dpo={"pairs_from": "logs"})
    with pytest.raises(ValidationError, match="sites and sampling size and sample the branch rollouts"):
        MethodParams(algorithm="step_dpo", step_dpo={"pairs_from": "logs", "sites": 10})
    train = {"epochs": 1, "batch_size": 4, "learning_rate": 1e-3, "warmup_ratio": 0.0, "weight_decay": 0.0, "base_model": "m"}
    with pytest.raises(ValidationError, match="its teacher star_gate must be listed before it"):
        TrainStageParams(**train, methods={"star_gate_d": {"algorithm": "star_gate_d"}, "star_gate": {"algorithm": "star_gate"}})
    cfg = TrainStageParams(**train, methods={"d": {"algorithm": "star_gate_d"}}).config_for(MethodParams(algorithm="star_gate_d"))
    assert (cfg.distill.alpha, cfg.distill.temperature, cfg.distill.teacher) == (0.5, 2.0, "star_gate")  # the paper's Table 27


def test_the_qa_preset_is_the_papers_arms_on_three_logging_temperatures():
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    lay_preset(raw, read_preset(ROOT / "bench/presets/refit_swift_qa.yaml"))
    p = Params.model_validate(raw)
    assert p.env.name == "qa_teacher" and "max_turns" not in raw["env"]
    assert (p.collect.m, p.collect.temperatures, p.standardize.weight) == (3, [0.3, 0.7, 1.0], "identity")
    assert {n: m.algorithm for n, m in p.train.methods.items()} == {
        "refit": "refit", "swift": "swift", "star_gate": "star_gate", "star_gate_d": "star_gate_d", "dpo": "dpo", "step_dpo": "step_dpo"}
    assert all(m.data == "all" and m.alpha is None for m in p.train.methods.values())  # no hindsight stage runs: the logs alone
    mix = p.bootstrap.behaviour_mix
    assert mix["expert"] > 0 and mix["wrong"] > 0 and mix["random"] > 0  # good and poor answerers
    assert p.evaluate.splits == ["test"]
