"""Malformed stage inputs, table by table: each is a clear error naming the file, or its bad row
is quarantined with the row, field and reason; rows in = kept + quarantined, always."""
import json
import re
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import tiny_params, twenty_questions
from envs.twenty_questions.kb import load_kb
from envs.twenty_questions.env import Scripted
from envs.twenty_questions.policies import NoisyPolicy
from storage.parquet import META_NAME, META_VERSION, write_table
from storage.schema import MESSAGE, OPTIONAL_MESSAGE_KEYS, SCHEMAS, get_schema, to_table, trajectory_id
from storage.validate import RAW_CHARS, check_rows, read_checked
from tasks.params import Params
from tasks.regenerate import splice_all
from tasks.rollout import ScriptedAgent, derive_seed, new_episode, play

MB = 1_000_000
MESSAGES = [
    {"role": "system", "content": "You play twenty questions."},
    {"role": "user", "content": "Turn 1 of 20. Ask a yes-no question."},
    {"role": "assistant", "content": "REASON: Start broad.\nQUESTION: Is it an animal?"},
    {"role": "user", "content": "Answer: yes. Turn 2 of 20."},
    {"role": "assistant", "content": "REASON: Only Dog fits.\nQUESTION: Is it Dog?"},
    {"role": "user", "content": "Answer: yes. You found it."},
]
TURNS = [
    {"turn": 0, "reason": "Start broad.", "action": "Is it an animal?", "observation": "yes", "reward": -1.0},
    {"turn": 1, "reason": "Only Dog fits.", "action": "Is it Dog?", "observation": "yes", "reward": 0.0},
]
# A seller's API call, its result and its reply, as CarDealer logs them (two actions, as TURNS).
CALL = {"id": "call_0", "type": "function", "function": {"name": "search_car_by_brand_type", "arguments": {"car_brand": "Kia", "car_type": "SUV"}}}
TOOL_MESSAGES = [
    {"role": "system", "content": "You sell cars."},
    {"role": "user", "content": "Hello, I am looking for a car."},
    {"role": "assistant", "content": "REASON: Kia SUVs.\nAPI NAME: search_car_by_brand_type", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_0", "name": "search_car_by_brand_type", "content": "1. brand=Kia, type=SUV, msrp=$40000"},
    {"role": "assistant", "content": "REASON: It fits.\nRESPONSE: How about this Kia?\nCAR INDEX: 1"},
    {"role": "user", "content": "I will take it. Decision=Accept, Buy_Price=$40000"},
]


def with_message(i: int, base: list[dict] = MESSAGES, **change) -> list[dict]:
    return [{**m, **change} if j == i else m for j, m in enumerate(base)]


def with_call(**change) -> list[dict]:
    """TOOL_MESSAGES with the call changed (`function` keys are the function's)."""
    call = {**CALL, **{k: v for k, v in change.items() if k in CALL}, "function": {**CALL["function"], **change.get("function", {})}}
    return with_message(2, TOOL_MESSAGES, tool_calls=[call])


def as_shown(row: dict) -> dict:
    """A row as a quarantined row's raw JSON shows it: stored, without the message keys it left out
    (an export's messages are JSON text)."""
    if "messages" not in row:
        return row
    return {**row, "messages": [{k: v for k, v in m.items() if v is not None or k not in OPTIONAL_MESSAGE_KEYS} if isinstance(m, dict) else m
                                for m in row["messages"]]}


def with_turn(i: int, **change) -> list[dict]:
    return [{**t, **change} if j == i else t for j, t in enumerate(TURNS)]


def traj(i: int = 0, **change) -> dict:
    """A trajectory row as collect writes it, its ID the hash of its content (after `change`)."""
    row = {
        "env": "twenty_questions", "task_id": f"task{i}", "split": "train", "source": "policy", "parent_id": None,
        "branch_turn": None, "relabel_id": None, "policy_id": "tiny", "seed": i, "messages": MESSAGES, "turns": TURNS,
        "return": -1.0, "success": True, "num_turns": 2,
    }
    row.update(change)
    return {"trajectory_id": trajectory_id(row), **row}


def regeneration(i: int = 0, **change) -> dict:
    lineage = {"source": "regeneration", "parent_id": "0123456789abcdef", "branch_turn": 1, "relabel_id": "fedcba9876543210"}
    return traj(i, **(lineage | change))


def summary(i: int = 0, **change) -> dict:
    return {
        "trajectory_id": f"t{i}", "task_id": "Dog", "summary": "Asked about animals, then guessed Dog.", "status": "ok",
        "reason": None, "role": "summarizer", "backend": "oracle", "model": "oracle-1", "prompt_hash": "abc", **change,
    }


def relabel(i: int = 0, **change) -> dict:
    return {
        "relabel_id": f"r{i}", "trajectory_id": "t0", "task_id": "Dog", "split": "train", "mode": "hope", "branch_turn": 0,
        "rank": i, "original_text": MESSAGES[2]["content"], "original_action": "Is it an animal?",
        "counterfactual_text": "REASON: Dogs bark.\nQUESTION: Does it bark?", "counterfactual_action": "Does it bark?",
        "player_reason": "Dogs bark.", "rationale": "The secret is Dog.", "status": "ok", "reason": None,
        "proposer": "oracle", "prompt_hash": "abc", **change,
    }


def label(i: int = 0, **change) -> dict:
    return {
        "trajectory_id": f"t{i}", "task_id": "Dog", "source": "policy", "env_reward": -1.0, "env_success": True,
        "reward": -1.0, "labeler": "oracle", "model": "oracle-1", "prompt_hash": "abc", "scores": None, "status": "ok",
        "reason": "", **change,
    }


def training(i: int = 0, **change) -> dict:
    return {
        "trajectory_id": f"t{i}", "task_id": "Dog", "split": "train", "source": "policy", "parent_id": None,
        "relabel_id": None, "messages": MESSAGES, "reward": -1.0, "standardized_reward": 0.5, "weight": 0.5,
        "group_size": 3, "group_mean": -2.0, "group_std": 1.0, "standardize_status": "ok", **change,
    }


def export(i: int = 0, **change) -> dict:
    return {
        "messages": MESSAGES, "reward": -1.0, "standardized_reward": 0.5, "weight": 0.5, "trajectory_id": f"t{i}",
        "task_id": "Dog", "source": "policy", "tools": None, **change,
    }


def quarantined(i: int = 0, **change) -> dict:
    return {"source_file": "logs.jsonl", "row": i, "field": "seed", "reason": "expected an integer", "raw": "{}", **change}


def pair(i: int = 0, **change) -> dict:
    return {
        "key": f"k{i}", "prompt": MESSAGES[:2], "action": MESSAGES[2], "turn": 0, "target_raw": -1.0, "target": 0.6,
        "count": 2, "source": "on-policy", "trajectory_ids": [f"t{i}", "t9"], "selected": True, **change,
    }


def preference(i: int = 0, **change) -> dict:
    return {
        "key": f"s{i}", "round": 0, "trajectory_id": f"t{i}", "turn": 1, "prompt": MESSAGES[:2], "chosen": MESSAGES[2],
        "rejected": {"role": "assistant", "content": "REASON: x\nQUESTION: Is it a car?"}, "chosen_score": 0.7, "rejected_score": 0.2,
        "source": "policy", **change,
    }


def practised(i: int = 0, **change) -> dict:
    return {
        "pair_id": f"p{i}", "trajectory_id": "t0", "task_id": "Dog", "split": "train", "step": 0, "sample": i, "prompt": MESSAGES[:2],
        "expert": MESSAGES[2], "agent": {"role": "assistant", "content": "REASON: x\nQUESTION: Is it a car?"}, "expert_action": "Is it an animal?",
        "agent_action": "Is it a car?", "equal": False, "identical": False, "status": "ok", "reason": None, "expert_logp": -1.5,
        "agent_logp": -4.0, "policy_id": "model@abc", "seed": i, **change,
    }


def dropped(i: int = 0, **change) -> dict:
    return {
        "relabel_id": f"r{i}", "parent_id": f"t{i}", "task_id": "donor-train-000", "branch_turn": 1, "forward_model": "model",
        "status": "unfinished", "reason": "the continuation stops at turn 3 before the donor decides", "text": "AI: Hi\nH: Hello", **change,
    }


def transition(i: int = 0, **change) -> dict:
    return {
        "transition_id": f"x{i}", "trajectory_id": "t0", "task_id": "Dog", "split": "train", "step": 0, "state": MESSAGES[:2], "action": MESSAGES[2],
        "observation": MESSAGES[3:4], "turns": TURNS[:1], "reward": -1.0, "terminal": False, "return": -2.0, "priority": 1.0, "added": 1,
        "trained": 0, "policy_id": "model@abc", **change,
    }


def nlac_sample(i: int = 0, **change) -> dict:
    return {
        "step": i, "transition_id": "x0", "weight": 1.0, "priority": 1.0, "target": "Future:\nIt ends well.\nOptimality:\nYes", "target_status": "ok",
        "future": None, "action": "REASON: x\nQUESTION: Is it a car?", "action_source": "fresh", "critique": None, "critique_status": "invalid",
        "optimal": None, "refined": "REASON: x\nQUESTION: Is it an animal?", "refined_status": "ok", "changed": True, "l1": 2.5, "l2": None, **change,
    }


GOOD = {
    "trajectories": traj, "summaries": summary, "relabels": relabel, "labels": label, "training": training,
    "export": export, "quarantine": quarantined, "pairs": pair, "preferences": preference, "practice": practised, "dropped": dropped,
    "nlac_buffer": transition, "nlac_samples": nlac_sample,
}


def test_every_table_kind_has_a_corpus():
    assert set(GOOD) == set(SCHEMAS)


def rows_with(name: str, bad: dict) -> list[dict]:
    """Three rows of table `name`; the middle one is `bad`."""
    return [GOOD[name](0), bad, GOOD[name](2)]


def write(path: Path, name: str, rows: list[dict] | pa.Table) -> Path:
    write_table(rows if isinstance(rows, pa.Table) else to_table(rows, name), path, name)
    return path


def checked(path: Path, name: str) -> tuple[pa.Table, pa.Table]:
    kept, quarantine = read_checked(path, name)
    assert kept.num_rows + quarantine.num_rows == pq.ParquetFile(path).metadata.num_rows  # rows in = kept + quarantined
    assert kept.schema.equals(get_schema(name).schema) and quarantine.schema.equals(get_schema("quarantine").schema)
    return kept, quarantine


@pytest.mark.parametrize("name", sorted(GOOD))
def test_good_tables_keep_every_row_in_order(tmp_path, name):
    rows = [GOOD[name](i) for i in range(3)]
    if name == "trajectories":
        rows += [regeneration(3), traj(4, messages=with_message(2, content="é" * 60_000))]  # 120 kB, 60,000 characters
        # Tool calls: one, and two in one message answered in the other order.
        second = {**CALL, "id": "call_1", "function": {"name": "search_car_by_brand", "arguments": {"car_brand": "Kia"}}}
        two = [*TOOL_MESSAGES[:2], {**TOOL_MESSAGES[2], "tool_calls": [CALL, second]}, {**TOOL_MESSAGES[3], "tool_call_id": "call_1", "name": "search_car_by_brand"},
               TOOL_MESSAGES[3], *TOOL_MESSAGES[4:]]
        rows += [traj(5, messages=TOOL_MESSAGES), traj(6, messages=two)]
    kept, quarantine = checked(write(tmp_path / "t.parquet", name, rows), name)
    assert quarantine.num_rows == 0
    assert kept.to_pylist() == to_table(rows, name).to_pylist()


@pytest.mark.parametrize("name", sorted(GOOD))
def test_an_empty_table_is_fine(tmp_path, name):
    kept, quarantine = checked(write(tmp_path / "t.parquet", name, []), name)
    assert kept.num_rows == quarantine.num_rows == 0


def test_rows_the_pipeline_writes_pass(tmp_path):
    """Scripted collect rows and regenerations spliced from them, as collect and regenerate write them."""
    kb, params = load_kb(), Params.model_validate(tiny_params())
    episodes = [new_episode(twenty_questions(20), task, derive_seed("bad-input", task.name)) for task in kb.split("train")[:3]]
    play(episodes, ScriptedAgent(lambda rng: Scripted(NoisyPolicy(0.4, 0.2, 0.1))), 0, "bad-input")
    parents = [e.to_row() for e in episodes]
    counterfactual = {"relabel_id": "r0", "branch_turn": 0, "counterfactual_text": "REASON: broad.\nQUESTION: Is it an animal?"}
    children = splice_all(params, [(p, counterfactual) for p in parents])
    play(children, ScriptedAgent(lambda rng: Scripted(NoisyPolicy(0.4, 0.2, 0.1))), 1, "bad-input")
    rows = parents + [c.to_row() for c in children]
    kept, quarantine = check_rows(to_table(rows, "trajectories"), "trajectories", "memory")
    assert quarantine.to_pylist() == [] and kept.num_rows == 6


T, S, R, L, TR, E, Q, P, PR = "trajectories", "summaries", "relabels", "labels", "training", "export", "quarantine", "pairs", "preferences"
edited = traj(1)
edited["messages"] = with_message(2, content="REASON: edited.\nQUESTION: Is it an animal?")  # by hand: the ID is stale

# name: (table, the bad middle row, field, reason)
ROW_FAULTS = {
    # trajectories
    "empty messages": (T, traj(1, messages=[], turns=[], num_turns=0), "messages", r"^empty list$"),
    "no assistant message": (T, traj(1, messages=MESSAGES[:2], turns=[], num_turns=0), "messages", r"^no assistant message$"),
    "unknown role": (T, traj(1, messages=with_message(1, role="function")), "messages[1].role", r"^'function' is not one of system, user, assistant, tool$"),
    "assistant first": (T, traj(1, messages=MESSAGES[2:]), "messages[0].role", r"^expected 'system' or 'user' first, got 'assistant'$"),
    "system later": (T, traj(1, messages=with_message(3, role="system")), "messages[3].role", r"^expected 'user' after 'assistant', got 'system' \(system messages may only come first\)$"),
    "two user messages": (T, traj(1, messages=with_message(2, role="user")), "messages[2].role", r"^expected 'assistant' after 'user', got 'user'$"),
    "two assistant messages": (T, traj(1, messages=with_message(3, role="assistant")), "messages[3].role", r"^expected 'user' after 'assistant', got 'assistant'$"),
    "empty content": (T, traj(1, messages=with_message(4, content=" \n")), "messages[4].content", r"^empty string$"),
    "1 MB message": (T, traj(1, messages=with_message(2, content="x" * MB)), "messages[2].content", r"^1,000,000 characters, over the limit of 100,000$"),
    "1 MB turn": (T, traj(1, turns=with_turn(1, observation="y" * MB)), "turns[1].observation", r"^1,000,000 characters, over the limit of 100,000$"),
    "long non-ASCII text": (T, traj(1, messages=with_message(4, content="é" * 100_001)), "messages[4].content", r"^100,001 characters, over"),
    "NaN return": (T, traj(1, **{"return": float("nan")}), "return", r"^nan is not a finite number$"),
    "inf return": (T, traj(1, **{"return": float("inf")}), "return", r"^inf is not a finite number$"),
    "NaN turn reward": (T, traj(1, turns=with_turn(0, reward=float("nan"))), "turns[0].reward", r"^nan is not a finite number$"),
    "-inf turn reward": (T, traj(1, turns=with_turn(1, reward=float("-inf"))), "turns[1].reward", r"^-inf is not a finite number$"),
    "num_turns off": (T, traj(1, num_turns=3), "num_turns", r"^3, but messages hold 2 assistant messages$"),
    "a turn missing": (T, traj(1, turns=TURNS[:1]), "turns", r"^1 turns for 2 assistant messages \(one each expected\)$"),
    "bad split": (T, traj(1, split="training"), "split", r"^'training' is not one of train, val, test$"),
    "bad source": (T, traj(1, source="human"), "source", r"^'human' is not one of policy, import, regeneration$"),
    "empty task_id": (T, traj(1, task_id="  "), "task_id", r"^empty string$"),
    "policy row with a parent": (T, traj(1, parent_id="0123456789abcdef"), "parent_id", r"^set on a 'policy' row \(only regenerations have one\)$"),
    "regeneration without parent": (T, regeneration(1, parent_id=None), "parent_id", r"^null on a regeneration row"),
    "branch past the end": (T, regeneration(1, branch_turn=2), "branch_turn", r"^2 is outside 0\.\.1"),
    "edited by hand": (T, edited, "trajectory_id", rf"^'{edited['trajectory_id']}' is not the content hash of the row \('[0-9a-f]{{16}}'\)"),
    "duplicate trajectory": (T, traj(0), "trajectory_id", rf"^duplicate of row 0 \(same trajectory_id '{traj(0)['trajectory_id']}'\)$"),
    # trajectories with tool calls
    "tool result after a plain reply": (T, traj(1, messages=with_message(2, TOOL_MESSAGES, tool_calls=None)), "messages[3].role",
                                        r"^expected 'user' after 'assistant', got 'tool' \(tool messages answer an assistant message's tool_calls\)$"),
    "call without its result": (T, traj(1, messages=TOOL_MESSAGES[:3] + TOOL_MESSAGES[4:]), "messages[3].role",
                                r"^expected 'tool' after an assistant message with tool_calls, got 'assistant'$"),
    "call at the end": (T, traj(1, messages=TOOL_MESSAGES[:3], turns=TURNS[:1], num_turns=1), "messages[2].tool_calls[0].id",
                        r"^call 'call_0' is not answered by a tool message after it$"),
    "result naming another call": (T, traj(1, messages=with_message(3, TOOL_MESSAGES, tool_call_id="call_9")), "messages[3].tool_call_id",
                                   r"^'call_9' is not the id of a call of the assistant message it follows \(its calls: call_0\)$"),
    "result naming no call": (T, traj(1, messages=with_message(3, TOOL_MESSAGES, tool_call_id=None)), "messages[3].tool_call_id",
                              r"^null on a tool message \(it names the call it answers\)$"),
    "two results for one call": (T, traj(1, messages=TOOL_MESSAGES[:4] + TOOL_MESSAGES[3:]), "messages[4].tool_call_id", r"^a second answer to call 'call_0'$"),
    "two calls, one id": (T, traj(1, messages=with_message(2, TOOL_MESSAGES, tool_calls=[CALL, CALL])), "messages[2].tool_calls[1].id",
                          r"^'call_0' is the id of another call of this message$"),
    "result named for another function": (T, traj(1, messages=with_message(3, TOOL_MESSAGES, name="search_car_by_type")), "messages[3].name",
                                          r"^'search_car_by_type', but call 'call_0' is to 'search_car_by_brand_type'$"),
    "tool_call_id on a user message": (T, traj(1, messages=with_message(5, TOOL_MESSAGES, tool_call_id="call_0")), "messages[5].tool_call_id",
                                       r"^set on a non-tool message"),
    "tool calls on a user message": (T, traj(1, messages=with_message(1, TOOL_MESSAGES, tool_calls=[CALL])), "messages[1].tool_calls",
                                     r"^set on a non-assistant message \(only the assistant makes tool calls\)$"),
    "empty tool_calls": (T, traj(1, messages=with_message(4, TOOL_MESSAGES, tool_calls=[])), "messages[4].tool_calls", r"^empty list"),
    "arguments not JSON": (T, traj(1, messages=with_call(function={"arguments": '{"car_brand": "Kia"'})), "messages[2].tool_calls[0].function.arguments",
                           r"^not JSON \(Expecting ',' delimiter"),
    "arguments not an object": (T, traj(1, messages=with_call(function={"arguments": '["Kia", "SUV"]'})), "messages[2].tool_calls[0].function.arguments",
                                r"^JSON list, expected an object$"),
    "blank function name": (T, traj(1, messages=with_call(function={"name": " "})), "messages[2].tool_calls[0].function.name", r"^empty string$"),
    "unknown call type": (T, traj(1, messages=with_call(type="code")), "messages[2].tool_calls[0].type", r"^'code' is not one of function$"),
    "blank call id": (T, traj(1, messages=with_call(id="")), "messages[2].tool_calls[0].id", r"^empty string$"),
    "tool row edited by hand": (T, {**traj(1, messages=TOOL_MESSAGES), "messages": with_call(function={"arguments": {"car_brand": "Kia"}})},
                                "trajectory_id", r"is not the content hash of the row"),
    # summaries
    "duplicate summary": (S, summary(0), "trajectory_id", r"^duplicate of row 0 \(same trajectory_id 't0'\)$"),
    "unknown summary status": (S, summary(1, status="done"), "status", r"^'done' is not one of ok, invalid, failed, unfinished$"),
    "ok without summary": (S, summary(1, summary=None), "summary", r"^empty on a row with status 'ok'$"),
    "failed without reason": (S, summary(1, summary=None, status="failed"), "reason", r"^empty on a row whose status is not 'ok'"),
    "empty prompt_hash": (S, summary(1, prompt_hash=""), "prompt_hash", r"^empty string$"),
    "1 MB summary": (S, summary(1, summary="z" * MB), "summary", r"^1,000,000 characters, over the limit"),
    # relabels
    "duplicate relabel": (R, relabel(0), "relabel_id", r"^duplicate of row 0 \(same relabel_id 'r0'\)$"),
    "unknown mode": (R, relabel(1, mode="greedy"), "mode", r"^'greedy' is not one of hope, hr$"),
    "unknown relabel split": (R, relabel(1, split="dev"), "split", r"^'dev' is not one of train, val, test$"),
    "ok without counterfactual": (R, relabel(1, counterfactual_text=None), "counterfactual_text", r"^empty on a row with status 'ok'$"),
    "ok without branch turn": (R, relabel(1, branch_turn=None), "branch_turn", r"^null on a row with status 'ok'"),
    "negative rank": (R, relabel(1, rank=-1), "rank", r"^-1 is negative$"),
    "invalid without reason": (R, relabel(1, status="invalid", counterfactual_text=None), "reason", r"^empty on a row whose status is not 'ok'"),
    "empty proposer": (R, relabel(1, proposer=""), "proposer", r"^empty string$"),
    # pairs (the buffer)
    "target above 1": (P, pair(1, target=1.2), "target", r"^1\.2 is outside \[0, 1\]$"),
    "NaN target": (P, pair(1, target=float("nan")), "target", r"^nan is not a finite number$"),
    "count disagrees": (P, pair(1, count=3), "count", r"^3, but trajectory_ids names 2$"),
    "no trajectory behind": (P, pair(1, count=0, trajectory_ids=[]), "trajectory_ids", r"^empty list$"),
    "unknown pair source": (P, pair(1, source="regeneration"), "source", r"^'regeneration' is not one of on-policy, hindsight$"),
    "action not the agent's": (P, pair(1, action=MESSAGES[1]), "action.role", r"^'user' is not one of assistant$"),
    "duplicate pair": (P, pair(0), "key", r"^duplicate of row 0"),
    # preferences (the actor's pairs)
    "chosen not above rejected": (PR, preference(1, chosen_score=0.2), "chosen_score", r"^0\.2, not above rejected_score 0\.2$"),
    "score above 1": (PR, preference(1, chosen_score=1.5), "chosen_score", r"^1\.5 is outside \[0, 1\]$"),
    "NaN rejected score": (PR, preference(1, rejected_score=float("nan")), "rejected_score", r"^nan is not a finite number$"),
    "negative round": (PR, preference(1, round=-1), "round", r"^-1 is negative$"),
    "unknown preference source": (PR, preference(1, source="oracle"), "source", r"^'oracle' is not one of policy, proposer$"),
    "rejected not the agent's": (PR, preference(1, rejected=MESSAGES[1]), "rejected.role", r"^'user' is not one of assistant$"),
    "duplicate state": (PR, preference(0), "key", r"^duplicate of row 0"),
    # practice (StepAgent's pairs)
    "negative step": ("practice", practised(1, step=-1), "step", r"^-1 is negative$"),
    "unknown practice status": ("practice", practised(1, status="done"), "status", r"^'done' is not one of ok, failed$"),
    "a failed sample called equal": ("practice", practised(1, status="failed", equal=True), "equal", r"^true on a row whose status is 'failed'$"),
    "agent not the agent's": ("practice", practised(1, agent=MESSAGES[1]), "agent.role", r"^'user' is not one of assistant$"),
    "NaN log-probability": ("practice", practised(1, agent_logp=float("nan")), "agent_logp", r"^nan is not a finite number$"),
    "duplicate practice pair": ("practice", practised(0), "pair_id", r"^duplicate of row 0"),
    # labels
    "NaN label reward": (L, label(1, reward=float("nan")), "reward", r"^nan is not a finite number$"),
    "-inf env reward": (L, label(1, env_reward=float("-inf")), "env_reward", r"^-inf is not a finite number$"),
    "duplicate label": (L, label(0), "trajectory_id", r"^duplicate of row 0 \(same trajectory_id 't0'\)$"),
    "unknown label status": (L, label(1, status="done"), "status", r"^'done' is not one of ok, invalid, failed, unfinished$"),
    "unknown label source": (L, label(1, source="human"), "source", r"^'human' is not one of policy, import, regeneration$"),
    "ok without reward": (L, label(1, reward=None), "reward", r"^null on a row with status 'ok'$"),
    "failed with a reward": (L, label(1, status="failed", reason="timeout"), "reward", r"^-1\.0 on a row with status 'failed'"),
    "failed label without reason": (L, label(1, status="failed", reward=None), "reason", r"^empty on a row whose status is not 'ok'"),
    "empty model": (L, label(1, model=" "), "model", r"^empty string$"),
    # training
    "NaN weight": (TR, training(1, weight=float("nan")), "weight", r"^nan is not a finite number$"),
    "inf standardized reward": (TR, training(1, standardized_reward=float("inf")), "standardized_reward", r"^inf is not a finite number$"),
    "NaN group std": (TR, training(1, group_std=float("nan")), "group_std", r"^nan is not a finite number$"),
    "weight above 1": (TR, training(1, weight=1.5), "weight", r"^1\.5 is outside \[0, 1\]"),
    "negative group size": (TR, training(1, group_size=-1), "group_size", r"^-1 is negative$"),
    "unknown standardize status": (TR, training(1, standardize_status="weird"), "standardize_status", r"^'weird' is not one of ok, tied, singleton, no_reward$"),
    "no_reward with a reward": (TR, training(1, standardize_status="no_reward", standardized_reward=None, weight=None), "reward", r"^set on a row whose standardize_status is 'no_reward'$"),
    "ok without standardized reward": (TR, training(1, standardized_reward=None), "standardized_reward", r"^null on a row whose standardize_status is not 'no_reward'$"),
    "training messages empty": (TR, training(1, messages=[]), "messages", r"^empty list$"),
    "training role order": (TR, training(1, messages=with_message(1, role="assistant")), "messages[1].role", r"^expected 'system' or 'user' after 'system', got 'assistant'$"),
    "training call without its result": (TR, training(1, messages=TOOL_MESSAGES[:3] + TOOL_MESSAGES[4:]), "messages[3].role", r"^expected 'tool' after"),
    "duplicate training row": (TR, training(0), "trajectory_id", r"^duplicate of row 0"),
    # export
    "inf export reward": (E, export(1, reward=float("inf")), "reward", r"^inf is not a finite number$"),
    "export role order": (E, export(1, messages=with_message(5, role="assistant")), "messages[5].role", r"^expected 'user' after 'assistant', got 'assistant'$"),
    "export result naming another call": (E, export(1, messages=with_message(3, TOOL_MESSAGES, tool_call_id="call_1")), "messages[3].tool_call_id", r"^'call_1' is not the id"),
    "duplicate export row": (E, export(0), "trajectory_id", r"^duplicate of row 0"),
    "export tools not JSON": (E, export(1, tools="[{"), "tools", r"^not JSON "),
    "export tools not a list": (E, export(1, tools='{"type": "function"}'), "tools", r"^JSON dict, expected a list of tool objects$"),
    # quarantine
    "quarantine without reason": (Q, quarantined(1, reason=""), "reason", r"^empty string$"),
}


@pytest.mark.parametrize("name, bad, field, reason", ROW_FAULTS.values(), ids=ROW_FAULTS.keys())
def test_a_bad_row_is_quarantined_with_row_field_and_reason(tmp_path, name, bad, field, reason, faults):
    rows = rows_with(name, bad)
    path = write(tmp_path / f"{name}.parquet", name, rows)
    kept, quarantine = checked(path, name)
    faults(bad_rows_injected=1, rows_quarantined=quarantine.num_rows, rows_lost=len(rows) - kept.num_rows - quarantine.num_rows)
    [q] = quarantine.to_pylist()
    assert (q["source_file"], q["row"], q["field"]) == (str(path), 1, field)
    assert re.search(reason, q["reason"]), q["reason"]
    assert kept.to_pylist() == to_table([rows[0], rows[2]], name).to_pylist()  # the others kept, in order
    assert q["raw"] == json.dumps(as_shown(to_table([bad], name).to_pylist()[0]), ensure_ascii=False)[:RAW_CHARS]  # a 1 MB row is cut


def test_every_problem_in_a_table_is_found_and_only_the_first_per_row(tmp_path):
    rows = [traj(0), traj(1, split="dev", **{"return": float("nan")}), traj(2), traj(0), traj(4, messages=[], turns=[], num_turns=0)]
    kept, quarantine = checked(write(tmp_path / "t.parquet", T, rows), T)
    assert quarantine.select(["row", "field"]).to_pylist() == [
        {"row": 1, "field": "split"},  # the enum check comes before the float check
        {"row": 3, "field": "trajectory_id"},
        {"row": 4, "field": "messages"},
    ]
    assert kept.column("task_id").to_pylist() == ["task0", "task2"]


def test_a_duplicate_of_a_quarantined_row_is_kept(tmp_path):
    """The first copy is bad, so the second is the only one kept, not a duplicate."""
    rows = [traj(0, num_turns=5), traj(1), traj(0, num_turns=5)]
    rows[2]["num_turns"] = 2
    kept, quarantine = checked(write(tmp_path / "t.parquet", T, rows), T)
    assert quarantine.select(["row", "field"]).to_pylist() == [{"row": 0, "field": "num_turns"}]
    assert kept.column("task_id").to_pylist() == ["task1", "task0"]


# --- invalid UTF-8: pyarrow writes and reads it without complaint ---------------------------------


def with_bytes(values: pa.Array, index: int, raw: bytes) -> pa.Array:
    """A string array with element `index` replaced by bytes that need not be UTF-8."""
    items = values.cast(pa.binary()).to_pylist()
    items[index] = raw
    return pa.array(items, pa.binary()).view(pa.string())


def with_message_bytes(table: pa.Table, row: int, message: int, raw: bytes) -> pa.Table:
    messages = table.column("messages").combine_chunks()
    items = messages.flatten()
    content = with_bytes(items.field("content"), messages.offsets[row].as_py() + message, raw)
    items = pa.StructArray.from_arrays([items.field("role"), content, *(items.field(f.name) for f in list(MESSAGE)[2:])], fields=list(MESSAGE))
    return table.set_column(
        table.schema.get_field_index("messages"), table.schema.field("messages"),
        pa.ListArray.from_arrays(messages.offsets, items, type=messages.type),
    )


def with_column_bytes(table: pa.Table, column: str, row: int, raw: bytes) -> pa.Table:
    i = table.schema.get_field_index(column)
    return table.set_column(i, table.schema.field(i), with_bytes(table.column(column).combine_chunks(), row, raw))


UTF8_FAULTS = {
    "message content": (T, lambda t: with_message_bytes(t, 1, 2, b"Is \xff it?"), "messages[2].content", "invalid start byte at byte 3"),
    "summary": (S, lambda t: with_column_bytes(t, "summary", 1, b"caf\xc3"), "summary", "unexpected end of data at byte 3"),
    "label task_id": (L, lambda t: with_column_bytes(t, "task_id", 1, b"\xe0ig"), "task_id", "invalid continuation byte at byte 0"),
    "training content": (TR, lambda t: with_message_bytes(t, 1, 5, b"\xed\xa0\x80"), "messages[5].content", "invalid continuation byte at byte 0"),
}


@pytest.mark.parametrize("name, corrupt, field, reason", UTF8_FAULTS.values(), ids=UTF8_FAULTS.keys())
def test_invalid_utf8_is_quarantined_with_its_field(tmp_path, name, corrupt, field, reason):
    rows = [GOOD[name](i) for i in range(3)]
    path = write(tmp_path / "t.parquet", name, corrupt(to_table(rows, name)))
    with pytest.raises(UnicodeDecodeError):
        pq.read_table(path).to_pylist()  # the fault is really in the file
    kept, quarantine = checked(path, name)
    [q] = quarantine.to_pylist()
    assert (q["row"], q["field"], q["reason"]) == (1, field, f"invalid UTF-8: {reason}")
    assert "\ufffd" in q["raw"]
    assert kept.to_pylist() == to_table([rows[0], rows[2]], name).to_pylist()


def test_invalid_utf8_is_reported_before_anything_else_in_its_row(tmp_path):
    rows = [traj(0), traj(1, **{"return": float("nan")}), traj(2)]
    path = write(tmp_path / "t.parquet", T, with_column_bytes(to_table(rows, T), "policy_id", 1, b"\xff"))
    _, quarantine = checked(path, T)
    assert quarantine.select(["row", "field"]).to_pylist() == [{"row": 1, "field": "policy_id"}]


# --- the export's messages: JSON text, checked as the chat messages they hold ---------------------


EXPORT_JSON_FAULTS = {
    "not JSON": ('{"role": "user", "content": "hi"', "messages[1]", r"^not JSON \(Expecting ',' delimiter"),
    "not an object": ('["user", "hi"]', "messages[1]", r"^JSON list, expected a message object$"),
    "unknown key": ('{"role": "user", "content": "hi", "mood": "happy"}', "messages[1]", r"^unknown key 'mood'$"),
    "content a number": ('{"role": "user", "content": 7}', "messages[1].content", r"^expected string, got int 7$"),
    "blank content": ('{"role": "user", "content": " "}', "messages[1].content", r"^empty string$"),
    "tool result out of place": ('{"role": "tool", "content": "1. Kia", "tool_call_id": "call_0"}', "messages[1].role", r"^expected 'system' or 'user' after 'system', got 'tool'"),
}


@pytest.mark.parametrize("text, field, reason", EXPORT_JSON_FAULTS.values(), ids=EXPORT_JSON_FAULTS.keys())
def test_an_export_message_that_is_not_a_chat_message_is_quarantined(tmp_path, text, field, reason):
    table = to_table([export(0), export(1), export(2)], E)
    items = table.column("messages").combine_chunks()
    texts = items.values.storage.to_pylist()
    texts[items.offsets[1].as_py() + 1] = text  # row 1, message 1
    bad = pa.ListArray.from_arrays(items.offsets, pa.ExtensionArray.from_storage(pa.json_(), pa.array(texts, pa.string())), type=items.type)
    kept, quarantine = checked(write(tmp_path / "e.parquet", E, table.set_column(0, table.schema.field(0), bad)), E)
    [q] = quarantine.to_pylist()
    assert (q["row"], q["field"]) == (1, field) and re.search(reason, q["reason"]), q
    assert kept.column("trajectory_id").to_pylist() == ["t0", "t2"]


# --- file-level faults: an error naming the file ------------------------------------------------


def good_table(name: str) -> pa.Table:
    return to_table([GOOD[name](i) for i in range(3)], name)


def hand_written(path: Path, table: pa.Table, metadata: dict | None) -> Path:
    pq.write_table(table.replace_schema_metadata(metadata), path)
    return path


def stamp(name: str, version: str = "") -> dict:
    return {META_NAME: name.encode(), META_VERSION: (version or str(get_schema(name).version)).encode()}


def cut(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])
    return path


def flipped(path: Path) -> Path:
    """The first data page's bytes inverted; the footer still reads."""
    data = path.read_bytes()
    path.write_bytes(data[:40] + bytes(b ^ 0xFF for b in data[40:60]) + data[60:])
    return path


def text_file(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def first_string_column(name: str) -> str:
    return next(f.name for f in get_schema(name).schema if f.type == pa.string())


def other_table(name: str) -> str:
    return "labels" if name != "labels" else "trajectories"


# name: (make the file from (path, table name), the error after "PATH: ")
FILE_FAULTS = {
    "truncated": (lambda p, n: cut(write(p, n, good_table(n))), lambda n: r"not a readable Parquet file"),
    "corrupt page": (lambda p, n: flipped(write(p, n, good_table(n))), lambda n: r"not a readable Parquet file"),
    "not Parquet": (lambda p, n: text_file(p, "trajectory_id,task_id\n"), lambda n: r"not a readable Parquet file"),
    "no metadata": (lambda p, n: hand_written(p, good_table(n), None), lambda n: r"no retrosight schema metadata"),
    "unknown version": (
        lambda p, n: hand_written(p, good_table(n), stamp(n, "99")),
        lambda n: rf"'{n}' schema version 99 is not supported \(this build reads version \d+\)",
    ),
    "unknown schema name": (lambda p, n: hand_written(p, good_table(n), stamp(n) | {META_NAME: b"rewards"}), lambda n: r"unknown table schema 'rewards'"),
    "another table": (lambda p, n: write(p, other_table(n), good_table(other_table(n))), lambda n: rf"expected a '{n}' table, found '{other_table(n)}'"),
    "missing column": (
        lambda p, n: hand_written(p, good_table(n).drop_columns([first_string_column(n)]), stamp(n)),
        lambda n: rf"columns differ from '{n}' schema version \d+: lacks column '{first_string_column(n)}'",
    ),
    "wrong type": (
        lambda p, n: hand_written(p, good_table(n).set_column(get_schema(n).schema.get_field_index(first_string_column(n)), first_string_column(n), pa.array([1, 2, 3])), stamp(n)),
        lambda n: rf"columns differ from '{n}' schema version \d+: column '{first_string_column(n)}' is int64, expected string",
    ),
    "nullable columns (written by another tool)": (
        lambda p, n: hand_written(p, pa.Table.from_pylist(good_table(n).to_pylist()), stamp(n)),
        lambda n: rf"columns differ from '{n}' schema version \d+: column '.+' is ",
    ),
}


@pytest.mark.parametrize("name", sorted(GOOD))
@pytest.mark.parametrize("make, error", FILE_FAULTS.values(), ids=FILE_FAULTS.keys())
def test_an_unusable_file_is_an_error_naming_it(tmp_path, name, make, error):
    path = make(tmp_path / f"{name}.parquet", name)
    with pytest.raises(ValueError, match=re.escape(f"{path}: ") + error(name)):
        read_checked(path, name)


# --- tables in memory -----------------------------------------------------------------------------


def test_in_memory_nulls_in_required_fields_are_quarantined():
    # Arrow does not enforce nullability, so a table built in memory can hold such nulls (a file cannot).
    rows = [traj(0), traj(1), traj(2), traj(3)]
    rows[1]["task_id"] = None
    rows[2]["messages"] = with_message(1, content=None)
    rows[3]["turns"] = None
    kept, quarantine = check_rows(pa.Table.from_pylist(rows, schema=get_schema(T).schema), T, "memory")
    assert quarantine.select(["source_file", "row", "field", "reason"]).to_pylist() == [
        {"source_file": "memory", "row": 1, "field": "task_id", "reason": "null in a required field"},
        {"source_file": "memory", "row": 2, "field": "messages[1].content", "reason": "null in a required field"},
        {"source_file": "memory", "row": 3, "field": "turns", "reason": "null in a required field"},
    ]
    assert kept.num_rows == 1


def test_in_memory_tables_are_cast_when_the_types_fit():
    frame = pl.DataFrame([traj(0), traj(1, seed=None)])  # polars: large strings, nullable everything
    kept, quarantine = check_rows(frame.to_arrow(), T, "frame")
    assert kept.schema.equals(get_schema(T).schema) and kept.num_rows == 1
    assert quarantine.select(["row", "field"]).to_pylist() == [{"row": 1, "field": "seed"}]


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda t: t.drop_columns(["seed"]), r"^frame: 'trajectories' table lacks column 'seed'$"),
        (lambda t: t.append_column("score", pa.array([1.0, 2.0])), r"^frame: 'trajectories' table has unknown column 'score'$"),
        (lambda t: t.set_column(t.schema.get_field_index("seed"), "seed", pa.array(["abc", "7"])), r"^frame: column 'seed' is string, expected int64$"),
    ],
    ids=["missing column", "extra column", "wrong type"],
)
def test_in_memory_tables_with_other_columns_are_errors(change, match):
    with pytest.raises(ValueError, match=match):
        check_rows(change(to_table([traj(0), traj(1)], T)), T, "frame")
