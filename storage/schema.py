"""Versioned Arrow schemas for every table the pipeline writes, and content-hash trajectory IDs.

A schema's version goes into each file's metadata (see storage.parquet); bump it whenever a
column changes, so an old build refuses a newer file instead of misreading it.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa


@dataclass(frozen=True)
class TableSchema:
    name: str
    version: int
    schema: pa.Schema


def _f(name: str, typ: pa.DataType, nullable: bool = False) -> pa.Field:
    return pa.field(name, typ, nullable=nullable)


MESSAGE = pa.struct([_f("role", pa.string()), _f("content", pa.string())])
TURN = pa.struct(
    [
        _f("turn", pa.int32()),
        _f("reason", pa.string()),
        _f("action", pa.string()),
        _f("observation", pa.string()),
        _f("reward", pa.float64(), nullable=True),
    ]
)

TRAJECTORIES = TableSchema(
    "trajectories",
    1,
    pa.schema(
        [
            _f("trajectory_id", pa.string()),
            _f("env", pa.string()),
            _f("task_id", pa.string()),
            _f("split", pa.string()),
            _f("source", pa.string()),  # policy | import | regeneration
            _f("parent_id", pa.string(), nullable=True),
            _f("branch_turn", pa.int32(), nullable=True),
            _f("relabel_id", pa.string(), nullable=True),
            _f("policy_id", pa.string()),
            _f("seed", pa.int64()),
            _f("messages", pa.list_(_f("item", MESSAGE))),
            _f("turns", pa.list_(_f("item", TURN))),
            _f("return", pa.float64(), nullable=True),  # imported logs may lack it
            _f("success", pa.bool_(), nullable=True),
            _f("num_turns", pa.int32()),
        ]
    ),
)

QUARANTINE = TableSchema(
    "quarantine",
    1,
    pa.schema(
        [
            _f("source_file", pa.string()),
            _f("row", pa.int64()),
            _f("field", pa.string()),
            _f("reason", pa.string()),
            _f("raw", pa.string()),  # the offending row as JSON text, truncated
        ]
    ),
)

SUMMARIES = TableSchema(
    "summaries",
    2,
    pa.schema(
        [
            _f("trajectory_id", pa.string()),  # the summarized trajectory
            _f("task_id", pa.string()),
            _f("summary", pa.string(), nullable=True),  # null when the summarizer gave none
            _f("status", pa.string()),  # ok | invalid (unparseable after retries) | failed (no answer)
            _f("reason", pa.string(), nullable=True),  # why the status is not ok
            _f("role", pa.string()),  # summarizer
            _f("backend", pa.string()),  # oracle | hf | vllm | openai
            _f("model", pa.string()),  # the model id, or the oracle's version
            _f("prompt_hash", pa.string()),  # of the prompt template or summarizer version
        ]
    ),
)

RELABELS = TableSchema(
    "relabels",
    2,
    pa.schema(
        [
            _f("relabel_id", pa.string()),  # content hash of (trajectory, turn, counterfactual)
            _f("trajectory_id", pa.string()),  # the trajectory relabelled
            _f("task_id", pa.string()),
            _f("split", pa.string()),
            _f("mode", pa.string()),  # hope (window, n per timestep) | hr (one per dialogue)
            _f("branch_turn", pa.int32(), nullable=True),  # 0-based index of the replaced agent action
            _f("rank", pa.int32()),  # 0 = the proposer's first choice at this turn
            _f("original_text", pa.string(), nullable=True),  # the agent message that was replaced
            _f("original_action", pa.string(), nullable=True),
            _f("counterfactual_text", pa.string(), nullable=True),  # the agent message spliced in (policy format)
            _f("counterfactual_action", pa.string(), nullable=True),
            _f("player_reason", pa.string(), nullable=True),  # inside the action: uses only what the player saw
            _f("rationale", pa.string(), nullable=True),  # the proposer's hindsight reasoning; may use the secret
            _f("status", pa.string()),  # ok | invalid (unparseable after retries) | failed (no answer); only ok rows are regenerated
            _f("reason", pa.string(), nullable=True),  # why the status is not ok
            _f("proposer", pa.string()),  # oracle, or backend:model that proposed it
            _f("prompt_hash", pa.string()),
        ]
    ),
)

LABELS = TableSchema(
    "labels",
    2,
    pa.schema(
        [
            _f("trajectory_id", pa.string()),
            _f("task_id", pa.string()),
            _f("source", pa.string()),  # policy | import | regeneration
            _f("env_reward", pa.float64(), nullable=True),  # the return logged with the trajectory
            _f("env_success", pa.bool_(), nullable=True),
            _f("reward", pa.float64(), nullable=True),  # the labelled reward; null when labelling failed
            _f("labeler", pa.string()),  # oracle | hf | vllm | openai
            _f("model", pa.string()),  # the labeler's model id, or the oracle's version
            _f("prompt_hash", pa.string()),  # of the prompt template
            _f("scores", pa.string(), nullable=True),  # rubric judge: every criterion's score, as JSON
            _f("status", pa.string()),  # ok | failed
            _f("reason", pa.string()),
        ]
    ),
)

TRAINING = TableSchema(
    "training",
    1,
    pa.schema(
        [
            _f("trajectory_id", pa.string()),
            _f("task_id", pa.string()),
            _f("split", pa.string()),
            _f("source", pa.string()),
            _f("parent_id", pa.string(), nullable=True),
            _f("relabel_id", pa.string(), nullable=True),
            _f("messages", pa.list_(_f("item", MESSAGE))),
            _f("reward", pa.float64(), nullable=True),  # labelled reward
            _f("standardized_reward", pa.float64(), nullable=True),  # Swift's weight
            _f("weight", pa.float64(), nullable=True),  # Refit's weight: reward scaled to [0, 1]
            _f("group_size", pa.int64()),
            _f("group_mean", pa.float64(), nullable=True),
            _f("group_std", pa.float64(), nullable=True),
            _f("standardize_status", pa.string()),  # ok | tied | singleton | no_reward
        ]
    ),
)

# The training table as Hugging Face tools take it: `messages` in the chat format (TRL's
# conversational format) and one weight column per algorithm.
EXPORT = TableSchema(
    "export",
    1,
    pa.schema(
        [
            _f("messages", pa.list_(_f("item", MESSAGE))),
            _f("reward", pa.float64(), nullable=True),
            _f("standardized_reward", pa.float64(), nullable=True),
            _f("weight", pa.float64(), nullable=True),
            _f("trajectory_id", pa.string()),
            _f("task_id", pa.string()),
            _f("source", pa.string()),
        ]
    ),
)

SCHEMAS: dict[str, TableSchema] = {
    s.name: s for s in (TRAJECTORIES, QUARANTINE, SUMMARIES, RELABELS, LABELS, TRAINING, EXPORT)
}

# What makes a trajectory itself; outcome columns (turns, return, success) are derived from it.
ID_FIELDS = (
    "env", "task_id", "split", "source", "parent_id", "branch_turn", "relabel_id", "policy_id", "seed", "messages",
)


def get_schema(name: str) -> TableSchema:
    try:
        return SCHEMAS[name]
    except KeyError:
        raise ValueError(f"unknown table schema {name!r} (known: {', '.join(sorted(SCHEMAS))})") from None


def trajectory_id(row: dict) -> str:
    """Content hash: the same trajectory always gets the same ID, so reruns write identical bytes."""
    canonical = json.dumps({k: row[k] for k in ID_FIELDS}, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def to_table(rows: list[dict], name: str) -> pa.Table:
    """Build a table of schema `name` from python dicts, checking every value first.

    pyarrow alone would accept some mismatches silently (1.5 into an int column becomes 1,
    null in a non-nullable struct field), so each value is checked and the first bad one is
    reported by row index and column.
    """
    schema = get_schema(name).schema
    columns = set(schema.names)
    for i, row in enumerate(rows):
        extra = sorted(set(row) - columns)
        if extra:
            raise ValueError(f"{name} row {i}: unknown column {extra[0]!r}")
        for field in schema:
            problem = _check(row.get(field.name), field.type, field.nullable)
            if problem:
                path, reason = problem
                raise ValueError(f"{name} row {i}, column {field.name!r}{path}: {reason}")
    return pa.Table.from_pylist(rows, schema=schema)


def _check(value: Any, typ: pa.DataType, nullable: bool) -> tuple[str, str] | None:
    """Where inside `value` (e.g. "[2].content") and why it does not fit `typ`; None if it does."""
    if value is None:
        return None if nullable else ("", "null in a non-nullable field")
    if pa.types.is_string(typ):
        ok = isinstance(value, str)
    elif pa.types.is_boolean(typ):
        ok = isinstance(value, bool)
    elif pa.types.is_integer(typ):
        bits = typ.bit_width - 1
        ok = isinstance(value, int) and not isinstance(value, bool) and -(2**bits) <= value < 2**bits
    elif pa.types.is_floating(typ):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif pa.types.is_list(typ):
        if not isinstance(value, (list, tuple)):
            return "", f"expected a list, got {type(value).__name__}"
        for j, item in enumerate(value):
            problem = _check(item, typ.value_type, typ.value_field.nullable)
            if problem:
                return f"[{j}]{problem[0]}", problem[1]
        return None
    elif pa.types.is_struct(typ):
        if not isinstance(value, dict):
            return "", f"expected an object, got {type(value).__name__}"
        names = {f.name for f in typ}
        extra = sorted(set(value) - names)
        if extra:
            return "", f"unknown key {extra[0]!r}"
        for field in typ:
            problem = _check(value.get(field.name), field.type, field.nullable)
            if problem:
                return f".{field.name}{problem[0]}", problem[1]
        return None
    else:  # a type no schema here uses yet
        raise TypeError(f"no value check for Arrow type {typ}")
    return None if ok else ("", f"expected {typ}, got {type(value).__name__} {value!r:.80}")
