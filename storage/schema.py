"""Versioned Arrow schemas for every table the pipeline writes, and content-hash trajectory IDs.

A schema's version goes into each file's metadata (see storage.parquet); bump it whenever a
column changes, so an old build refuses a newer file instead of misreading it.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc


@dataclass(frozen=True)
class TableSchema:
    name: str
    version: int
    schema: pa.Schema


def _f(name: str, typ: pa.DataType, nullable: bool = False) -> pa.Field:
    return pa.field(name, typ, nullable=nullable)


# OpenAI's tool call. `arguments` is the JSON object as text, as OpenAI's API carries it: a fixed
# schema cannot type every tool's arguments (a struct over all their keys would fill each call's
# absent keys with nulls). Chat messages hold the object itself, as transformers' chat templates and
# TRL take it: to_table encodes it, from_table decodes it.
TOOL_CALL = pa.struct(
    [
        _f("id", pa.string()),
        _f("type", pa.string()),  # function
        _f("function", pa.struct([_f("name", pa.string()), _f("arguments", pa.string())])),
    ]
)
MESSAGE = pa.struct(
    [
        _f("role", pa.string()),
        _f("content", pa.string()),
        _f("tool_calls", pa.list_(_f("item", TOOL_CALL)), nullable=True),  # an assistant message's calls
        _f("tool_call_id", pa.string(), nullable=True),  # a tool message: the call it answers
        _f("name", pa.string(), nullable=True),  # a tool message: the function that answered (OpenAI allows it on any role)
    ]
)
MESSAGES = pa.list_(_f("item", MESSAGE))
# A message that lacks these keys is stored with nulls there and read back without them, so a
# plain {role, content} message reads back as it was written.
OPTIONAL_MESSAGE_KEYS = ("tool_calls", "tool_call_id", "name")
# The export's messages: each the JSON of its chat message, as `datasets`' Json type stores it (the
# arrow.json extension of a string). datasets reads them back as the chat messages themselves, where
# it would give a struct's absent keys as None (which templates testing `'tool_calls' in message`,
# as Llama 3's does, take for a tool call) and tool-call arguments as text.
JSON_MESSAGES = pa.list_(_f("item", pa.json_()))
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
    2,
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
            _f("messages", MESSAGES),
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
    2,
    pa.schema(
        [
            _f("trajectory_id", pa.string()),
            _f("task_id", pa.string()),
            _f("split", pa.string()),
            _f("source", pa.string()),
            _f("parent_id", pa.string(), nullable=True),
            _f("relabel_id", pa.string(), nullable=True),
            _f("messages", MESSAGES),
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
    3,
    pa.schema(
        [
            _f("messages", JSON_MESSAGES),
            _f("reward", pa.float64(), nullable=True),
            _f("standardized_reward", pa.float64(), nullable=True),
            _f("weight", pa.float64(), nullable=True),
            _f("trajectory_id", pa.string()),
            _f("task_id", pa.string()),
            _f("source", pa.string()),
            _f("tools", pa.string(), nullable=True),  # the environment's tools as JSON text (TRL reads it so); null: none
        ]
    ),
)

# HOPE's replay buffer (tasks/buffer.py): one row per distinct (state, action) pair.
PAIRS = TableSchema(
    "pairs",
    1,
    pa.schema(
        [
            _f("key", pa.string()),  # sha256 of the serialised state and action
            _f("prompt", MESSAGES),  # the chat up to the state
            _f("action", MESSAGE),  # the agent's message
            _f("turn", pa.int32()),  # turns[].turn of the action
            _f("target_raw", pa.float64()),  # Eq. 3: mean discounted return-to-go over the trajectories through the pair
            _f("target", pa.float64()),  # in [0, 1]: what the critic learns
            _f("count", pa.int32()),  # |G(s, a)|
            _f("source", pa.string()),  # on-policy | hindsight
            _f("trajectory_ids", pa.list_(_f("item", pa.string()))),
            _f("selected", pa.bool_()),  # kept by the balance
        ]
    ),
)

# HOPE's online DPO (tasks/actor.py): one row per buffer state trained on, its two ranked candidates.
PREFERENCES = TableSchema(
    "preferences",
    1,
    pa.schema(
        [
            _f("key", pa.string()),  # sha256 of the serialised state
            _f("round", pa.int32()),  # the online round whose actor (or proposer) made the candidates
            _f("trajectory_id", pa.string()),  # the trajectory the state is read from
            _f("turn", pa.int32()),
            _f("prompt", MESSAGES),  # the chat up to the state
            _f("chosen", MESSAGE),  # the critic's higher-scored candidate
            _f("rejected", MESSAGE),
            _f("chosen_score", pa.float64()),  # the critic's Q(s, a) in [0, 1]
            _f("rejected_score", pa.float64()),
            _f("source", pa.string()),  # policy | proposer (explore_prob)
        ]
    ),
)

# StepAgent's inspection and practice (tasks/practice.py, Eq. 4-5): one row per (prefix of an
# expert trajectory, action the policy sampled there). Equal and failed samples stay, flagged.
PRACTICE = TableSchema(
    "practice",
    1,
    pa.schema(
        [
            _f("pair_id", pa.string()),  # sha256 of (trajectory_id, step, sample)
            _f("trajectory_id", pa.string()),  # the expert trajectory the prefix is cut from
            _f("task_id", pa.string()),
            _f("split", pa.string()),
            _f("step", pa.int32()),  # 0-based: the expert's action number (Eq. 4's i - 1)
            _f("sample", pa.int32()),  # 0 .. practice.k - 1
            _f("prompt", MESSAGES),  # the state s_i: every message before the expert's action
            _f("expert", MESSAGE),  # the expert's action a_i, as the trajectory records it (chosen)
            _f("agent", MESSAGE),  # the policy's action as the chat would record it (rejected); "(empty reply)" where generation failed
            _f("expert_action", pa.string(), nullable=True),  # the environment's parse of each: the move alone
            _f("agent_action", pa.string(), nullable=True),  # null where the text does not parse
            _f("equal", pa.bool_()),  # the agent matched the expert (practice.equal): left out of the loss
            _f("identical", pa.bool_()),  # the same text: a DPO pair with exactly zero gradient
            _f("status", pa.string()),  # ok | failed (the backend gave up on the sample)
            _f("reason", pa.string(), nullable=True),  # why the status is not ok
            # log pi(a|s) of the practising policy at temperature 1, summed over the action's tokens
            # as the chat template encodes it (online_dpo.encode); null: longer than the model's context
            _f("expert_logp", pa.float64(), nullable=True),
            _f("agent_logp", pa.float64(), nullable=True),
            _f("policy_id", pa.string()),  # the practising policy (model id)
            _f("seed", pa.int64()),  # the sample's
        ]
    ),
)

# A regeneration the forward model did not complete: one row per relabel that has no row in the
# regenerations table, so relabels in = regenerations + dropped.
DROPPED = TableSchema(
    "dropped",
    1,
    pa.schema(
        [
            _f("relabel_id", pa.string()),
            _f("parent_id", pa.string()),  # the logged trajectory the relabel branched from
            _f("task_id", pa.string()),
            _f("branch_turn", pa.int32()),
            _f("forward_model", pa.string()),  # which model wrote the continuation: model | hard_model (learned), or the role's model
            _f("status", pa.string()),  # unfinished (the parser: the dialogue did not finish) | invalid | failed
            _f("reason", pa.string()),
            _f("text", pa.string(), nullable=True),  # the last continuation the model wrote ("" when the backend gave up)
        ]
    ),
)

# NLAC's prioritised replay buffer (tasks/nlac.py): one row per transition (s_t, a_t, r_t, s_t+1) of
# the episodes the policy collected, every iteration's, carried from one iteration to the next.
NLAC_BUFFER = TableSchema(
    "nlac_buffer",
    1,
    pa.schema(
        [
            _f("transition_id", pa.string()),  # sha256 of (trajectory_id, step)
            _f("trajectory_id", pa.string()),  # the collected episode it is cut from
            _f("task_id", pa.string()),
            _f("split", pa.string()),
            _f("step", pa.int32()),  # t, 0-based: the action's number in its episode
            _f("state", MESSAGES),  # s_t: every message before the action
            _f("action", MESSAGE),  # a_t, as the chat records it
            _f("observation", MESSAGES),  # the messages that answered it (s_t+1 = state + action + observation)
            _f("turns", pa.list_(_f("item", TURN))),  # the episode's turn records up to and including a_t's (the oracle roles' view)
            _f("reward", pa.float64()),  # r_t
            _f("terminal", pa.bool_()),  # a_t ended the episode
            _f("return", pa.float64()),  # the episode's return (a terminal target's reward)
            _f("priority", pa.float64()),  # PER's p_i: the last L1 it was trained with (+ epsilon); new: the buffer's max
            _f("added", pa.int32()),  # the iteration that collected it
            _f("trained", pa.int32()),  # how many times PER drew it so far
            _f("policy_id", pa.string()),  # the policy that acted
        ]
    ),
)

# Every sample an NLAC iteration trained on (tasks/train/nlac.py): the L1 and L2 targets the roles
# wrote and the losses, so any training example can be audited. A role's failure leaves its text null.
NLAC_SAMPLES = TableSchema(
    "nlac_samples",
    1,
    pa.schema(
        [
            _f("step", pa.int32()),  # the optimizer step
            _f("transition_id", pa.string()),
            _f("weight", pa.float64()),  # PER's importance weight
            _f("priority", pa.float64()),  # the transition's priority when drawn
            _f("target", pa.string(), nullable=True),  # L1's target: the backup's critique of (s_t, a_t)
            _f("target_status", pa.string()),  # ok | invalid | failed (roles.account)
            _f("future", pa.string(), nullable=True),  # d_t+1, the bootstrapped future (LLM backup, non-terminal)
            _f("action", pa.string(), nullable=True),  # the a_t critiqued and refined: fresh from the policy, or the stored one
            _f("action_source", pa.string()),  # fresh | stored
            _f("critique", pa.string(), nullable=True),  # Q_L(s_t, a_t) from the critic
            _f("critique_status", pa.string()),
            _f("optimal", pa.bool_(), nullable=True),  # the critique's Optimality
            _f("refined", pa.string(), nullable=True),  # a_t^r, L2's target
            _f("refined_status", pa.string()),
            _f("changed", pa.bool_(), nullable=True),  # the refined action is another move than a_t (Environment.same_action)
            _f("l1", pa.float64(), nullable=True),  # per-token NLL of the target under the critic prompt
            _f("l2", pa.float64(), nullable=True),  # per-token NLL of the refined action under the policy prompt
        ]
    ),
)

SCHEMAS: dict[str, TableSchema] = {
    s.name: s for s in (TRAJECTORIES, QUARANTINE, SUMMARIES, RELABELS, LABELS, TRAINING, EXPORT, PAIRS, PREFERENCES, PRACTICE, DROPPED, NLAC_BUFFER, NLAC_SAMPLES)
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
    """Content hash: the same trajectory always gets the same ID, so reruns write identical bytes.
    Messages are hashed as stored (stored_message), so a row read back hashes as it was written."""
    fields = {k: row[k] for k in ID_FIELDS}
    if isinstance(fields["messages"], list):
        fields["messages"] = [stored_message(m) for m in fields["messages"]]
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def stored_message(message: dict) -> dict:
    """A chat message as the MESSAGE struct holds it: tool-call arguments as JSON text, and the
    optional keys that are None left out. Anything else is left as it is, for to_table's checks."""
    if not isinstance(message, dict):
        return message
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        message = {**message, "tool_calls": [_stored_call(c) for c in calls]}
    return {k: v for k, v in message.items() if v is not None or k not in OPTIONAL_MESSAGE_KEYS}


def _stored_call(call: object) -> object:
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), dict):
        arguments = json.dumps(function["arguments"], ensure_ascii=False, separators=(",", ":"))
        return {**call, "function": {**function, "arguments": arguments}}
    return call


def chat_message(stored: dict | str) -> dict:
    """A MESSAGE struct value (or an export's JSON text) read back as the chat message that was
    written: the optional keys it did not have left out, tool-call arguments as the JSON object again."""
    if isinstance(stored, str):
        return json.loads(stored)
    message = {k: v for k, v in stored.items() if v is not None or k not in OPTIONAL_MESSAGE_KEYS}
    if "tool_calls" in message:
        message["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}} for c in message["tool_calls"]
        ]
    return message


def from_table(table) -> list[dict]:
    """The rows of a table (pyarrow, or a polars DataFrame) as python dicts, their messages as
    chat messages (chat_message): to_table's inverse, and where every stage turns rows into chats."""
    rows = table.to_pylist() if isinstance(table, pa.Table) else table.to_dicts()
    for row in rows:
        if "messages" in row:
            row["messages"] = [chat_message(m) for m in row["messages"]]
    return rows


def to_table(rows: list[dict], name: str) -> pa.Table:
    """Build a table of schema `name` from python dicts, checking every value first.

    pyarrow alone would accept some mismatches silently (1.5 into an int column becomes 1,
    null in a non-nullable struct field), so each value is checked and the first bad one is
    reported by row index and column. Messages are stored as stored_message gives them, or as
    JSON (message_json) in a JSON_MESSAGES column, after the same checks.
    """
    schema = get_schema(name).schema
    columns = set(schema.names)
    if "messages" in columns:
        rows = [_with_messages(row, stored_message) for row in rows]
    for i, row in enumerate(rows):
        extra = sorted(set(row) - columns)
        if extra:
            raise ValueError(f"{name} row {i}: unknown column {extra[0]!r}")
        for field in schema:
            problem = check_value(row.get(field.name), MESSAGES if field.type == JSON_MESSAGES else field.type, field.nullable)
            if problem:
                path, reason = problem
                raise ValueError(f"{name} row {i}, column {field.name!r}{path}: {reason}")
    if "messages" in columns and schema.field("messages").type == JSON_MESSAGES:
        for i, row in enumerate(rows):
            try:
                rows[i] = _with_messages(row, lambda m: message_json(chat_message(m)))
            except ValueError as e:  # arguments given as text that is not JSON
                raise ValueError(f"{name} row {i}, column 'messages': tool-call arguments that are not JSON ({e})") from None
        # pyarrow builds no extension type from python values: the JSON goes in as strings.
        storage = schema.set(schema.get_field_index("messages"), schema.field("messages").with_type(pa.list_(_f("item", pa.string()))))
        return pa.Table.from_pylist(rows, schema=storage).cast(schema)
    return pa.Table.from_pylist(rows, schema=schema)


def _with_messages(row: dict, convert) -> dict:
    messages = row.get("messages")
    return {**row, "messages": [convert(m) for m in messages]} if isinstance(messages, list) else row


def message_json(message: dict) -> str:
    """A chat message's JSON, as an export holds it."""
    return json.dumps(message, ensure_ascii=False, separators=(",", ":"))


def json_messages(messages: pa.Array) -> pa.Array:
    """A MESSAGES array as the export's JSON_MESSAGES, the same messages. polars encodes the
    {role, content} ones; those with tool keys (a few per CarDealer turn) are encoded one by one."""
    if isinstance(messages, pa.ChunkedArray):
        messages = messages.combine_chunks()
    items = messages.flatten()
    text = pl.from_arrow(pa.table({"role": items.field("role"), "content": items.field("content")}))
    # lazily: the engine encodes the chunks in parallel, about 1.8x the eager select's speed here
    text = text.lazy().select(pl.struct("role", "content").struct.json_encode()).collect().to_series()
    # compat_level oldest: large_string, cheaper to convert than the default (about 5x here)
    text = text.to_arrow(compat_level=pl.CompatLevel.oldest()).cast(pa.string())
    keyed = np.zeros(len(items), dtype=bool)
    for key in OPTIONAL_MESSAGE_KEYS:
        if (field := items.field(key)).null_count < len(field):  # a key no message has: nothing to look at
            keyed |= field.is_valid().to_numpy(zero_copy_only=False)
    if keyed.any():
        at = np.flatnonzero(keyed)
        encoded = [message_json(chat_message(m)) for m in items.take(pa.array(at)).to_pylist()]
        text = pc.replace_with_mask(text, pa.array(keyed), pa.array(encoded, pa.string()))
    offsets = pc.subtract(messages.offsets, messages.offsets[0])
    return pa.ListArray.from_arrays(offsets, pa.ExtensionArray.from_storage(pa.json_(), text), type=JSON_MESSAGES)


def check_value(value: Any, typ: pa.DataType, nullable: bool) -> tuple[str, str] | None:
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
            problem = check_value(item, typ.value_type, typ.value_field.nullable)
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
            problem = check_value(value.get(field.name), field.type, field.nullable)
            if problem:
                return f".{field.name}{problem[0]}", problem[1]
        return None
    else:  # a type no schema here uses yet
        raise TypeError(f"no value check for Arrow type {typ}")
    return None if ok else ("", f"expected {typ}, got {type(value).__name__} {value!r:.80}")
