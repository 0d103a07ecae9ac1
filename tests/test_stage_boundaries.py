"""Every stage checks the rows it reads: bad rows are quarantined with their reason, the rest
give exactly the output the clean rows alone give, and rows in = kept + quarantined."""
from __future__ import annotations

import inspect
import math
from pathlib import Path

import pytest

from conftest import CODE, ROOT, TINY, built, digest, tiny_params, twenty_questions
from envs.twenty_questions.kb import load_kb
from envs.twenty_questions.env import Scripted
from envs.twenty_questions.policies import NoisyPolicy
from storage.parquet import read_table, write_table
from storage.schema import to_table
from tasks.label import run_label
from tasks.params import Params
from tasks.regenerate import run_regenerate
from tasks.relabel import run_relabel
from tasks.rollout import ScriptedAgent, derive_seed, new_episode, play
from tasks.standardize import run_standardize
from tasks.summarize import run_summarize

OVERRIDES = {"env": {"max_turns": 20}, "regenerate": {"batch_size": 64}}
PARAMS = Params.model_validate(tiny_params(OVERRIDES))


def _broken_roles(row: dict) -> dict:
    row["messages"][2], row["messages"][3] = row["messages"][3], row["messages"][2]
    return row


def _nan_return(row: dict) -> dict:
    return {**row, "return": math.nan}


def _edited(row: dict) -> dict:
    row["messages"][-1] = {**row["messages"][-1], "content": row["messages"][-1]["content"] + " (edited)"}
    return row


# (what is wrong, how to break a row, the field the quarantine row must name)
TRAJECTORY_FAULTS = [
    ("broken role order", _broken_roles, "messages[2].role"),
    ("NaN return", _nan_return, "return"),
    ("hand-edited text", _edited, "trajectory_id"),
]


def _clean_chain(out: Path, model: Path) -> None:
    kb = load_kb()
    eps = [new_episode(twenty_questions(20), task, derive_seed("bounds", task.name, k)) for task in kb.split("train")[:4] for k in range(3)]
    play(eps, ScriptedAgent(lambda rng: Scripted(NoisyPolicy(0.4, 0.2, 0.1))), 0, "logged")
    write_table(to_table([e.to_row() for e in eps], "trajectories"), out / "trajectories.parquet", "trajectories")
    run_summarize(PARAMS, out / "trajectories.parquet", out)
    run_relabel(PARAMS, out / "trajectories.parquet", out / "summaries.parquet", out)
    run_regenerate(PARAMS, out / "trajectories.parquet", out / "relabels.parquet", model, out / "regen")
    run_label(PARAMS, [out / "trajectories.parquet", out / "regen" / "trajectories.parquet"], out)


@pytest.fixture(scope="module")
def clean(request, tiny_model_dir) -> Path:
    """A whole clean chain on scripted games: trajectories, summaries, relabels, regenerations,
    labels. Built once per tree (conftest.built) and shared: read only."""
    key = digest(*CODE, ROOT / "params.yaml", TINY, OVERRIDES, str(tiny_model_dir), inspect.getsource(_clean_chain))
    return built(request, "stage-boundaries-clean", key, lambda out: _clean_chain(out, tiny_model_dir))


def corrupt(src: Path, dst: Path, name: str, broken: list) -> tuple[Path, Path, dict[int, str]]:
    """dst/bad.parquet: src with rows 1, 3, ... broken by `broken` and row 0 repeated at the end;
    dst/good.parquet: src without those rows. Returns both and {bad row: field}."""
    rows = read_table(src, name).to_pylist()
    expected: dict[int, str] = {}
    bad = [dict(r) for r in rows]
    for k, (_, fault, field) in enumerate(broken):
        i = 1 + 2 * k
        bad[i] = fault({**rows[i], "messages": [dict(m) for m in rows[i]["messages"]]} if "messages" in rows[i] else dict(rows[i]))
        expected[i] = field
    key = "relabel_id" if name == "relabels" else "trajectory_id"
    bad.append(dict(rows[0]))
    expected[len(rows)] = key
    good = [r for i, r in enumerate(rows) if i not in expected]
    dst.mkdir(parents=True, exist_ok=True)
    write_table(to_table(bad, name), dst / "bad.parquet", name)
    write_table(to_table(good, name), dst / "good.parquet", name)
    return dst / "bad.parquet", dst / "good.parquet", expected


def check(out_bad: Path, out_good: Path, outputs: list[str], bad_file: Path, expected: dict[int, str], metrics: dict, faults) -> None:
    for name in outputs:
        assert (out_bad / name).read_bytes() == (out_good / name).read_bytes(), f"{name}: the bad rows changed the output"
    q = read_table(out_bad / "quarantine.parquet", "quarantine").to_pylist()
    mine = {r["row"]: r for r in q if r["source_file"] == str(bad_file)}
    assert {r: v["field"] for r, v in mine.items()} == expected, mine
    assert all(v["reason"] for v in mine.values())
    counts = metrics["inputs"][str(bad_file)]
    faults(bad_rows_injected=len(expected), rows_quarantined=counts["quarantined"], rows_lost=counts["rows_in"] - counts["kept"] - counts["quarantined"])
    assert counts["rows_in"] == counts["kept"] + counts["quarantined"] == read_table(bad_file).num_rows
    assert counts["quarantined"] == len(expected)


def test_summarize_quarantines_bad_trajectories(clean, tmp_path, faults):
    bad, good, expected = corrupt(clean / "trajectories.parquet", tmp_path, "trajectories", TRAJECTORY_FAULTS)
    m = run_summarize(PARAMS, bad, tmp_path / "a")
    run_summarize(PARAMS, good, tmp_path / "b")
    check(tmp_path / "a", tmp_path / "b", ["summaries.parquet"], bad, expected, m, faults)
    assert m["trajectories"] == m["inputs"][str(bad)]["kept"]  # one summary per kept row


def test_relabel_quarantines_bad_summaries_and_trajectories(clean, tmp_path, faults):
    bad, good, expected = corrupt(clean / "trajectories.parquet", tmp_path, "trajectories", TRAJECTORY_FAULTS)
    sbad, sgood, sexpected = corrupt(clean / "summaries.parquet", tmp_path / "s", "summaries", [("empty summary", lambda r: {**r, "summary": " "}, "summary")])
    m = run_relabel(PARAMS, bad, sbad, tmp_path / "a")
    run_relabel(PARAMS, good, sgood, tmp_path / "b")
    check(tmp_path / "a", tmp_path / "b", ["relabels.parquet"], bad, expected, m, faults)
    check(tmp_path / "a", tmp_path / "b", ["relabels.parquet"], sbad, sexpected, m, faults)


def test_regenerate_quarantines_bad_relabels_and_their_orphans(clean, tmp_path, tiny_model_dir, faults):
    broken = [("negative turn", lambda r: {**r, "branch_turn": -1}, "branch_turn"), ("bad mode", lambda r: {**r, "mode": "sideways"}, "mode")]
    bad, good, expected = corrupt(clean / "relabels.parquet", tmp_path, "relabels", broken)
    m = run_regenerate(PARAMS, clean / "trajectories.parquet", bad, tiny_model_dir, tmp_path / "a")
    run_regenerate(PARAMS, clean / "trajectories.parquet", good, tiny_model_dir, tmp_path / "b")
    check(tmp_path / "a", tmp_path / "b", ["trajectories.parquet"], bad, expected, m, faults)
    # A relabel whose trajectory was quarantined is quarantined too, naming it.
    tbad, _, _ = corrupt(clean / "trajectories.parquet", tmp_path / "t", "trajectories", TRAJECTORY_FAULTS)
    m = run_regenerate(PARAMS, tbad, clean / "relabels.parquet", tiny_model_dir, tmp_path / "c")
    q = read_table(tmp_path / "c" / "quarantine.parquet").to_pylist()
    orphans = [r for r in q if r["source_file"] == str(clean / "relabels.parquet")]
    assert orphans and all(r["field"] == "trajectory_id" and "quarantined" in r["reason"] for r in orphans)
    c = m["inputs"][str(clean / "relabels.parquet")]
    assert c["rows_in"] == c["kept"] + c["quarantined"] and c["quarantined"] == len(orphans)


def test_label_quarantines_bad_trajectories(clean, tmp_path, faults):
    bad, good, expected = corrupt(clean / "trajectories.parquet", tmp_path, "trajectories", TRAJECTORY_FAULTS)
    m = run_label(PARAMS, [bad], tmp_path / "a")
    run_label(PARAMS, [good], tmp_path / "b")
    check(tmp_path / "a", tmp_path / "b", ["labels.parquet"], bad, expected, m, faults)
    assert m["labels"] == m["inputs"][str(bad)]["kept"]


def test_standardize_quarantines_bad_labels_and_the_trajectories_left_without_one(clean, tmp_path, faults):
    broken = [("NaN reward", lambda r: {**r, "reward": math.nan}, "reward"), ("ok without reward", lambda r: {**r, "reward": None}, "reward")]
    bad, good, expected = corrupt(clean / "labels.parquet", tmp_path, "labels", broken)
    trajs = [clean / "trajectories.parquet", clean / "regen" / "trajectories.parquet"]
    m = run_standardize(PARAMS, trajs, bad, tmp_path / "a")
    run_standardize(PARAMS, trajs, good, tmp_path / "b")
    check(tmp_path / "a", tmp_path / "b", ["train.parquet", "export/train.parquet"], bad, expected, m, faults)
    # The trajectories whose label was quarantined are quarantined in turn, and nothing is lost.
    unlabelled = [r for r in read_table(tmp_path / "a" / "quarantine.parquet").to_pylist() if r["source_file"] in map(str, trajs)]
    assert len(unlabelled) == len(broken) and all("no usable label" in r["reason"] for r in unlabelled)
    rows_in = sum(m["inputs"][str(p)]["rows_in"] for p in trajs)
    assert rows_in == m["rows_out"] + m["rows_other_splits"] + len(unlabelled)
