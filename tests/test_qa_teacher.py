"""The QA teacher (Refit/Swift's setting): each question generator's answers checked against the
data it reads, its splits disjoint, the teacher's turns in both modes, the answer extractor on
hard cases, the judge (the LLM judge's parser; the oracle judge's rules and the scripted
answerers it ranks), a user's MCQ file and its validation, and the oracle roles."""
import json
import re

import pytest

from envs import registry
from envs.car_dealer.data import load_catalog
from envs.guess_my_city.cities import load_cities
from envs.guess_my_city.oracle import load_oracle
from envs.qa_teacher import llm_roles
from envs.qa_teacher.format import read_answer, reasoning, render_reply
from envs.qa_teacher.generators import arithmetic_split, car_models, generate
from envs.qa_teacher.judge import RUBRIC, judge
from envs.qa_teacher.mcq_file import MCQFileError, load_mcq_file
from envs.qa_teacher.policies import expert
from envs.qa_teacher.questions import LETTERS
from envs.twenty_questions.kb import load_kb
from tasks.rollout import ScriptedAgent, new_episode, play

NOISE = {"p_random": 0.15, "p_repeat": 0.10, "p_early_guess": 0.10}
SIZES = {"train": 400, "val": 50, "test": 100}


@pytest.fixture(scope="module")
def env():
    return registry.make("qa_teacher", {})


@pytest.fixture(scope="module")
def standard():
    return registry.make("qa_teacher", {"mode": "standard"})


def by_source(env, source):
    return [q for s in env.splits for q in env.tasks(s) if q.source == source]


# ---- the generators: right answers, disjoint splits ----

def test_sizes_ids_and_a_larger_size_keeps_every_question(env):
    assert {s: len(env.tasks(s)) for s in env.splits} == SIZES
    ids = [q.id for s in env.splits for q in env.tasks(s)]
    assert len(ids) == len(set(ids))
    # the first tasks of a split cover the generators in turn (limit_tasks takes a prefix)
    assert [q.source for q in env.tasks("test")[:4]] == ["twenty_questions", "cities", "car_dealer", "arithmetic"]
    bigger = generate(env.options.generators, {"train": 420, "val": 60, "test": 100}, 0)
    assert {q.id: q for q in env.tasks("train")}.items() <= {q.id: q for q in bigger["train"]}.items()
    assert generate(env.options.generators, SIZES, 1)["test"] != env.tasks("test")  # the seed matters


def test_every_question_is_well_formed_and_each_fact_matches_its_option(env):
    for q in env.by_id.values():
        assert len(q.options) == len(set(q.options)) == 4 and q.answer in LETTERS
        assert q.option(q.answer) == q.options[q.key]
        assert len(set(q.facts) | set(q.false_facts)) == 8  # no fact is its own false fact


def test_twenty_questions_answers_follow_the_knowledge_base(env):
    kb = load_kb()
    by_text = {q.text: q for q in kb.questions}
    for q in by_source(env, "twenty_questions"):
        m = re.fullmatch(r'For which of these is the answer to "(.+)" (yes|no)\?', q.question)
        asked, wanted = by_text[m.group(1)], m.group(2) == "yes"
        truth = [kb.truth(kb.get(o), asked) for o in q.options]
        assert truth[q.key] == wanted and all(t != wanted for i, t in enumerate(truth) if i != q.key), q
        assert {kb.get(o).split for o in q.options} == {q.split}


def test_city_answers_follow_guess_my_citys_data(env):
    cities = load_cities()
    facts = load_oracle(cities).facts
    for q in by_source(env, "cities"):
        here = [cities.get(c) for c in q.objects]
        assert {c.split for c in here} == {q.split}
        if m := re.fullmatch(r"In which country is the city of (.+)\?", q.question):
            assert q.option(q.answer) == here[0].country and here[0].name == m.group(1)
            assert sum(o == here[0].country for o in q.options) == 1
        else:
            sight = re.fullmatch(r"Which city is known for (.+)\?", q.question).group(1)
            named = {c.name: facts[c.id].landmark for c in here}
            assert named[q.option(q.answer)] == sight and sum(v == sight for v in named.values()) == 1


def test_car_answers_follow_the_catalogue(env):
    catalog = load_catalog()
    models = car_models(0)
    assert sorted(m for ms in models.values() for m in ms) == sorted((b, t) for b in catalog.brands for t in catalog.types)
    for q in by_source(env, "car_dealer"):
        (name,) = q.objects
        brand, car_type = next(m for m in models[q.split] if f"{m[0]} {m[1]}" == name)
        base = catalog.base_msrp[brand][car_type]
        key = int(q.option(q.answer).strip("$").replace(",", ""))
        if m := re.search(r"with (.+) and (.+)\?$", q.question):
            assert key == base + catalog.added_value[m.group(1)] + catalog.added_value[m.group(2)]
        else:
            assert key == base


def test_arithmetic_answers_are_computed_and_the_students_wrong_answer_is_an_option(env):
    for q in by_source(env, "arithmetic"):
        template, a, b, c = q.objects[0].split("/")
        a, b, c = int(a), int(b), int(c)
        right = {"packs": a * b - c, "share": (a + b) // c, "change": c - a * b}[template]
        assert q.option(q.answer) == str(right)
        student = re.search(r"and got (\d+)\.", q.question).group(1)
        assert student in q.options and student != str(right)
        assert arithmetic_split(0, (template, a, b, c)) == q.split


def test_the_splits_share_no_object(env):
    for source in ("twenty_questions", "cities", "car_dealer", "arithmetic"):
        objects = {s: {o for q in env.tasks(s) if q.source == source for o in q.objects} for s in env.splits}
        assert objects["train"] and objects["val"] and objects["test"], source
        assert not objects["train"] & objects["val"] and not objects["train"] & objects["test"] and not objects["val"] & objects["test"], source


# ---- the answer extractor ----

@pytest.mark.parametrize("text, letter", [
    ("The answer is B.", "B"),
    ("the answer is (C) because it fits", "C"),
    ("**The answer is D**", "D"),
    ("The answer is: A", "A"),
    ("Answer: B", "B"),
    ("The final answer is **C**.", "C"),
    ("I think the answer is C. On reflection the answer is D.", "C"),  # the first statement
    ("<thinking>The answer is A</thinking> The answer is B.", "B"),  # thinking does not count
    ("The answer is B.\n<thinking>but the answer is A</thinking>", "B"),
    ("The answer is Apple.", None),  # a word, not a letter
    ("The answer is a bicycle.", None),  # a lower-case article
    ("The answer is A or B.", None),  # a hedge
    ("The answer is A/B", None),
    ("<thinking>The answer is A", None),  # only inside an unclosed block
    ("Option B is correct.", None),  # no statement
    ("The answer is E.", None),
    ("the answer is B, C fails", "B"),
])
def test_the_answer_extractor(text, letter):
    assert read_answer(text)[0] == letter


def test_why_an_answer_is_missing_is_said():
    assert "inside the thinking tags" in read_answer("<thinking>The answer is A</thinking>")[1]
    assert "hedges" in read_answer("The answer is A or B")[1]
    assert "no 'The answer is X'" in read_answer("I do not know.")[1]


def test_a_reply_renders_in_the_modes_format_and_reads_back():
    thinking = render_reply("thinking", "C", "Dog: animal.")
    assert thinking == "The answer is C.\n<thinking>Dog: animal.</thinking>"
    assert read_answer(thinking)[0] == "C" and reasoning(thinking) == "Dog: animal."
    assert render_reply("standard", "C", "Dog: animal.") == "The answer is C. Dog: animal."


# ---- the teacher's turns and the game ----

@pytest.mark.parametrize("mode", ["thinking", "standard"])
def test_the_teacher_walks_through_its_turns_in_both_modes(mode):
    env = registry.make("qa_teacher", {"mode": mode, "turns": 4})
    q = env.tasks("train")[0]
    game = env.game(q)
    messages, _ = game.reset()
    system, first = messages[0]["content"], messages[1]["content"]
    assert ("<thinking>" in system) == (mode == "thinking") and "'The answer is X'" in system
    assert first.startswith(f"Question: {q.question}\nChoices:\nA. {q.options[0]}\nB. {q.options[1]}")
    assert q.instruction in first and ("<thinking></thinking>" in first) == (mode == "thinking")
    asked = []
    for t in range(4):
        step = game.step(expert(q, mode, t, 4))
        assert step.info["parsed"] and step.truncated is False
        assert step.terminated == (t == 3) and (step.reward == 0.0) == (t < 3)
        asked.append(step.observation[0]["content"] if step.observation else "")
    assert "why some of the options might be wrong" in asked[0]
    assert "(turn 3)" in asked[1] and "key concepts" in asked[1]  # the paper's intermediate turn, n > 3
    assert "What is your final answer (A, B, C or D)?" in asked[2] and asked[3] == ""
    assert game.success and step.reward == 1.0 and step.info["turn"]["observation"] == ""
    with pytest.raises(RuntimeError, match="over"):
        game.step("The answer is A.")


def test_a_reply_off_the_format_still_spends_its_turn_and_the_final_letter_decides_success(env):
    q = env.tasks("test")[1]
    wrong = LETTERS[(q.key + 1) % 4]
    game = env.game(q)
    game.reset()
    first = game.step("I have no idea.")
    assert not first.info["parsed"] and first.info["turn"]["action"] == "I have no idea."
    game.step(expert(q, "thinking", 1, 3))
    last = game.step(f"The answer is {wrong}.")
    assert last.terminated and not game.success and last.reward < 0.5
    assert not env.won(last.reward)


def test_restore_resumes_after_a_logged_prefix(env):
    q = env.tasks("train")[2]
    replies = [expert(q, "thinking", t, 3) for t in range(3)]
    game = env.game(q)
    game.reset()
    game.restore([{"action": " ".join(replies[0].split())}])
    assert game.turn == 1 and not game.done
    game.step(replies[1])
    assert game.step(replies[2]).reward == 1.0
    with pytest.raises(ValueError, match="leaves no turn"):
        env.game(q).restore([{"action": r} for r in replies])


# ---- the judge ----

WELL_FORMED = """Accuracy: 8
The assistant commits to the correct option early.

Reasoning ability: 7.5
Mostly logical, one step is vague.

Comprehensiveness: 6
Two of the wrong options are addressed.

Pedagogical value: 7
Helpful for a learner.

Confidence calibration: 8
Appropriately confident.

Overall: 7
A good conversation overall."""


def test_the_llm_judges_reply_is_parsed_overall_read_not_recomputed():
    scores = RUBRIC.parse(WELL_FORMED)
    assert scores == {"Accuracy": 8, "Reasoning ability": 7.5, "Comprehensiveness": 6, "Pedagogical value": 7,
                      "Confidence calibration": 8, "Overall": 7}
    assert sum(v for k, v in scores.items() if k != "Overall") / 5 == 7.3  # the mean differs: Overall is the judge's own
    markdown = "\n".join(f"{i}. **{line.split(':')[0]}**: [{line.split(':')[1].strip()}]" for i, line in
                         enumerate((x for x in WELL_FORMED.splitlines() if ":" in x), 1))
    assert RUBRIC.parse(markdown) == scores


@pytest.mark.parametrize("text, error", [
    (WELL_FORMED.split("Overall")[0], "missing scores: Overall"),  # partial: cut before Overall
    ("Accuracy: 8\nReasoning ability: 7", "missing scores: Comprehensiveness, Pedagogical value, Confidence calibration, Overall"),
    ("The conversation was good, I would give it a seven.", "missing scores: Accuracy"),  # garbled
    (WELL_FORMED.replace("Overall: 7", "Overall: 12"), "outside 0..10: Overall 12"),
    ("Accuracy: high\n" + WELL_FORMED.split("\n", 1)[1], "missing scores: Accuracy"),
])
def test_the_llm_judges_parser_refuses_partial_and_garbled_replies(text, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        RUBRIC.parse(text)


def test_the_judge_request_shows_question_key_and_transcript_and_refuses_an_echo(env):
    q = env.tasks("train")[0]
    turns = [{"action": " ".join(expert(q, "thinking", t, 3).split())} for t in range(3)]
    request = env.judge_request(q.id, turns)
    system, user = (m["content"] for m in request.messages)
    assert all(c in system for c in ("Accuracy", "Reasoning ability", "Comprehensiveness", "Pedagogical value", "Confidence calibration", "Overall"))
    assert f"Correct answer: {q.answer}" in user and f"Choices: A. {q.options[0]}, B." in user
    assert user.count("Teacher: ") == 3 and user.count("Assistant: ") == 3 and "<thinking>" in user
    assert request.parse(WELL_FORMED)["Overall"] == 7
    with pytest.raises(ValueError, match="repeats the prompt"):
        request.parse(user + "\n" + WELL_FORMED)


def test_the_oracle_judges_rules(env):
    q = env.tasks("train")[0]
    wrong, key = (q.key + 1) % 4, q.key
    best = judge(q, [expert(q, "thinking", t, 3) for t in range(3)], True)
    assert best.correct and best.scores == dict.fromkeys(best.scores, 10.0)
    bare = judge(q, [f"The answer is {q.answer}."] * 3, True)  # right, no reasoning at all
    assert bare.correct and bare.scores["Reasoning ability"] == 0 and bare.scores["Confidence calibration"] == 6
    assert bare.mean_of_five() < 5 and bare.scores["Overall"] == 5.0  # held at 5: the final answer is right
    claims = render_reply("thinking", LETTERS[wrong], q.false_facts[wrong])
    liar = judge(q, [claims, render_reply("thinking", LETTERS[wrong], q.false_facts[key]), claims], True)
    assert not liar.correct and liar.scores["Accuracy"] == 0 and liar.scores["Reasoning ability"] == 0 and liar.scores["Overall"] <= 4
    # moving to the key late earns less accuracy than holding it; the standard mode needs no tags
    late = judge(q, [claims, expert(q, "standard", 1, 3), expert(q, "standard", 2, 3)], False)
    assert late.correct and late.scores["Accuracy"] == 7.5
    # a repeated reply does not answer the teacher's new question
    first = expert(q, "thinking", 0, 3)
    assert judge(q, [first, first, expert(q, "thinking", 2, 3)], True).scores["Pedagogical value"] == 7
    # the thinking mode asks for the tags: the same words without them teach less there
    plain = [expert(q, "standard", t, 3) for t in range(3)]
    assert judge(q, plain, True).scores["Pedagogical value"] == 0 and judge(q, plain, False).scores["Pedagogical value"] == 10


@pytest.mark.parametrize("mode", ["thinking", "standard"])
def test_scripted_answerers_rank_as_the_judge_should_and_the_label_replays_the_return(mode):
    env = registry.make("qa_teacher", {"mode": mode})
    policies = env.policies(NOISE)
    assert set(policies) == {"expert", "noisy", "wrong", "unjustified", "random"}
    tasks = env.tasks("train")[:80]
    results = {}
    for name, policy in policies.items():
        episodes = [new_episode(env, q, seed) for seed, q in enumerate(tasks)]
        play(episodes, ScriptedAgent(lambda rng, p=policy: p), 0, name)
        rows = [e.to_row() for e in episodes]
        for r in rows:
            label = env.label(r["task_id"], r["turns"])
            assert (label.reward, label.success) == (r["return"], r["success"])
            assert env.won(r["return"]) == r["success"]  # Overall >= 5 exactly when the final answer is right
            assert label.scores["Overall"] == pytest.approx(r["return"] * 10)
        results[name] = (sum(r["return"] for r in rows) / len(rows), sum(r["success"] for r in rows) / len(rows))
    assert results["expert"] == (1.0, 1.0) and results["unjustified"] == (0.5, 1.0) and results["wrong"][1] == 0
    assert results["expert"][0] > results["noisy"][0] > results["unjustified"][0] > results["wrong"][0]
    assert results["random"][1] < 0.5


# ---- a user's MCQ file ----

def write(tmp_path, rows) -> str:
    path = tmp_path / "mcq.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


GOOD = {"question": "What is the capital of France?", "options": ["London", "Paris", "Rome", "Madrid"], "answer": "B"}


def test_a_users_mcq_file_becomes_the_tasks(tmp_path):
    rows = [GOOD, {**GOOD, "question": "Which is a prime?", "options": {"A": "4", "B": "6", "C": "7", "D": "9"}, "answer": "c", "split": "test", "id": "p1"},
            {**GOOD, "question": "2 + 2?", "options": ["3", "4", "5", "6"], "facts": ["3: one short.", "2 + 2 = 4.", "5: one over.", "6: two over."],
             "false_facts": ["2 + 2 = 3.", "4: wrong.", "2 + 2 = 5.", "2 + 2 = 6."], "split": "val"}]
    env = registry.make("qa_teacher", {"questions_file": write(tmp_path, rows)})
    assert [q.id for q in env.tasks("test")] == ["p1"] and env.task("p1").answer == "C"
    assert env.tasks("val")[0].facts[1] == "2 + 2 = 4."
    capital = next(q for s in env.splits for q in env.tasks(s) if q.question == GOOD["question"])
    assert capital.facts[1] == "B. Paris: the right answer." and capital.false_facts[1] == "B. Paris: wrong."
    # without a split, a line's split comes from its question's text: the same wherever it stands
    again = load_mcq_file(write(tmp_path, [rows[1], rows[0]]), SIZES)
    assert next(q.split for qs in again.values() for q in qs if q.question == GOOD["question"]) == capital.split
    game = env.game(env.task("p1"))
    game.reset()
    for t in range(3):
        step = game.step(expert(env.task("p1"), "thinking", t, 3))
    assert step.reward == 1.0


@pytest.mark.parametrize("row, where", [
    ({k: v for k, v in GOOD.items() if k != "answer"}, "field 'answer': missing"),
    ({**GOOD, "answer": "E"}, "field 'answer': 'E' is not one of A, B, C, D"),
    ({**GOOD, "options": ["a", "b", "c"]}, "field 'options': 3 entries, expected 4"),
    ({**GOOD, "options": ["a", "b", "c", "A"]}, "field 'options': two options are the same"),
    ({**GOOD, "options": ["a", "b", "", "d"]}, "field 'options[2]': empty"),
    ({**GOOD, "options": {"A": "a", "B": "b", "C": "c", "E": "e"}}, "field 'options': keys ['A', 'B', 'C', 'E']"),
    ({**GOOD, "question": 7}, "field 'question': expected text, got int"),
    ({**GOOD, "split": "dev"}, "field 'split': 'dev' is not one of train, val, test"),
    ({**GOOD, "explanation": "x"}, "field 'explanation': unknown field"),
    ({**GOOD, "facts": ["a", "b", "c", "d"]}, "field 'false_facts': give facts and false_facts together"),
    ("{not json", "field '(line)': not JSON"),
    ("[1, 2]", "field '(line)': expected a JSON object, got list"),
])
def test_a_bad_line_stops_the_load_naming_file_line_and_field(tmp_path, row, where):
    path = write(tmp_path, [GOOD | {"question": "Another question?"}, row])
    with pytest.raises(MCQFileError, match=re.escape(f"{path}:2: {where}")):
        load_mcq_file(path, SIZES)


def test_duplicates_and_empty_files_are_refused(tmp_path):
    path = write(tmp_path, [GOOD, {**GOOD, "options": ["w", "x", "y", "z"]}])
    with pytest.raises(MCQFileError, match=re.escape(f"{path}:2: field 'question': the same question as line 1")):
        load_mcq_file(path, SIZES)
    path = write(tmp_path, [{**GOOD, "id": "q"}, {**GOOD, "question": "Other?", "id": "q"}])
    with pytest.raises(MCQFileError, match="field 'id': 'q' is the id of line 1 too"):
        load_mcq_file(path, SIZES)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty file: no questions"):
        registry.make("qa_teacher", {"questions_file": str(tmp_path / "empty.jsonl")})


# ---- oracle and LLM hindsight roles ----

def test_the_proposer_and_controller_offer_the_experts_reply_and_the_summary_tells_the_outcome(env):
    q = env.tasks("train")[3]
    wrong = LETTERS[(q.key + 1) % 4]
    bad = [{"action": f"The answer is {wrong}.", "observation": ""} for _ in range(3)]
    (proposal,) = env.propose(q, bad[:1], 2, bad[1]["action"])
    assert proposal.text == expert(q, "thinking", 1, 3) and f"The key is {q.answer}" in proposal.rationale
    assert env.propose(q, [], 1, " ".join(expert(q, "thinking", 0, 3).split())) == []  # already the expert's
    places = env.critique(q, bad, 2)
    assert [t for t, _ in places] == [2, 1]  # wrong letters, the final turn first
    summary = env.summarize(q, bad, False)
    assert f"The key is {q.answer}" in summary and f"Answers by turn: {wrong}, {wrong}, {wrong}" in summary and "wrong" in summary


def test_the_llm_proposer_round_trips_its_reply_and_refuses_one_without_an_answer(env):
    q = env.tasks("train")[3]
    (proposal,) = env.propose(q, [], 1)
    request = env.proposer_request(q, [], 1, "It answered wrong.")
    assert request.parse(env.proposer_reply([proposal])) == [proposal]
    reply = '```json\n[{"teacher_reason": "better", "reply": "I think it is B."}]\n```'
    with pytest.raises(ValueError, match="proposal 0: no 'The answer is X'"):
        request.parse(reply)
    no_tags = '```json\n[{"teacher_reason": "better", "reply": "The answer is B. Because."}]\n```'
    with pytest.raises(ValueError, match="no <thinking></thinking> block"):
        request.parse(no_tags)
    assert env.summary_request(q, [], False).parse("It answered A, then B; B was right.") == "It answered A, then B; B was right."
    assert set(llm_roles.TEMPLATES) == {"judge", "summarizer", "proposer"}
    with pytest.raises(NotImplementedError, match="no LLM labeler prompt"):
        env.prompt_hash("labeler")


# ---- the real stages with env.name: qa_teacher ----

def test_scripted_dialogues_go_through_the_hindsight_stages_into_swifts_groups(tmp_path, tiny_model_dir):
    """summarize, relabel, regenerate, label (the oracle judge: its scores in the labels) and
    standardize on qa_teacher: three logged dialogues a question make Swift's groups of three."""
    from conftest import tiny_params
    from storage.parquet import read_table, write_table
    from storage.schema import to_table
    from storage.validate import read_checked
    from tasks.bootstrap import demonstrations
    from tasks.label import run_label
    from tasks.params import Params
    from tasks.regenerate import run_regenerate
    from tasks.relabel import run_relabel
    from tasks.standardize import run_standardize
    from tasks.summarize import run_summarize

    raw = tiny_params({"bootstrap": {"demos_per_task": 3, "limit_tasks": 2,
                                     "behaviour_mix": {"expert": 0.3, "noisy": 0.3, "wrong": 0.2, "unjustified": 0.1, "random": 0.1}}})
    raw["env"] = {"name": "qa_teacher", "train_questions": 8, "val_questions": 4, "test_questions": 4}
    p = Params.model_validate(raw)
    write_table(to_table([e.to_row() for e in demonstrations(p)], "trajectories"), tmp_path / "trajectories.parquet", "trajectories")
    n = read_table(tmp_path / "trajectories.parquet").num_rows
    assert n == 6
    assert run_summarize(p, tmp_path / "trajectories.parquet", tmp_path)["summaries"] == n
    run_relabel(p, tmp_path / "trajectories.parquet", tmp_path / "summaries.parquet", tmp_path / "relabel")
    relabels = [r for r in read_table(tmp_path / "relabel/relabels.parquet").to_pylist() if r["status"] == "ok"]
    run_regenerate(p, tmp_path / "trajectories.parquet", tmp_path / "relabel/relabels.parquet", tiny_model_dir, tmp_path / "regen")
    files = [tmp_path / "trajectories.parquet", tmp_path / "regen/trajectories.parquet"]
    m = run_label(p, files, tmp_path / "label")
    assert m["logged_return_mismatches"] == 0 and m["status"] == {"ok": n + len(relabels)}
    labels = read_table(tmp_path / "label/labels.parquet").to_pylist()
    assert all(set(json.loads(r["scores"])) == set(RUBRIC.criteria) and r["reward"] == pytest.approx(json.loads(r["scores"])["Overall"] / 10) for r in labels)
    assert m["rubric_check"]["scored"] == len(labels)
    run_standardize(p, files, tmp_path / "label/labels.parquet", tmp_path / "std")
    kept, quarantine = read_checked(tmp_path / "std/train.parquet", "training")
    logged = [r for r in kept.to_pylist() if r["source"] == "policy"]
    assert quarantine.num_rows == 0 and len(logged) == n and {r["group_size"] for r in logged} == {3}
    assert {r["weight"] for r in logged} == {r["reward"] for r in logged}  # Refit's weight: Overall / 10 as it is


class Judge:
    """An LLM judge that gives every conversation the same rubric reply."""

    backend, model_id = "openai", "judge"

    def generate(self, convs, sampling, seeds):
        from models.base import Completion

        return [Completion(WELL_FORMED) for _ in convs]


def test_the_label_stage_with_the_llm_rubric_judge_keeps_overall_and_checks_it_against_the_mean(env, tmp_path, monkeypatch):
    from conftest import tiny_params
    from storage.parquet import read_table, write_table
    from storage.schema import to_table
    from tasks import label as label_stage
    from tasks.params import Params

    q = env.tasks("train")[0]
    episode = new_episode(env, q, 0)
    play([episode], ScriptedAgent(lambda rng: env.policies(NOISE)["expert"]), 0)
    write_table(to_table([episode.to_row()], "trajectories"), tmp_path / "trajectories.parquet", "trajectories")
    monkeypatch.setattr(label_stage, "make_generator", lambda role, cache: Judge())
    judge_role = {"backend": "openai", "model": "m", "base_url": "http://127.0.0.1:1/v1", "mode": "rubric"}
    p = Params.model_validate({**tiny_params({"roles": {"labeler": judge_role}}), "env": {"name": "qa_teacher"}})
    m = label_stage.run_label(p, [tmp_path / "trajectories.parquet"], tmp_path / "label")
    (row,) = read_table(tmp_path / "label/labels.parquet").to_pylist()
    assert row["reward"] == 0.7 and row["env_reward"] == 1.0 and row["env_success"] is True  # exact match beside the judge's
    assert json.loads(row["scores"])["Overall"] == 7 and row["prompt_hash"] == env.prompt_hash("judge")
    assert m["rubric_check"] == {"scored": 1, "mean_overall_minus_mean_of_criteria": -0.3, "mean_abs_gap": 0.3, "overall_is_the_mean": 0.0}
