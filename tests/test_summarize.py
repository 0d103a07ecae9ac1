"""The oracle summarizer and the summarize stage."""
import pyarrow.parquet as pq

from envs.twenty_questions.kb import load_kb
from envs.twenty_questions.summarizer import summarize_game
from storage.parquet import write_table
from storage.schema import to_table
from tasks.params import Params
from tasks.rollout import new_episode
from tasks.summarize import run_summarize
from conftest import tiny_params, twenty_questions


def test_summary_names_secret_category_misses_and_outcome():
    kb = load_kb()
    history = [("Does it fit in your hand?", "yes"), ("Does it fit in your hand?", "yes"), ("What is it?", "unknown"), ("Is it Banana?", "no")]
    text = summarize_game(kb, kb.get("Apple"), history, success=False)
    assert text.startswith("The secret was Apple, in the category fruit.")
    assert "hand-sized" in text and "never asked about its category (fruit)" in text
    assert "repeated 1 question" in text and "could not answer" in text and "guessed wrong (Banana)" in text
    assert text.endswith("It failed to find it in 4 turns.")
    assert 2 <= text.count(". ") + 1 <= 4  # HOPE asks for 2-4 sentences


def test_success_summary():
    kb = load_kb()
    text = summarize_game(kb, kb.get("Cat"), [("Is it an animal?", "yes"), ("Is it Cat?", "yes")], success=True)
    assert text == "The secret was Cat, in the category animal. The questions established: animal. It found the answer in 2 turns."


def test_stage_writes_one_summary_per_trajectory(tmp_path):
    kb = load_kb()
    rows = []
    for i, name in enumerate(["Dog", "Apple"]):
        ep = new_episode(twenty_questions(20), kb.get(name), i)
        for text in ("REASON: Ask.\nQUESTION: Is it an animal?", f"REASON: Guess.\nQUESTION: Is it {name}?"):
            ep.apply(text)
        ep.policy_id = "test"
        rows.append(ep.to_row())
    write_table(to_table(rows, "trajectories"), tmp_path / "t.parquet", "trajectories")
    metrics = run_summarize(Params.model_validate(tiny_params()), tmp_path / "t.parquet", tmp_path / "out")
    out = pq.read_table(tmp_path / "out/summaries.parquet").to_pylist()
    assert metrics["summaries"] == 2 and {r["trajectory_id"] for r in out} == {r["trajectory_id"] for r in rows}
    by_task = {r["task_id"]: r["summary"] for r in out}
    assert "The questions established: animal." in by_task["Dog"] and "found the answer in 2 turns" in by_task["Dog"]
    assert "The questions established: not animal." in by_task["Apple"]
    assert all(r["backend"] == "oracle" and r["role"] == "summarizer" and r["prompt_hash"] for r in out)
