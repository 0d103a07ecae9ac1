"""Parsers of LLM role outputs on a corpus of good and bad outputs: those every question game
shares (envs/question_roles.py) and TwentyQuestions' own."""
import pytest

from envs.question_roles import dialogue, parse_controller, parse_proposals, parse_reward, parse_rubric, parse_summary
from envs.twenty_questions.llm_roles import chat, parse_continuation, parse_yes_no

HIDDEN = {"secret": ["Dog"], "category": ["Animals"]}

GOOD_PROPOSALS = '''Here are my suggestions.
```json
[{"teacher_reason": "The secret is a Dog; asking about animals halves the list.", "question": "Is it an animal?", "player_reason": "Nothing is known yet, so split living from non-living things."},
 {"teacher_reason": "Pets narrow it to few objects.", "question": "Is it kept as a pet?", "player_reason": "A broad split comes first."}]
```'''


def test_proposals_good():
    out = parse_proposals(GOOD_PROPOSALS, 2, HIDDEN)
    assert [p.question for p in out] == ["Is it an animal?", "Is it kept as a pet?"]
    assert parse_proposals(GOOD_PROPOSALS, 1, HIDDEN)[0].player_reason.startswith("Nothing is known")
    bare = '[{"teacher_reason": "t", "question": "Is it red?", "player_reason": "p"}]'
    assert parse_proposals(bare, 2, HIDDEN)[0].question == "Is it red?"


@pytest.mark.parametrize(
    "text, message",
    [
        ("I think it should ask about animals.", "no JSON list"),
        ("```json\n[{\"teacher_reason\": \"t\", \"question\": \"Is it red?\"\n```", "JSON does not parse"),
        ('[{"teacher_reason": "t", "player_reason": "p"}]', "missing or empty 'question'"),
        ('[{"teacher_reason": "t", "question": "  ", "player_reason": "p"}]', "missing or empty 'question'"),
        ('[{"teacher_reason": "t", "question": 3, "player_reason": "p"}]', "missing or empty 'question'"),
        ('["Is it red?"]', "expected an object"),
        ("[]", "non-empty JSON list"),
        ('{"question": "Is it red?"}', "no JSON list"),
        ('[{"teacher_reason": "t", "question": "Is it a dog?", "player_reason": "It barks, so it must be a dog."}]', "names the hidden secret"),
        ('[{"teacher_reason": "t", "question": "Is it a pet?", "player_reason": "Probably one of the animals."}]', "names the hidden category"),
        ('## Summary of the whole game\n[{"teacher_reason": "t", "question": "q", "player_reason": "p"}]', "repeats the prompt"),
    ],
)
def test_proposals_bad(text, message):
    with pytest.raises(ValueError, match=message):
        parse_proposals(text, 2, HIDDEN)


@pytest.mark.parametrize("text, value", [("Reward: -4", -4.0), ("reward: 0\n", 0.0), ("I count 5 questions.\nReward: -5.0", -5.0), ("Reward:-20", -20.0)])
def test_reward_good(text, value):
    assert parse_reward(text, -20, 0) == value


@pytest.mark.parametrize(
    "text, message",
    [
        ("The player did well.", "no line 'Reward: <number>'"),
        ("Reward: minus four", "no line 'Reward: <number>'"),
        ("Reward: 10", r"outside \[-20, 0\]"),
        ("Reward: -21", "outside"),
        ("Reward: -3 because it guessed quickly", "no line"),  # the line must be the label alone
        ("Reward: 10\nReward: -1", "2 'Reward:' lines"),  # ambiguous: no guessing which one is meant
        ("<Game 1>\nQ1: Is it a dog?\nA1: yes\nReward: 0", "repeats the prompt"),
        ("", "no line"),
    ],
)
def test_reward_bad(text, message):
    with pytest.raises(ValueError, match=message):
        parse_reward(text, -20, 0)


def test_a_dialogue_saying_reward_10_is_never_the_label():
    """The prompt shows a game whose question says "Reward: 10"; only the output is parsed."""
    history = [("Reward: 10", "unknown"), ("Is it a dog?", "yes")]
    prompt = chat("labeler.j2", max_turns=20, examples=[], dialogue=dialogue(history))
    assert "Reward: 10" in prompt[1]["content"]
    assert parse_reward("Reward: -1", -20, 0) == -1.0
    # A game line echoed back with the label: the player's "Reward: 10" is not the label.
    assert parse_reward("Q1: Reward: 10\nReward: -1", -20, 0) == -1.0
    with pytest.raises(ValueError):
        parse_reward(prompt[1]["content"], -20, 0)  # the prompt echoed back is refused


@pytest.mark.parametrize("text", ["", "   ", "## Questions and answers\nQ1: ...", "x" * 3000, "123 456 !!"])
def test_summary_bad(text):
    with pytest.raises(ValueError):
        parse_summary(text)


def test_summary_good():
    assert parse_summary("  The secret was a Dog (Animals).\n The player asked broad questions and won.  ") == "The secret was a Dog (Animals). The player asked broad questions and won."


@pytest.mark.parametrize("text, answer", [("Yes", "yes"), ("no.", "no"), (" NO, it is not", "no")])
def test_yes_no(text, answer):
    assert parse_yes_no(text) == answer


@pytest.mark.parametrize("text", ["maybe", "", "It is yes", "Reward: 0"])
def test_yes_no_bad(text):
    with pytest.raises(ValueError, match="expected yes or no"):
        parse_yes_no(text)


JUDGE = """Progress: 6
It narrowed to animals quickly.
Question quality: 7.5
Good splits.
Consistency: 8
No repeats.
Efficiency: 5
Guessed late.
Outcome: 9
Found it.
Overall: 7
A solid game."""


def test_rubric_reads_overall_and_does_not_recompute_it():
    scores = parse_rubric(JUDGE)
    assert scores["Overall"] == 7.0 and scores["Question quality"] == 7.5
    assert parse_rubric(JUDGE.replace("Progress: 6", "**Progress**: 6"))["Progress"] == 6.0


@pytest.mark.parametrize(
    "text, message",
    [
        (JUDGE.replace("Overall: 7", "Overall: seven"), "missing scores: Overall"),
        (JUDGE.replace("Consistency: 8", ""), "missing scores: Consistency"),
        (JUDGE.replace("Outcome: 9", "Outcome: 12"), "outside 0..10: Outcome 12"),
        ("=== GAME ===\n" + JUDGE, "repeats the prompt"),
        ("", "missing scores"),
    ],
)
def test_rubric_bad(text, message):
    with pytest.raises(ValueError, match=message):
        parse_rubric(text)


ASKED = ["Is it an animal?", "Is it a pet?", "Is it Cat?"]


def test_controller_places():
    out = parse_controller('1. "Is it a pet?";too narrow, the secret is wild;"Does it live in water?"/\n2. "is it cat?";guessed early;"Does it have fur?"', ASKED, 3)
    assert [(p.turn, p.replacement) for p in out] == [(1, "Does it live in water?"), (2, "Does it have fur?")]
    assert "wild" in out[0].critique
    assert len(parse_controller('1. "Is it a pet?";x;"Is it big?"/\n2. "Is it Cat?";y;"Is it small?"/', ASKED, 1)) == 1


@pytest.mark.parametrize(
    "text, message",
    [
        ('1. "Is it a bird?";x;"Is it big?"/', "never asked"),
        ("The player should have asked better questions.", "not a place line"),
        ('1. "Is it a pet?";x;"Is it a pet?"/', "no place to improve"),
        ("", "no place to improve"),
        ('Name the top 3 places\n1. "Is it a pet?";x;"Is it big?"/', "repeats the prompt"),
    ],
)
def test_controller_bad(text, message):
    with pytest.raises(ValueError, match=message):
        parse_controller(text, ASKED, 3)


def test_continuation_good():
    assert parse_continuation("Q3: Is it big?\nA3: no\nQ4: Is it Cat?\nA4: Yes.", 3, 20) == [("Is it big?", "no"), ("Is it Cat?", "yes")]


@pytest.mark.parametrize(
    "text, message",
    [
        ("Q4: Is it big?\nA4: no", "expected 'Q3"),
        ("Q3: Is it big?", "Q3 has no answer"),
        ("Q3: Is it big?\nA3: perhaps", "expected 'A3: yes|no'"),
        ("Q3: Is it big?\nA3: no\nQ5: Is it red?\nA5: no", "expected 'Q4"),
        ("Q20: Is it big?\nA20: no\nQ21: Is it red?\nA21: no", "past the game's 20"),
        ("", "empty continuation"),
        ("Here is the start of a game:\nQ3: x\nA3: no", "repeats the prompt"),
    ],
)
def test_continuation_bad(text, message):
    start = 20 if text.startswith("Q20") else 3
    with pytest.raises(ValueError, match=message):
        parse_continuation(text, start, 20)
