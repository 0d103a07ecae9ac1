"""Persuasion (HR's donation setting): donor profiles and splits, the strategy rule set, the
oracle donor per persona on hand-made dialogues, the game's shape, the labelers (oracle and
HR's two-step LLM labeler), the LLM roles' parsers, the scripted persuaders and a chain of stages."""
import dataclasses
import statistics
from collections import Counter

import pytest

from envs import registry
from envs.persuasion import llm_roles
from envs.persuasion.donor import DonorReply, read_observation
from envs.persuasion.donors import SIZES, load_donors, make_donor
from envs.persuasion.game import Conversation
from envs.persuasion.roles import decision_in_words
from envs.persuasion.strategies import asked_amount, recognise
from tasks.rollout import ScriptedAgent, new_episode, play

NOISE = {"p_random": 0.15, "p_repeat": 0.10, "p_early_guess": 0.10}


@pytest.fixture(scope="module")
def env():
    return registry.make("persuasion", {})


def donor(persona, **traits):
    """A donor of `persona` with chosen traits (the rest drawn as for donor-test-000)."""
    base = make_donor("test", 0, persona)
    return dataclasses.replace(base, **{"has_children": False, "knows_charity": True, **traits})


def talk(d, messages, max_turns=10):
    c = Conversation(d, max_turns)
    replies = []
    for m in messages:
        if c.done:
            break
        replies.append(c.step(m)[0])
    return c, replies


# ---- tasks and splits ----

def test_splits_follow_hrs_persona_mix_and_are_deterministic(env):
    assert env.splits == ("train", "val", "test")
    for split in env.splits:
        tasks = env.tasks(split)
        assert len(tasks) == SIZES[split] and all(t.split == split and t.id.startswith(f"donor-{split}-") for t in tasks)
        counts = Counter(t.persona for t in tasks)
        if split != "train":
            assert set(counts.values()) == {SIZES[split] // 4}  # half unfriendly or skeptical
    train = Counter(t.persona for t in env.tasks("train"))
    assert train["unfriendly"] + train["skeptical"] < SIZES["train"] / 2  # logged data leans receptive
    assert make_donor("val", 3, "skeptical") == make_donor("val", 3, "skeptical")
    assert [t.id for t in env.tasks("test")] == [t.id for t in registry.make("persuasion", {}).tasks("test")]
    assert all(t.concern for t in env.tasks("test") if t.persona == "skeptical")
    assert env.task("donor-test-000") == load_donors()["donor-test-000"]
    with pytest.raises(KeyError, match="unknown persuasion donor 'nobody'"):
        env.task("nobody")


# ---- the rule set ----

@pytest.mark.parametrize("text, strategies, amount", [
    ("Hello! Have you heard of Save the Children?", {"greeting", "inquiry"}, None),
    ("About 87% of every dollar goes directly to programs.", {"credibility", "logic"}, None),
    ("Just $1 provides a meal for a child.", {"logic"}, None),  # an amount in an argument is no ask
    ("Imagine a hungry child, alone and afraid.", {"emotion"}, None),
    ("I met a girl named Amina last year.", {"story"}, None),
    ("Would you consider donating $1 today?", {"ask"}, 1.0),
    ("How about starting with 50 cents?", {"ask"}, 0.5),
    ("How much would you like to give?", {"ask"}, None),
    ("Come on, you should give $2 right now.", {"ask", "pressure"}, 2.0),
])
def test_the_rule_set_recognises_strategies_and_asked_amounts(text, strategies, amount):
    r = recognise(text)
    assert set(r.strategies) == strategies and r.amount == amount


def test_an_amount_outside_the_asking_sentence_is_not_the_ask():
    assert asked_amount("$2 buys school supplies for a month. Would you give $0.50?") == 0.5
    assert recognise("$2 buys school supplies. Would you like to help?").amount is None


# ---- the oracle donor per persona ----

OPENING = "Hello! Have you heard of Save the Children?"
CASE = ["Hello! Have you heard of Save the Children?",
        "Save the Children was founded in 1919 and is a registered charity with a long track record.",
        "Just $1 provides a nutritious meal for a child in need.",
        "Would you consider donating $1 of your payment today?"]
TEARS = ["Hello! Have you heard of Save the Children?", "Imagine a child going to bed hungry, with no one to turn to.",
         "I met a girl named Amina who can now go to school thanks to donors like you.", "Would you consider donating $1 of your payment today?"]
PUSH = ["Would you donate the full $2 today?", "Come on, you should donate $2 right now."]


def test_the_same_dialogue_earns_more_from_receptive_personas():
    got = {p: talk(donor(p, willingness=w, cap=c), CASE)[0].donation or 0.0 for p, w, c in
           [("philanthropic", 0.55, 2.0), ("caring", 0.37, 2.0), ("skeptical", 0.17, 1.5), ("unfriendly", 0.07, 1.0)]}
    assert got["philanthropic"] >= 1.25 and got["philanthropic"] > got["caring"] > got["skeptical"] > got["unfriendly"]


def test_stories_and_feelings_move_a_caring_donor_and_put_off_the_others():
    caring, replies = talk(donor("caring", willingness=0.37, cap=2.0, has_children=True), TEARS)
    assert caring.donation >= 1.25 and caring.ended_by_donor and f"${caring.donation:.2f}" in replies[-1].text
    skeptic, replies = talk(donor("skeptical", willingness=0.17, cap=1.5, concern="scam"), TEARS)
    assert "Sad stories don't tell me where the money goes." in replies[1].text
    assert skeptic.donation is None and skeptic.state.refusals == 1  # not convinced, asked too early


def test_answering_a_skeptics_concern_is_what_convinces_it():
    msgs = lambda line: [OPENING, line, "Last year donors helped over a million children get food and medicine.", "Would you consider donating $1 of your payment today?"]  # noqa: E731
    d = donor("skeptical", willingness=0.17, cap=1.5, concern="overhead")
    first, replies = talk(d, [OPENING])
    assert "How much of the money actually reaches the children?" in replies[0].text and first.state.concern_voiced
    answered = talk(d, msgs("About 87% of every dollar donated goes directly to programs for children, and its financial reports are audited every year."))[0]
    other = talk(d, msgs("Save the Children was founded in 1919 and is a registered charity with a long track record."))[0]
    assert answered.state.concern_answered and not other.state.concern_answered
    assert answered.donation > (other.donation or 0)


def test_pressure_backfires_on_the_unfriendly_and_the_skeptical():
    for p, w, cap in [("unfriendly", 0.10, 1.5), ("skeptical", 0.20, 1.5)]:
        c, replies = talk(donor(p, willingness=w, cap=cap), PUSH + PUSH)
        assert c.donation == 0.0 and c.ended_by_donor and "I won't donate anything" in replies[-1].text
    warm, _ = talk(donor("philanthropic", willingness=0.9, cap=2.0), PUSH)
    assert warm.donation in (1.5, 1.75, 2.0)  # a warm donor can meet a big ask (or counter it)


def test_asks_a_donor_cannot_meet_are_refused_or_countered():
    c, replies = talk(donor("caring", willingness=0.75, cap=2.0), ["Would you donate the full $2 today?"])
    assert c.donation == 1.5 and "$2.00 is more than I'd like to give, but I'll donate $1.50." in replies[0].text  # offer $1.50, within $0.50: counter
    c, replies = talk(donor("caring", willingness=0.55, cap=2.0), ["Would you donate the full $2 today?"])
    assert c.donation is None and "$2.00? That's way too much." in replies[0].text


def test_when_the_turns_run_out_the_donor_must_decide():
    d = donor("philanthropic", willingness=0.55, cap=2.0)
    never_asked, replies = talk(d, [OPENING, CASE[1], CASE[2]], max_turns=3)
    asked, _ = talk(d, [OPENING, "Would you donate the full $2 today? Come on, surely you can spare $2.", CASE[2]], max_turns=3)
    assert never_asked.done and not never_asked.ended_by_donor and replies[-1].donation == never_asked.donation
    assert "I've thought about it" in replies[-1].text and never_asked.donation == 0.5  # half its $1.25 offer, floored: never asked
    assert asked.donation is not None and asked.state.asked == 1


def test_the_donor_is_deterministic_and_seeded_per_donor():
    d = load_donors()["donor-val-005"]
    assert talk(d, TEARS)[1] == talk(d, TEARS)[1]
    others = [x for x in load_donors().values() if x.persona == d.persona and x.id != d.id][:5]
    assert len({talk(x, TEARS)[1][0].text for x in [d, *others]} | {talk(x, TEARS)[0].state.willingness for x in [d, *others]}) > 2


# ---- the game ----

def test_the_game_steps_in_gymnasiums_shape_and_survives_malformed_actions(env):
    game = env.game(env.task("donor-test-000"))
    opening, _ = game.reset()
    assert [m["role"] for m in opening] == ["system", "user"] and "REASON:" in opening[0]["content"]
    willingness = game.state.state.willingness
    for bad, why in [("just talking", "missing 'REASON:'"), ("REASON: hm", "missing 'MESSAGE:'"), ("REASON: x\nMESSAGE:   ", "empty message")]:
        step = game.step(bad)
        assert (step.reward, step.terminated, step.truncated, step.info["parsed"]) == (0.0, False, False, False)
        assert step.info["turn"]["observation"].startswith(f"Invalid action ({why}") and "the donor heard nothing" in step.observation[0]["content"]
    assert game.state.state.willingness == willingness and game.turn == 3
    step = game.step(env.render_action("Ask.", "Would you consider donating $1 of your payment today?"))
    assert step.terminated and not step.truncated and step.reward == game.state.donation > 0 and step.info["success"]
    assert step.observation[0]["content"].endswith(f"The conversation is over: the donor gives ${step.reward:.2f}.")
    short = registry.make("persuasion", {"max_turns": 2})
    g = short.game(short.task("donor-test-001"))
    assert g.step(short.render_action("", "Hello!")).reward == 0.0
    last = g.step("not the format")  # an invalid last action: the donor still decides
    assert last.truncated and not last.terminated and g.done and read_observation(last.info["turn"]["observation"]).donation is not None
    assert env.reward_range == (0.0, 2.0) and env.won(0.25) and not env.won(0.0)
    with pytest.raises(ValueError, match="max_turns"):
        registry.make("persuasion", {"max_turns": 0})
    with pytest.raises(ValueError, match="extra"):
        registry.make("persuasion", {"show_candidates": True})


def test_restore_rebuilds_the_donor_and_keeps_the_logged_replies(env):
    row = _episode(env, "donor-train-003", "expert", 1)
    game = env.game(env.task(row["task_id"]))
    game.restore(row["turns"][:2])
    fresh = Conversation(env.task(row["task_id"]))
    for t in row["turns"][:2]:
        fresh.step(t["action"])
    assert game.state.state == fresh.state and game.turn == 2
    with pytest.raises(ValueError, match="ends the conversation"):
        env.game(env.task(row["task_id"])).restore(row["turns"])
    assert env.relabel_turns(5) == [1, 2, 3, 4] and env.relabel_turns(1) == [0]


# ---- labelers ----

MENTIONS = [  # the persuader and the donor both name $2, which is never given
    {"action": "Would you donate the full $2 today?", "observation": "$2.00? That's way too much."},
    {"action": "Even $2 would change a child's week. Will you give it?",
     "observation": "I said $2 is too much, and I won't donate anything.\nDecision: no donation"},
]


def test_the_oracle_labeler_reads_the_decision_not_an_amount_mentioned(env):
    for seed, name in enumerate(("expert", "noisy", "random")):
        row = _episode(env, "donor-test-002", name, seed)
        assert env.label(row["task_id"], row["turns"]).reward == row["return"]
    label = env.label("donor-test-002", MENTIONS)
    assert (label.reward, label.success) == (0.0, False)
    words_only = [MENTIONS[0], {**MENTIONS[1], "observation": "I said $2 is too much, and I won't donate anything."}]
    assert env.label("donor-test-002", words_only).reward == 0.0
    unfinished = env.label("donor-test-002", MENTIONS[:1])
    assert unfinished.reward is None and unfinished.reason.startswith("unfinished")
    assert env.label("nobody", MENTIONS).reward is None
    assert env.label("donor-test-002", MENTIONS[1:] + MENTIONS[1:]).reward is None  # decided, then went on
    countered = [{"action": "Would you donate $2?", "observation": "$2.00 is more than I'd like to give, but I'll donate $1.00."}]
    assert env.label("donor-test-002", countered).reward == 1.0


@pytest.mark.parametrize("words, amount", [
    ("Okay, I'll donate $1.50.", 1.5),
    ("$2.00 is more than I'd like to give, but I'll donate $1.00.", 1.0),
    ("$2.00? That's way too much.", None),
    ("I won't donate $2.", 0.0),
    ("Will I give $1? Let me think.", None),
    ("I can't give $2, but let me give $0.50.", 0.5),
])
def test_decisions_in_words(words, amount):
    assert decision_in_words(words) == amount


def test_the_llm_labeler_is_hrs_two_steps(env):
    finished = _episode(env, "donor-test-004", "expert", 0)
    examples = [(finished["turns"], finished["return"]), (MENTIONS, 0.0)]
    req = env.labeler_request(MENTIONS, examples)
    prompt = req.messages[1]["content"]
    assert "accountant" in req.messages[0]["content"] and "Unfinished: Yes" in prompt and "Unfinished: No" in prompt and "Final Donation Amount: 0.0" in prompt
    assert "Decision:" not in prompt  # the labeler reads the donation from the donor's words
    assert req.parse("Unfinished: no\nFinal Donation Amount: 1.5") == 1.5
    assert req.parse("The worker asked for $2 and the donor refused it.\nUnfinished: no\nFinal Donation Amount: 0.0") == 0.0
    with pytest.raises(llm_roles.Unfinished):
        req.parse("Unfinished: yes")
    for bad, why in [("Final Donation Amount: 1", "Unfinished"), ("Unfinished: no\nFinal Donation Amount: 3", "outside"),
                     ("Unfinished: no\nFinal Donation Amount: 1\nFinal Donation Amount: 2", "2 'Final Donation Amount:' lines")]:
        with pytest.raises(ValueError, match=why):
            req.parse(bad)
    step1 = env.finished_request(MENTIONS[:1], examples)
    assert step1.parse("Unfinished: yes") is False and step1.parse("No") is True
    step2 = env.amount_request(MENTIONS, examples)
    assert "Unfinished" not in step2.messages[1]["content"] and step2.parse("Final Donation Amount: $0.75") == 0.75


# ---- the other LLM roles ----

def test_llm_donor_request_and_parser(env):
    game = env.game(env.task("donor-test-005"))
    game.reset()
    req = game.simulator_request(env.render_action("", "Hello!"))
    assert "Who you are:" in req.messages[0]["content"] and "The worker's latest message: Hello!" in req.messages[1]["content"]
    reply = req.parse("REASON: friendly.\nRESPONSE: Hi there, I'll donate $1.\nDECISION: donate $1")
    assert reply == DonorReply("Hi there, I'll donate $1.", 1.0, "friendly.")
    assert req.parse("REASON: r\nRESPONSE: Go on.\nDECISION: none").donation is None
    assert req.parse("REASON: r\nRESPONSE: No.\nDECISION: no donation").donation == 0.0
    for bad, why in [("RESPONSE: hi", "expected REASON"), ("REASON: r\nRESPONSE: ok\nDECISION: maybe", "DECISION is not"),
                     ("REASON: r\nRESPONSE: ok\nDECISION: donate $5", "outside")]:
        with pytest.raises(ValueError, match=why):
            req.parse(bad)
    assert game.simulator_request("no format") is None  # nothing was said: the rules answer
    step = game.step(env.render_action("", "Hello!"), reply)
    assert step.terminated and step.reward == 1.0 and step.info["turn"]["observation"] == "Hi there, I'll donate $1.\nDecision: donate $1.00"


def test_llm_controller_forward_proposer_judge_and_summary(env):
    d = env.task("donor-test-006")
    row = _episode(env, d.id, "noisy", 3)
    said = row["turns"][1]["action"]
    ctl = env.controller_request(d, row["turns"], 2)
    (place,) = ctl.parse(f'1. "AI: {said}";too vague;"AI: Just $1 provides a nutritious meal for a child in need."/')
    assert place[0] == 1 and place[1].action == "Just $1 provides a nutritious meal for a child in need."
    with pytest.raises(ValueError, match="never said"):
        ctl.parse('1. "I never said this";c;"x"/')
    with pytest.raises(ValueError, match="hidden profile"):
        ctl.parse(f'1. "{said}";c;"I know you are skeptical, so here are facts."')
    game = env.game(d)
    game.restore(row["turns"][:1])
    fwd = env.forward_request(game)
    pairs = fwd.parse("AI: Would you give $1?\nH: Fine, I'll give $1.\nDecision: donate $1")
    assert [p[1] for p in pairs] == [DonorReply("Fine, I'll give $1.", 1.0)]
    game.step(*pairs[0])
    assert game.done and game.state.donation == 1.0 and game.turn == 2
    with pytest.raises(ValueError, match="before the donor decides"):
        fwd.parse("AI: Hi again.\nH: Hello.")
    with pytest.raises(ValueError, match="after the donor decided"):
        fwd.parse("AI: Give $1?\nH: Yes.\nDecision: donate $1\nAI: Thanks!\nH: Bye.")
    prop = env.proposer_request(d, row["turns"][:2], 1, "The donor was skeptical.")
    (cf,) = prop.parse('```json\n[{"teacher_reason": "t", "message": "Charity Navigator rates us four stars.", "persuader_reason": "They want proof."}]\n```')
    assert cf.text == env.render_action("They want proof.", "Charity Navigator rates us four stars.") and cf.rationale == "t"
    assert prop.parse(env.proposer_reply([cf])) == [cf]
    with pytest.raises(ValueError, match="children"):
        env.proposer_request(d, [], 1, "s").parse('[{"teacher_reason": "t", "message": "Think of your own kids.", "persuader_reason": "r"}]')
    scores = env.judge_request(d.id, row["turns"]).parse("Rapport: 7\nAdaptation: 5\nArguments: 6\nRespect: 9\nOutcome: 4\nOverall: 6")
    assert scores["Overall"] == 6
    summary = env.summary_request(d, row["turns"], row["success"])
    assert "## Outcome" in summary.messages[1]["content"] and summary.parse("The donor was wary; the worker asked too early.")
    assert all(len(env.prompt_hash(r)) == 12 for r in ("simulator", "summarizer", "proposer", "controller", "forward", "labeler", "judge"))


# ---- oracle roles ----

def test_the_proposer_and_controller_use_hindsight_but_say_only_what_a_persuader_could(env):
    d = env.task("donor-test-006")
    row = _episode(env, d.id, "pushy", 0)
    cfs = env.propose(d, row["turns"][:1], 3)
    assert len(cfs) == 3 and len({cf.action for cf in cfs}) == 3 and d.persona in cfs[0].rationale
    assert all(llm_roles.leak(cf.action, "") is None and llm_roles.leak(cf.reason, "") is None for cf in cfs)
    places = env.critique(d, row["turns"], 2)
    assert places and all(not env.same_action(row["turns"][k]["action"], cf.action) for k, cf in places)
    text = env.summarize(d, row["turns"], row["success"])
    assert text.startswith(f"The donor was {d.persona}") and "pressure" in text


# ---- scripted persuaders ----

def _episode(env, task_id, policy, seed):
    ep = new_episode(env, env.task(task_id), seed)
    play([ep], ScriptedAgent(lambda rng: env.policies(NOISE)[policy]), seed, "test")
    return ep.to_row()


def test_scripted_persuaders_rank_expert_noisy_random_pushy_and_replay(env):
    means = {}
    for name in ("expert", "noisy", "random", "pushy"):
        eps = [new_episode(env, t, k) for k, t in enumerate(env.tasks("test"))]
        play(eps, ScriptedAgent(lambda rng, n=name: env.policies(NOISE)[n]), 0, name)
        assert all(e.parse_failures == 0 and e.done for e in eps)
        means[name] = statistics.mean(e.to_row()["return"] for e in eps)
    assert means["expert"] > means["noisy"] > means["random"] > means["pushy"]
    assert _episode(env, "donor-test-007", "noisy", 5) == _episode(env, "donor-test-007", "noisy", 5)
    with pytest.raises(ValueError, match="noise probabilities"):
        env.policies({"p_random": 0.8, "p_repeat": 0.3, "p_early_guess": 0.0})


# ---- the real stages with env.name: persuasion ----

@pytest.mark.parametrize("mode", ["hope", "hr"])
def test_scripted_dialogues_go_through_the_hindsight_stages(tmp_path, tiny_model_dir, mode):
    """summarize, relabel (HOPE's proposer or HR's controller), regenerate with a model, label and
    standardize on persuasion with its oracle roles: every row passes the checks."""
    from conftest import tiny_params
    from storage.parquet import read_table, write_table
    from storage.schema import from_table, to_table
    from storage.validate import read_checked
    from tasks.bootstrap import demonstrations
    from tasks.label import run_label
    from tasks.params import Params
    from tasks.regenerate import run_regenerate
    from tasks.relabel import run_relabel
    from tasks.standardize import run_standardize
    from tasks.summarize import run_summarize

    raw = tiny_params({"bootstrap": {"demos_per_task": 1, "limit_tasks": 3,
                                     "behaviour_mix": {"expert": 0.4, "noisy": 0.3, "random": 0.3}},
                       "relabel": {"mode": mode}})
    raw["env"] = {"name": "persuasion", "max_turns": 6}
    p = Params.model_validate(raw)
    demos = demonstrations(p)
    write_table(to_table([e.to_row() for e in demos], "trajectories"), tmp_path / "trajectories.parquet", "trajectories")
    logged = {r["trajectory_id"]: r for r in from_table(read_table(tmp_path / "trajectories.parquet"))}
    n = len(logged)
    assert n == 3 and all(r["env"] == "persuasion" for r in logged.values())

    assert run_summarize(p, tmp_path / "trajectories.parquet", tmp_path)["summaries"] == n
    m = run_relabel(p, tmp_path / "trajectories.parquet", tmp_path / "summaries.parquet", tmp_path / "relabel")
    relabels = read_table(tmp_path / "relabel/relabels.parquet").to_pylist()
    assert m["relabels"] == len(relabels) > 0 and all(r["mode"] == mode for r in relabels)
    run_regenerate(p, tmp_path / "trajectories.parquet", tmp_path / "relabel/relabels.parquet", tiny_model_dir, tmp_path / "regen")
    kept, quarantine = read_checked(tmp_path / "regen/trajectories.parquet", "trajectories")
    regens = from_table(kept)
    assert quarantine.num_rows == 0 and len(regens) == len(relabels)
    for g in regens:
        assert g["turns"][: g["branch_turn"]] == logged[g["parent_id"]]["turns"][: g["branch_turn"]]
    labels = run_label(p, [tmp_path / "trajectories.parquet", tmp_path / "regen/trajectories.parquet"], tmp_path / "label")
    assert labels["labels"] == n + len(regens) and labels["logged_return_mismatches"] == 0 and labels["status"] == {"ok": n + len(regens)}
    run_standardize(p, [tmp_path / "trajectories.parquet", tmp_path / "regen/trajectories.parquet"], tmp_path / "label/labels.parquet", tmp_path / "std")
    kept, quarantine = read_checked(tmp_path / "std/export/train.parquet", "export")
    assert quarantine.num_rows == 0 and kept.num_rows == n + len(regens)
    assert "Save the Children" in str(kept.to_pylist()[0]["messages"])


# ---- HR's two-step labeler in the label stage ----

class Keyed:
    """A model answering from a table keyed by the prompt's last message, counting its calls."""

    backend, model_id = "openai", "keyed"

    def __init__(self, answers: dict[str, str]):
        self.answers, self.calls = answers, []

    def generate(self, convs, sampling, seeds):
        from models.base import Completion

        self.calls += [c[-1]["content"] for c in convs]
        return [Completion(self.answers.get(c[-1]["content"], "I cannot tell.")) for c in convs]


def test_the_label_stage_asks_step_two_only_of_finished_dialogues_and_records_unfinished(env, tmp_path, monkeypatch):
    """Step 1 for every dialogue; step 2 only where step 1 said finished. "Unfinished: yes" is its
    own status, without a reward and without being asked again; an unreadable step 1 is invalid."""
    from conftest import tiny_params
    from storage.parquet import read_table, write_table
    from storage.schema import to_table
    from tasks import label as label_stage
    from tasks.params import Params

    rows = [_episode(env, "donor-test-002", "expert", 0), _episode(env, "donor-test-003", "noisy", 1), _episode(env, "donor-test-004", "random", 2)]
    from storage.schema import trajectory_id
    from tasks.rollout import turn_start

    cut = rows[1]  # cut before the decision: the labeler's unfinished
    rows[1] = {**cut, "turns": cut["turns"][:-1], "messages": cut["messages"][: turn_start(cut["messages"], cut["num_turns"] - 1)],
               "num_turns": cut["num_turns"] - 1, "return": 0.0, "success": False}
    rows[1]["trajectory_id"] = trajectory_id(rows[1])
    write_table(to_table(rows, "trajectories"), tmp_path / "trajectories.parquet", "trajectories")
    step1 = [env.finished_request(r["turns"], []).messages[-1]["content"] for r in rows]
    step2 = [env.amount_request(r["turns"], []).messages[-1]["content"] for r in rows]
    model = Keyed({step1[0]: "Unfinished: no", step2[0]: "Final Donation Amount: 1.25", step1[1]: "Unfinished: yes",
                   step1[2]: "Maybe?", step2[2]: "Final Donation Amount: 2"})
    monkeypatch.setattr(label_stage, "make_generator", lambda role, cache: model)
    llm = {"backend": "openai", "model": "m", "base_url": "http://127.0.0.1:1/v1", "few_shot": 0, "parse_attempts": 2, "max_failure_rate": 0.5}
    p = Params.model_validate({**tiny_params({"roles": {"labeler": llm}}), "env": {"name": "persuasion"}})
    m = label_stage.run_label(p, [tmp_path / "trajectories.parquet"], tmp_path / "label")
    got = {r["task_id"]: r for r in read_table(tmp_path / "label/labels.parquet").to_pylist()}
    finished, unfinished, unread = (got[r["task_id"]] for r in rows)
    assert (finished["status"], finished["reward"]) == ("ok", 1.25)
    assert (unfinished["status"], unfinished["reward"]) == ("unfinished", None) and "unfinished" in unfinished["reason"]
    assert (unread["status"], unread["reward"]) == ("invalid", None) and "Unfinished: yes|no" in unread["reason"]
    # Step 2 was asked once, of the finished dialogue; step 1 of the unfinished one once (not again).
    assert model.calls.count(step2[0]) == 1 and step2[1] not in model.calls and step2[2] not in model.calls
    assert model.calls.count(step1[1]) == 1 and model.calls.count(step1[2]) == 2  # the unreadable one sampled again
    assert m["status"] == {"invalid": 1, "ok": 1, "unfinished": 1}
    assert m["calls"]["steps"]["finished"]["requests"] == 3 and m["calls"]["steps"]["amount"]["requests"] == 1
    assert m["calls"]["unfinished"] == 1 and m["calls"]["failure_rate"] == round(1 / 3, 4)  # unfinished is not a failure
