"""relabel, regenerate and label on scripted trajectories: proposals, splicing, lineage, labels."""
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import tiny_params, twenty_questions
from envs.base import fraction_window
from envs.twenty_questions.env import Scripted
from envs.twenty_questions.format import parse_action, render_action
from envs.twenty_questions.kb import load_kb
from envs.twenty_questions.labeler import label_trajectory
from envs.twenty_questions.policies import ExpertPolicy, NoisyPolicy, PlayerView, consistent, only_fits
from envs.twenty_questions.proposer import OracleProposer, justified_guess, same_action, unjustified_guess, worth
from storage.parquet import read_table, write_table
from storage.schema import to_table
from tasks.label import run_label
from tasks.params import Params
from tasks.regenerate import run_regenerate, splice
from tasks.relabel import run_relabel
from tasks.rollout import ScriptedAgent, derive_seed, new_episode, play
from tasks.summarize import run_summarize

KB = load_kb()
TRAIN = KB.split("train")
ENV = twenty_questions(20)
ANIMAL = [("Is it an animal?", "yes")]  # leaves Cat, Dog, Horse, Cow, Rabbit, Lion, Tiger and Bear, in that order


def params(**overrides) -> Params:
    """The tiny preset, with HOPE's 20 turns: the logged games here are played with 20."""
    return Params.model_validate(tiny_params({"env": {"max_turns": 20}, **overrides}))


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> Path:
    """Noisy scripted trajectories (3 per task on 4 train tasks, 1 on a val task) and their summaries."""
    out = tmp_path_factory.mktemp("logged")
    eps = [
        new_episode(twenty_questions(20), task, derive_seed("logged", task.name, k))
        for split, n_tasks, m in (("train", 4, 3), ("val", 1, 1))
        for task in KB.split(split)[:n_tasks]
        for k in range(m)
    ]
    play(eps, ScriptedAgent(lambda rng: Scripted(NoisyPolicy(0.4, 0.2, 0.1))), 0, "logged")
    write_table(to_table([e.to_row() for e in eps], "trajectories"), out / "trajectories.parquet", "trajectories")
    run_summarize(params(), out / "trajectories.parquet", out)
    return out


def test_window_is_half_open_and_hopes_by_default():
    assert fraction_window(10, 0.3, 0.6) == [3, 4, 5]
    assert fraction_window(1, 0.3, 0.6) == []
    assert fraction_window(20, 0.0, 1.0) == list(range(20))
    assert ENV.relabel_turns(20) == list(range(6, 12))  # HOPE 20Q: [0.3T, 0.6T)


def test_same_action_normalises_text_questions_and_guesses():
    assert same_action(KB, "Is it an animal?", "is it an animal")
    assert same_action(KB, "Is it a cat?", "Is it cat?")
    assert not same_action(KB, "Is it a cat?", "Is it a dog?")
    assert not same_action(KB, "Is it an animal?", "Is it a cat?")


def test_proposals_are_actions_the_player_could_justify():
    proposer = OracleProposer(KB)
    secret = KB.split("train")[0]
    view = PlayerView(list(KB.entities), [], 0, 20)
    proposals = proposer.propose(secret, view, 3)
    assert len(proposals) == 3 and len({p.action.question for p in proposals}) == 3
    for p in proposals:
        assert KB.match_question(p.action.question) is not None  # a question, not a guess of the secret
        assert secret.name not in p.action.question and secret.name not in p.action.reason
        assert secret.name in p.rationale  # the hindsight reasoning may use it
    # With one object left, the justified action is to guess it.
    left_one = PlayerView([secret], [], 3, 20)
    (only,) = proposer.propose(secret, left_one, 2)
    assert KB.resolve_guess(only.action.question) == secret


def test_last_turn_guess_is_the_rules_pick_whatever_the_secret():
    # Eight animals fit on the forced last turn: the player guesses the first of them in the
    # candidate list, Cat, whichever animal the secret is; only the rationale knows better.
    proposer = OracleProposer(KB)
    view = PlayerView(TRAIN, ANIMAL, 1, 2)
    assert view.is_final_turn and [e.name for e in consistent(KB, view)][:1] == ["Cat"]
    actions = set()
    for name in ("Tiger", "Bear", "Cat"):
        secret = KB.get(name)
        (p,) = proposer.propose(secret, view, 3)
        actions.add((p.action.reason, p.action.question))
        assert KB.resolve_guess(p.action.question) == KB.get("Cat") == justified_guess(KB, view)
        assert name in p.rationale and ("right" if name == "Cat" else "wrong") in p.rationale
    assert actions == {("Last turn, guess Cat.", "Is it Cat?")}  # the same move for every secret


def test_guess_when_no_unasked_question_splits_the_rest_is_the_rules_pick_too():
    # The answerer said "unknown" to every question that tells Lion from Tiger: no question is
    # left that could, so the player guesses the first of them, Lion, before the last turn.
    lion, tiger = KB.get("Lion"), KB.get("Tiger")
    splitting = [(q.text, "unknown") for q in KB.questions if KB.truth(lion, q) != KB.truth(tiger, q)]
    view = PlayerView([lion, tiger], splitting, len(splitting), 20)
    assert not view.is_final_turn
    for secret in (tiger, lion):
        (p,) = OracleProposer(KB).propose(secret, view, 2)
        assert (p.action.reason, p.action.question) == ("Guess Lion.", "Is it Lion?")


def test_one_object_left_is_guessed_before_the_last_turn():
    secret = KB.get("Lion")
    played = []
    for q in KB.questions:  # answer questions about the Lion until it is the only object left
        played.append((q.text, "yes" if KB.truth(secret, q) else "no"))
        if len(consistent(KB, PlayerView(TRAIN, played, len(played), 20))) == 1:
            break
    view = PlayerView(TRAIN, played, len(played), 20)
    assert not view.is_final_turn and consistent(KB, view) == [secret]
    (p,) = OracleProposer(KB).propose(secret, view, 3)
    assert p.action.question == "Is it Lion?" and p.action.reason.endswith(": only Lion fits.")
    assert p.action.reason == only_fits(KB, played, "Lion")  # the list of what the answers established, as the expert writes it


def test_before_the_last_turn_the_proposer_asks_and_ties_go_in_the_experts_order():
    # After "a vehicle: yes", three questions split the eight vehicles equally well. Which side
    # the secret is on does not order them: every secret gets the expert's order.
    proposer, expert = OracleProposer(KB), ExpertPolicy(KB)
    view = PlayerView(TRAIN, [("Is it a vehicle?", "yes")], 1, 20)
    left = consistent(KB, view)
    tied = expert.best_questions(left, view.history)
    assert len(tied) == 3
    for secret in left:
        proposals = proposer.propose(secret, view, 3)
        assert [KB.match_question(p.action.question) for p in proposals] == tied
        assert proposals[0].action.question == expert.act(view, random.Random(0)).question


def test_the_proposer_only_proposes_what_is_worth_more_than_the_players_action():
    proposer = OracleProposer(KB)
    view = PlayerView(TRAIN, [("Is it a vehicle?", "yes")], 1, 20)
    secret = consistent(KB, view)[0]
    tied = ExpertPolicy(KB).best_questions(consistent(KB, view), view.history)
    # The player asked one of the most informative questions: hindsight has nothing better.
    assert proposer.propose(secret, view, 3, tied[-1].text) == []
    # A question that splits them worse, a repeat, or a guess: every proposal splits them better.
    for played in ("Is it red?", "Is it a vehicle?", f"Is it {secret.name}?"):
        proposals = proposer.propose(secret, view, 3, played)
        assert proposals and all(worth(KB, view, p.action.question) > worth(KB, view, played) for p in proposals)
    # On the forced last turn a guess of any object that fits is as good as the rule's pick.
    last = PlayerView(TRAIN, ANIMAL, 1, 2)
    assert proposer.propose(KB.get("Tiger"), last, 2, "Is it Bear?") == []
    (p,) = proposer.propose(KB.get("Tiger"), last, 2, "Is it red?")
    assert p.action.question == "Is it Cat?"


def test_hr_critique_of_a_last_turn_with_several_objects_left_does_not_name_the_secret():
    # Three turns; the last one asks a question that settles nothing about the animals left.
    # The better last move is a guess, and the guess is the rule's pick (Cat), not the secret.
    played = [*ANIMAL, ("Is it red?", "no"), ("Is it made of paper?", "no")]
    for name in ("Tiger", "Bear"):
        secret = KB.get(name)
        places = OracleProposer(KB).critique(secret, TRAIN, played, 3, 3)
        assert places and all(name not in p.action.question and name not in p.action.reason for _, p, _ in places)
        last = [p for turn, p, _ in places if turn == 2]
        assert [p.action.question for p in last] == ["Is it Cat?"]


def test_a_guess_of_the_secret_is_refused_where_the_answers_do_not_justify_it():
    tiger, cat = KB.get("Tiger"), KB.get("Cat")
    early, last = PlayerView(TRAIN, ANIMAL, 1, 20), PlayerView(TRAIN, ANIMAL, 1, 2)
    assert "8 objects still fit" in unjustified_guess(KB, tiger, early, "Is it Tiger?")
    assert "the player's pick" in unjustified_guess(KB, tiger, last, "Is it a tiger?")
    assert unjustified_guess(KB, cat, last, "Is it Cat?") is None  # the rule's pick happens to be right
    assert unjustified_guess(KB, tiger, early, "Is it Cat?") is None  # a wrong guess does not use the secret
    assert unjustified_guess(KB, tiger, early, "Is it bigger than a person?") is None
    assert unjustified_guess(KB, tiger, PlayerView([tiger], [], 0, 20), "Is it Tiger?") is None  # the only one left


def test_llm_proposer_and_controller_outputs_that_guess_the_secret_early_are_refused():
    tiger, env = KB.get("Tiger"), twenty_questions(20, show_candidates=True)  # the train list: 8 animals
    prefix = [{"action": q, "observation": a} for q, a in ANIMAL]
    parse = env.proposer_request(tiger, prefix, 2, "a summary").parse

    def proposal(question: str) -> str:
        return f'```json\n[{{"teacher_reason": "t", "question": "{question}", "player_reason": "Narrow it down."}}]\n```'

    assert parse(proposal("Is it Cat?"))[0].action == "Is it Cat?"
    assert parse(proposal("Does it have stripes or spots?"))[0].action == "Does it have stripes or spots?"
    with pytest.raises(ValueError, match="proposal 0: the question guesses the secret while 8 objects"):
        parse(proposal("Is it Tiger?"))

    turns = [{"action": q, "observation": a} for q, a in [*ANIMAL, ("Is it red?", "no")]]
    parse = env.controller_request(tiger, turns, 2).parse
    assert parse('1. "Is it red?";colour says little;"Does it have stripes or spots?"/')[0][0] == 1
    with pytest.raises(ValueError, match="place 1: the replacement guesses the secret"):
        parse('1. "Is it red?";the secret is a tiger;"Is it Tiger?"/')
    # At the first turn nothing is known either.
    with pytest.raises(ValueError, match="guesses the secret while 110 objects"):
        parse('1. "Is it an animal?";x;"Is it a tiger?"/')


def test_relabel_hope_counts_and_drops_counterfactuals_equal_to_the_original(logged, tmp_path):
    m = run_relabel(params(), logged / "trajectories.parquet", logged / "summaries.parquet", tmp_path)
    rows = read_table(tmp_path / "relabels.parquet", "relabels").to_pylist()
    trajs = {t["trajectory_id"]: t for t in read_table(logged / "trajectories.parquet").to_pylist()}
    assert m["trajectories_in"] == 12  # the val trajectory is not relabelled (splits: [train])
    assert m["trajectories_relabelled"] == 4 * 2  # k = 2 per task
    assert m["proposed"] == m["relabels"] + m["dropped_equal"]
    assert m["relabels"] == len(rows) > 0
    for r in rows:
        parent = trajs[r["trajectory_id"]]
        assert parent["split"] == "train"
        T = parent["num_turns"]
        assert 0.3 * T <= r["branch_turn"] < 0.6 * T
        assert r["original_action"] == parent["turns"][r["branch_turn"]]["action"]
        assert not same_action(KB, r["original_action"], r["counterfactual_action"])
        assert parse_action(r["counterfactual_text"]).question == r["counterfactual_action"]
    # Reruns are deterministic.
    run_relabel(params(), logged / "trajectories.parquet", logged / "summaries.parquet", tmp_path / "again")
    assert (tmp_path / "relabels.parquet").read_bytes() == (tmp_path / "again/relabels.parquet").read_bytes()


def test_the_oracle_relabels_only_sites_where_a_better_action_exists(tmp_path):
    # The expert's every action is as good as any: no site of its games gets a counterfactual.
    # A noisy player's random questions do, and each counterfactual is worth more than its action.
    def relabel(policy, out):
        eps = [new_episode(twenty_questions(20), t, i) for i, t in enumerate(KB.split("train")[:3])]
        play(eps, ScriptedAgent(lambda rng: Scripted(policy)), 0, policy.name)
        write_table(to_table([e.to_row() for e in eps], "trajectories"), out / "t.parquet", "trajectories")
        run_summarize(params(), out / "t.parquet", out)
        m = run_relabel(params(relabel={"window": [0.0, 1.0], "t": 20, "n": 3}), out / "t.parquet", out / "summaries.parquet", out / "r")
        return m, read_table(out / "r/relabels.parquet", "relabels").to_pylist(), {e.to_row()["trajectory_id"]: e.to_row() for e in eps}

    (tmp_path / "e").mkdir(), (tmp_path / "n").mkdir()
    m, rows, _ = relabel(ExpertPolicy(), tmp_path / "e")
    assert m["timesteps"] > 0 and m["no_better_action"] == m["timesteps"] and rows == [] and m["proposed"] == 0
    m, rows, eps = relabel(NoisyPolicy(p_random=0.5, p_repeat=0.0, p_early_guess=0.0), tmp_path / "n")
    assert rows and 0 < m["no_better_action"] < m["timesteps"] and m["proposed"] == len(rows)
    env = twenty_questions(20)
    for r in rows:
        view = env.view(env.task(r["task_id"]), eps[r["trajectory_id"]]["turns"][: r["branch_turn"]])
        assert worth(KB, view, r["counterfactual_action"]) > worth(KB, view, r["original_action"])


def test_relabel_hr_gives_at_most_one_suggestion_per_dialogue(logged, tmp_path):
    m = run_relabel(params(relabel={"mode": "hr"}), logged / "trajectories.parquet", logged / "summaries.parquet", tmp_path)
    rows = read_table(tmp_path / "relabels.parquet", "relabels").to_pylist()
    assert m["trajectories_relabelled"] == 12
    assert len({r["trajectory_id"] for r in rows}) == len(rows) == m["relabels"]
    assert m["relabels"] + m["no_place_to_improve"] + m["dropped_equal"] == 12
    assert all(r["mode"] == "hr" for r in rows)


def test_relabel_hr_suggestions_are_distinct_places_among_those_named(logged, tmp_path):
    one = run_relabel(params(relabel={"mode": "hr"}), logged / "trajectories.parquet", logged / "summaries.parquet", tmp_path / "one")
    single = read_table(tmp_path / "one/relabels.parquet", "relabels").to_pylist()
    m = run_relabel(params(relabel={"mode": "hr", "hr_suggestions": 3}), logged / "trajectories.parquet", logged / "summaries.parquet", tmp_path / "three")
    rows = read_table(tmp_path / "three/relabels.parquet", "relabels").to_pylist()
    env = twenty_questions(20)
    parents = {t["trajectory_id"]: t for t in read_table(logged / "trajectories.parquet").to_pylist()}
    by_dialogue: dict[str, list] = {}
    for r in rows:
        by_dialogue.setdefault(r["trajectory_id"], []).append(r)
    assert m["relabels"] == len(rows) > one["relabels"] and max(map(len, by_dialogue.values())) > 1
    for tid, group in by_dialogue.items():
        named = [turn for turn, _ in env.critique(env.task(group[0]["task_id"]), parents[tid]["turns"], 3)]
        turns = [r["branch_turn"] for r in group]
        assert len(set(turns)) == len(turns) <= 3 and set(turns) <= set(named)
        assert sorted(r["rank"] for r in group) == list(range(len(group)))
    with pytest.raises(ValueError, match="hr_suggestions"):
        params(relabel={"mode": "hr", "hr_suggestions": 4})
    assert len({r["trajectory_id"] for r in single}) == len(single)


def test_splice_keeps_the_prefix_and_branches_at_the_right_turn(logged, tmp_path):
    run_relabel(params(), logged / "trajectories.parquet", logged / "summaries.parquet", tmp_path)
    relabels = read_table(tmp_path / "relabels.parquet", "relabels").to_pylist()
    parents = {t["trajectory_id"]: t for t in read_table(logged / "trajectories.parquet").to_pylist()}
    for r in relabels:
        parent, j = parents[r["trajectory_id"]], r["branch_turn"]
        ep = splice(params(), parent, r)
        assert ep.messages[: 2 + 2 * j] == parent["messages"][: 2 + 2 * j]
        assert ep.turns[:j] == parent["turns"][:j]
        assert ep.messages[2 + 2 * j] == {"role": "assistant", "content": r["counterfactual_text"]}
        assert ep.turns[j]["action"] == r["counterfactual_action"] and len(ep.turns) == j + 1
        # The branch action was answered by the environment from the restored state.
        assert ep.game.turn == j + 1 and ep.game.state.history[:j] == [(t["action"], t["observation"]) for t in parent["turns"][:j]]
        # The counterfactual is consistent with the candidates the prefix left.
        view = PlayerView(list(KB.entities), ep.game.state.history[:j], j, 20)
        guess = KB.resolve_guess(r["counterfactual_action"])
        assert guess is None or guess in consistent(KB, view)


def test_regenerations_trace_to_their_parent_and_relabel_and_get_labelled(logged, tmp_path, tiny_model_dir):
    p = params()
    run_relabel(p, logged / "trajectories.parquet", logged / "summaries.parquet", tmp_path / "relabel")
    m = run_regenerate(p, logged / "trajectories.parquet", tmp_path / "relabel/relabels.parquet", tiny_model_dir, tmp_path / "regen")
    regens = read_table(tmp_path / "regen/trajectories.parquet", "trajectories").to_pylist()
    relabels = {r["relabel_id"]: r for r in read_table(tmp_path / "relabel/relabels.parquet").to_pylist()}
    parents = {t["trajectory_id"]: t for t in read_table(logged / "trajectories.parquet").to_pylist()}
    assert m["regenerations"] == len(regens) == len(relabels)
    for t in regens:
        assert t["source"] == "regeneration"
        r = relabels[t["relabel_id"]]
        assert t["parent_id"] == r["trajectory_id"] and t["parent_id"] in parents
        assert t["branch_turn"] == r["branch_turn"]
        assert t["messages"][: 2 + 2 * t["branch_turn"]] == parents[t["parent_id"]]["messages"][: 2 + 2 * t["branch_turn"]]
        assert t["turns"][t["branch_turn"]]["action"] == r["counterfactual_action"]
    assert len({t["relabel_id"] for t in regens}) == len(regens)

    lm = run_label(p, [logged / "trajectories.parquet", tmp_path / "regen/trajectories.parquet"], tmp_path / "label")
    labels = read_table(tmp_path / "label/labels.parquet", "labels").to_pylist()
    assert lm["labels"] == len(parents) + len(regens) and lm["status"] == {"ok": len(labels)}
    assert lm["logged_return_mismatches"] == 0
    for lab in labels:
        assert lab["reward"] == lab["env_reward"] and lab["labeler"] == "oracle"


def test_oracle_labeler_replays_and_says_why_it_cannot_label():
    secret = KB.split("train")[0]
    ok = label_trajectory(KB, secret.name, ["Is it an animal?", f"Is it {secret.name}?"], 20)
    assert ok.reward == -1.0 and ok.success
    short = label_trajectory(KB, secret.name, ["Is it an animal?"], 20)
    assert short.reward is None and "before the game ends" in short.reason
    assert label_trajectory(KB, "no such thing", [], 20).reward is None
    over = label_trajectory(KB, secret.name, [f"Is it {secret.name}?", "Is it an animal?"], 20)
    assert over.reward is None and "ended at turn 1" in over.reason


def test_label_reports_a_logged_return_that_disagrees_with_the_replay(logged, tmp_path):
    rows = read_table(logged / "trajectories.parquet").to_pylist()[:2]
    rows[0]["return"] = rows[0]["return"] - 5
    write_table(to_table(rows, "trajectories"), tmp_path / "t.parquet", "trajectories")
    m = run_label(params(), [tmp_path / "t.parquet"], tmp_path / "out")
    assert m["logged_return_mismatches"] == 1
    lab = {r["trajectory_id"]: r for r in pq.read_table(tmp_path / "out/labels.parquet").to_pylist()}
    first = lab[rows[0]["trajectory_id"]]
    assert first["reward"] == first["env_reward"] + 5 and "logged return" in first["reason"]


def test_forward_model_continuation_must_end_the_game_at_its_last_line(logged, tmp_path):
    p = params()
    run_relabel(p, logged / "trajectories.parquet", logged / "summaries.parquet", tmp_path)
    r = next(r for r in read_table(tmp_path / "relabels.parquet").to_pylist() if r["status"] == "ok")
    parent = next(t for t in read_table(logged / "trajectories.parquet").to_pylist() if t["trajectory_id"] == r["trajectory_id"])
    ep = splice(p, parent, r)
    assert not ep.done
    k, secret, other = len(ep.turns) + 1, ep.task.name, next(e.name for e in KB.entities if e != ep.task)
    forward = ENV.forward_request(ep.game).parse

    def parse(text: str) -> list[tuple[str, str]]:
        return [(parse_action(t).question, a.text) for t, a in forward(text)]

    # The expert player's continuation: questions until only the secret fits, then the guess.
    played, pairs = list(ep.game.state.history), []
    while not pairs or KB.resolve_guess(pairs[-1][0]) != ep.task:
        action = ExpertPolicy(KB).act(PlayerView(ep.game.candidates, played, len(played), 20), random.Random(0))
        q = KB.match_question(action.question)
        pairs.append((action.question, "yes" if q is None or KB.truth(ep.task, q) else "no"))
        played.append(pairs[-1])
    lines = "\n".join(f"Q{k + i}: {q}\nA{k + i}: {a}" for i, (q, a) in enumerate(pairs))
    assert len(pairs) > 1 and parse(lines) == pairs
    assert forward(lines)[0][0] == render_action("", pairs[0][0])  # HR's utterance alone: an empty reason
    with pytest.raises(ValueError, match="before the game ends"):
        parse(f"Q{k}: Is it {other}?\nA{k}: no")
    with pytest.raises(ValueError, match="before the game ends"):
        parse(f"Q{k}: Is it {other}?\nA{k}: yes")  # a yes to the wrong object is no win
    with pytest.raises(ValueError, match="after the game ended"):
        parse(lines + f"\nQ{k + len(pairs)}: Is it red?\nA{k + len(pairs)}: no")
    # The forward model knows the secret; its player does not, and may not guess it early.
    with pytest.raises(ValueError, match=f"Q{k} guesses the secret while"):
        parse(f"Q{k}: Is it {secret}?\nA{k}: yes")
    # Running out of questions also ends the game.
    last = "\n".join(f"Q{i}: Is it {other}?\nA{i}: no" for i in range(k, 21))
    assert len(parse(last)) == 21 - k


def test_llm_forward_model_lists_the_games_it_could_not_complete(logged, tmp_path, tiny_model_dir):
    llm = {"backend": "hf", "model": str(tiny_model_dir), "sampling": {"max_new_tokens": 16}, "parse_attempts": 1, "max_failure_rate": 1.0}
    p = params(roles={"forward": llm})
    run_relabel(p, logged / "trajectories.parquet", logged / "summaries.parquet", tmp_path / "relabel")
    m = run_regenerate(p, logged / "trajectories.parquet", tmp_path / "relabel/relabels.parquet", tiny_model_dir, tmp_path / "regen")
    regens = read_table(tmp_path / "regen/trajectories.parquet", "trajectories").to_pylist()
    calls = m["forward_calls"]
    assert m["relabels"] == m["ended_at_branch"] + calls["requests"]
    assert m["regenerations"] == len(regens) == m["ended_at_branch"] + calls["ok"]
    assert len(m["forward_failures"]) == calls["invalid"] + calls["failed"] and all(f["reason"] for f in m["forward_failures"])
