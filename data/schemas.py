"""Pandera schemas of the four normalized dataset kinds, one row per example.

- ``sft``: ``messages`` (list of ``{role, content, tool_calls?, weight?}``), at least one
  assistant turn, the last turn an assistant turn; optional ``tools`` (the tool schemas the
  conversation may call, ``[{"type": "function", "function": {"name", ...}}]``). An assistant
  turn with ``"weight": 0`` is not trained (checked by the adapters,
  :mod:`data.adapter_fields`; the frame leaves the key out).
- ``preference``: ``prompt`` (list of messages, the last a user turn), ``chosen`` and
  ``rejected`` (non-blank strings, not identical).
- ``rl``: ``prompt`` (list of messages, the last a user turn), ``label`` (non-blank string,
  the reference answer a verifier compares against).
- ``kto``: unpaired KTO rows: ``prompt`` (list of messages, the last a user turn),
  ``completion`` (non-blank string, the assistant's answer) and ``label`` (boolean: true for a
  desirable completion, false for an undesirable one).

Prompt roles are ``system``, ``user`` or ``assistant``; SFT conversations may also hold
``tool`` turns (tool results), each right after an assistant turn with ``tool_calls`` or
another tool turn. Only assistant turns carry ``tool_calls`` (``[{"type": "function",
"function": {"name", "arguments": {...}}}]``); such a turn may have empty content. Every
other content must hold a non-whitespace character. Column types are polars types (a
prompt is ``List(Struct(role, content))``); ``rows_to_frame`` writes tool-call arguments and
tool schemas as JSON text in the frame, since their shapes vary from row to row.

Nested lists are checked by element-wise pandera checks. Each such check is paired with an
``explain`` function that names the offending sub-field (``messages[2].role``), so a failed
row is reported with its exact field rather than just its column.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import pandera.polars as pa
import polars as pl
from pandera.errors import SchemaErrors

Kind = Literal["sft", "preference", "rl", "kto"]
KINDS: tuple[str, ...] = ("sft", "preference", "rl", "kto")
ROLES: tuple[str, ...] = ("system", "user", "assistant")
SFT_ROLES: tuple[str, ...] = ROLES + ("tool",)

MESSAGES = pl.List(pl.Struct({"role": pl.String, "content": pl.String}))
TOOL_CALL = pl.Struct({"type": pl.String, "function": pl.Struct({"name": pl.String, "arguments": pl.String})})
SFT_MESSAGES = pl.List(pl.Struct({"role": pl.String, "content": pl.String, "tool_calls": pl.List(TOOL_CALL)}))
COLUMN_TYPES: dict[str, dict[str, pl.DataType | type[pl.DataType]]] = {  # pl.String is a class
    "sft": {"messages": SFT_MESSAGES, "tools": pl.List(pl.String)},
    "preference": {"prompt": MESSAGES, "chosen": pl.String, "rejected": pl.String},
    "rl": {"prompt": MESSAGES, "label": pl.String},
    "kto": {"prompt": MESSAGES, "completion": pl.String, "label": pl.Boolean},
}
OPTIONAL_COLUMNS: dict[str, frozenset[str]] = {"sft": frozenset({"tools"})}


def natural_key(text: str) -> tuple:
    """Sort key reading digit runs as numbers: ``messages[2]`` before ``messages[10]``."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text))


# (field path relative to the column, message); "" means the column itself.
Problem = tuple[str, str]


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown dataset kind {kind!r}; expected one of {', '.join(KINDS)}")


def _is_blank(text: str | None) -> bool:
    return text is None or not text.strip()


def _json_object(text: str | None) -> bool:
    try:
        return isinstance(json.loads(text), dict) if text is not None else False
    except json.JSONDecodeError:
        return False


def turn_problems(turns: list[dict[str, Any]], roles: tuple[str, ...] = ROLES) -> list[Problem]:
    """Problems of single turns: unknown roles, blank contents, malformed tool calls
    (as ``[i].role``, ``[i].tool_calls[j].function.name`` etc.)."""
    problems: list[Problem] = []
    for i, turn in enumerate(turns):
        role = turn.get("role")
        calls = turn.get("tool_calls") or []
        if role not in roles:
            problems.append((f"[{i}].role", f"unknown role {role!r} (expected one of {', '.join(roles)})"))
        if calls and role != "assistant":
            problems.append((f"[{i}].tool_calls", f"only assistant turns make tool calls, not {role!r}"))
        if _is_blank(turn.get("content")) and not (calls and role == "assistant"):
            problems.append((f"[{i}].content", "empty content"))
        for j, call in enumerate(calls):
            where = f"[{i}].tool_calls[{j}]"
            if call.get("type") != "function":
                problems.append((f"{where}.type", f"expected 'function', got {call.get('type')!r}"))
            fn = call.get("function") or {}
            if _is_blank(fn.get("name")):
                problems.append((f"{where}.function.name", "empty tool name"))
            if not _json_object(fn.get("arguments")):
                problems.append((f"{where}.function.arguments", "expected a JSON object"))
    return problems


def conversation_problems(turns: list[dict[str, Any]]) -> list[Problem]:
    """Shape of an SFT conversation: not empty, has an assistant turn, ends with one, and
    every tool turn answers a tool call (follows an assistant turn with ``tool_calls`` or
    another tool turn).

    Skipped when a role is unknown (``turn_problems`` reports that), to give one error, not three.
    """
    if not turns:
        return [("", "empty conversation")]
    roles = [t.get("role") for t in turns]
    if any(r not in SFT_ROLES for r in roles):
        return []  # an unknown role is reported by turn_problems; its shape is undefined
    if "assistant" not in roles:
        return [("", "no assistant turn")]
    problems: list[Problem] = []
    for i, role in enumerate(roles):
        if role == "tool" and not (i and (roles[i - 1] == "tool" or turns[i - 1].get("tool_calls"))):
            problems.append((f"[{i}].role", "a tool result must follow an assistant turn with tool calls"))
    last = len(turns) - 1
    if roles[last] != "assistant":
        problems.append((f"[{last}].role", f"last turn must be 'assistant', got {roles[last]!r}"))
    return problems


def tools_problems(tools: list[str] | None) -> list[Problem]:
    """Each tool of a row is ``{"type": "function", "function": {"name": non-blank, ...}}``."""
    problems: list[Problem] = []
    for j, text in enumerate(tools or []):
        try:
            tool = json.loads(text) if text is not None else None
        except json.JSONDecodeError:
            tool = None
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or _is_blank(fn["name"]):
            problems.append((f"[{j}]", 'expected {"type": "function", "function": {"name": ..., ...}}'))
    return problems


def prompt_problems(turns: list[dict[str, Any]]) -> list[Problem]:
    """Shape of a prompt: not empty and ending with a user turn (the model answers next)."""
    if not turns:
        return [("", "empty prompt")]
    last = len(turns) - 1
    if turns[last].get("role") in ROLES and turns[last].get("role") != "user":
        return [(f"[{last}].role", f"last prompt turn must be 'user', got {turns[last].get('role')!r}")]
    return []


@dataclass(frozen=True)
class Rule:
    """One pandera check plus how to explain a failure of it as field-level problems."""

    check: pa.Check
    explain: Callable[[Any], list[Problem]]


def _nested_rule(explain: Callable[[Any], list[Problem]], error: str) -> Rule:
    # Element-wise polars checks receive a list cell as a pl.Series of structs.
    def ok(cell: Any) -> bool:
        return not explain(_to_python(cell))

    return Rule(pa.Check(ok, element_wise=True, error=error), lambda cell: explain(_to_python(cell)))


def _text_rule(message: str) -> Rule:
    return Rule(pa.Check.str_contains(r"\S", error=message), lambda _cell: [("", message)])


def _to_python(cell: Any) -> Any:
    return cell.to_list() if isinstance(cell, pl.Series) else cell


_PROMPT_RULES = [
    _nested_rule(turn_problems, "every turn has a known role and non-empty content"),
    _nested_rule(prompt_problems, "prompt ends with a user turn"),
]
RULES: dict[str, dict[str, list[Rule]]] = {
    "sft": {
        "messages": [
            _nested_rule(lambda t: turn_problems(t, SFT_ROLES), "every turn has a known role and non-empty content"),
            _nested_rule(conversation_problems, "conversation ends with an assistant turn"),
        ],
        "tools": [_nested_rule(tools_problems, "every tool is a named function schema")],
    },
    "preference": {
        "prompt": _PROMPT_RULES,
        "chosen": [_text_rule("empty chosen response")],
        "rejected": [_text_rule("empty rejected response")],
    },
    "rl": {"prompt": _PROMPT_RULES, "label": [_text_rule("empty label")]},
    "kto": {"prompt": _PROMPT_RULES, "completion": [_text_rule("empty completion")], "label": []},
}
# Frame-wide checks: (pandera check, field to blame, message).
FRAME_RULES: dict[str, list[tuple[pa.Check, str, str]]] = {
    "preference": [
        (
            # An identical pair carries no preference signal for a reward model or DPO.
            pa.Check(
                lambda data: data.lazyframe.select(pl.col("chosen") != pl.col("rejected")),
                error="rejected differs from chosen",
            ),
            "rejected",
            "identical to chosen",
        )
    ]
}


def build_schema(kind: str) -> pa.DataFrameSchema:
    """The pandera (polars backend) schema of one normalized kind.

    Raises:
        ValueError: ``kind`` is not one of ``sft``, ``preference``, ``rl``, ``kto``.
    """
    _check_kind(kind)
    columns = {
        name: pa.Column(
            dtype, checks=[r.check for r in RULES[kind][name]], nullable=name in OPTIONAL_COLUMNS.get(kind, ())
        )
        for name, dtype in COLUMN_TYPES[kind].items()
    }
    return pa.DataFrameSchema(columns, checks=[c for c, _, _ in FRAME_RULES.get(kind, [])], strict=True, name=kind)


SCHEMAS: dict[str, pa.DataFrameSchema] = {k: build_schema(k) for k in KINDS}


def _frame_call(call: Any) -> dict[str, Any]:
    call = call if isinstance(call, dict) else {}
    fn = call.get("function") if isinstance(call.get("function"), dict) else None
    kind = call.get("type")
    return {
        "type": kind if isinstance(kind, str) else None,
        "function": None
        if fn is None
        else {
            "name": fn["name"] if isinstance(fn.get("name"), str) else None,
            "arguments": json.dumps(fn.get("arguments"), ensure_ascii=False, default=str),
        },
    }


def _frame_sft(row: dict[str, Any]) -> dict[str, Any]:
    messages = row.get("messages")
    if isinstance(messages, list):
        messages = [
            {
                "role": t.get("role"),
                "content": t.get("content"),
                "tool_calls": [_frame_call(c) for c in t["tool_calls"]] if t.get("tool_calls") else None,
            }
            if isinstance(t, dict)
            else t
            for t in messages
        ]
    tools = row.get("tools")
    if isinstance(tools, list):
        tools = [json.dumps(t, ensure_ascii=False, default=str) for t in tools] or None
    return {"messages": messages, "tools": tools}


def rows_to_frame(rows: list[dict[str, Any]], kind: str) -> pl.DataFrame:
    """A polars frame of normalized rows with the kind's column types (extra keys dropped).

    For sft, tool-call ``arguments`` and each entry of ``tools`` become JSON text (the
    schema checks they decode to objects); rows without tools get a null ``tools``.
    """
    _check_kind(kind)
    types = COLUMN_TYPES[kind]
    if kind == "sft":
        rows = [_frame_sft(r) for r in rows]
    return pl.DataFrame([{c: r.get(c) for c in types} for r in rows], schema=types, orient="row")


def frame_problems(frame: pl.DataFrame, kind: str) -> list[tuple[int, str, str]]:
    """Validate a frame against the kind's schema; every failure as (row index, field, message).

    Fields are full paths such as ``messages[2].role`` or ``chosen``. Rows are 0-based
    positions in ``frame``. The list is sorted by row, then field (digit runs compared as
    numbers: ``messages[2]`` before ``messages[10]``).

    Raises:
        ValueError: a column is missing or has the wrong type (a frame-wide fault, not a row's).
    """
    try:
        SCHEMAS[kind].validate(frame, lazy=True)
        return []
    except SchemaErrors as exc:
        failures = exc.failure_cases.to_dicts()
    problems: set[tuple[int, str, str]] = set()
    for f in failures:
        column, index, number = f["column"], f["index"], f["check_number"]
        if index is None:
            raise ValueError(f"{kind} frame: column {column!r}: {f['check']}: {f['failure_case']}")
        if f["schema_context"] == "DataFrameSchema":  # a frame-wide check (column = schema name)
            _, field, message = FRAME_RULES[kind][number]
            problems.add((index, field, message))
        elif f["check"] == "not_nullable":
            problems.add((index, column, "missing (null)"))
        else:
            rule = RULES[kind][column][number]
            for sub, message in rule.explain(frame[column][index]):
                problems.add((index, column + sub, message))
    return sorted(problems, key=lambda p: (p[0], natural_key(p[1]), p[2]))
