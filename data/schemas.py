"""Pandera schemas of the three normalized dataset kinds, one row per example.

- ``sft``: ``messages`` (list of ``{role, content}``), at least one assistant turn, the last
  turn an assistant turn.
- ``preference``: ``prompt`` (list of messages, the last a user turn), ``chosen`` and
  ``rejected`` (non-blank strings, not identical).
- ``rl``: ``prompt`` (list of messages, the last a user turn), ``label`` (non-blank string,
  the reference answer a verifier compares against).

Roles are ``system``, ``user`` or ``assistant``; every content must hold a non-whitespace
character. Column types are polars types (a message list is ``List(Struct(role, content))``).

Nested lists are checked by element-wise pandera checks. Each such check is paired with an
``explain`` function that names the offending sub-field (``messages[2].role``), so a failed
row is reported with its exact field rather than just its column.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import pandera.polars as pa
import polars as pl
from pandera.errors import SchemaErrors

Kind = Literal["sft", "preference", "rl"]
KINDS: tuple[str, ...] = ("sft", "preference", "rl")
ROLES: tuple[str, ...] = ("system", "user", "assistant")

MESSAGES = pl.List(pl.Struct({"role": pl.String, "content": pl.String}))
COLUMN_TYPES: dict[str, dict[str, pl.DataType]] = {
    "sft": {"messages": MESSAGES},
    "preference": {"prompt": MESSAGES, "chosen": pl.String, "rejected": pl.String},
    "rl": {"prompt": MESSAGES, "label": pl.String},
}

# (field path relative to the column, message); "" means the column itself.
Problem = tuple[str, str]


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown dataset kind {kind!r}; expected one of {', '.join(KINDS)}")


def _is_blank(text: str | None) -> bool:
    return text is None or not text.strip()


def turn_problems(turns: list[dict[str, Any]]) -> list[Problem]:
    """Problems of single turns: unknown roles and blank contents, as ``[i].role`` etc."""
    problems: list[Problem] = []
    for i, turn in enumerate(turns):
        if turn.get("role") not in ROLES:
            problems.append(
                (f"[{i}].role", f"unknown role {turn.get('role')!r} (expected one of {', '.join(ROLES)})")
            )
        if _is_blank(turn.get("content")):
            problems.append((f"[{i}].content", "empty content"))
    return problems


def conversation_problems(turns: list[dict[str, Any]]) -> list[Problem]:
    """Shape of an SFT conversation: not empty, has an assistant turn, ends with one.

    Skipped when a role is unknown (``turn_problems`` reports that), to give one error, not three.
    """
    if not turns:
        return [("", "empty conversation")]
    roles = [t.get("role") for t in turns]
    if any(r not in ROLES for r in roles):
        return []  # an unknown role is reported by turn_problems; its shape is undefined
    if "assistant" not in roles:
        return [("", "no assistant turn")]
    last = len(turns) - 1
    if roles[last] != "assistant":
        return [(f"[{last}].role", f"last turn must be 'assistant', got {roles[last]!r}")]
    return []


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


def _nested_rule(explain: Callable[[list[dict[str, Any]]], list[Problem]], error: str) -> Rule:
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
            _nested_rule(turn_problems, "every turn has a known role and non-empty content"),
            _nested_rule(conversation_problems, "conversation ends with an assistant turn"),
        ]
    },
    "preference": {
        "prompt": _PROMPT_RULES,
        "chosen": [_text_rule("empty chosen response")],
        "rejected": [_text_rule("empty rejected response")],
    },
    "rl": {"prompt": _PROMPT_RULES, "label": [_text_rule("empty label")]},
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
        ValueError: ``kind`` is not one of ``sft``, ``preference``, ``rl``.
    """
    _check_kind(kind)
    columns = {
        name: pa.Column(dtype, checks=[r.check for r in RULES[kind][name]], nullable=False)
        for name, dtype in COLUMN_TYPES[kind].items()
    }
    return pa.DataFrameSchema(
        columns, checks=[c for c, _, _ in FRAME_RULES.get(kind, [])], strict=True, name=kind
    )


SCHEMAS: dict[str, pa.DataFrameSchema] = {k: build_schema(k) for k in KINDS}


def rows_to_frame(rows: list[dict[str, Any]], kind: str) -> pl.DataFrame:
    """A polars frame of normalized rows with the kind's column types (extra keys dropped)."""
    _check_kind(kind)
    types = COLUMN_TYPES[kind]
    return pl.DataFrame([{c: r.get(c) for c in types} for r in rows], schema=types, orient="row")


def frame_problems(frame: pl.DataFrame, kind: str) -> list[tuple[int, str, str]]:
    """Validate a frame against the kind's schema; every failure as (row index, field, message).

    Fields are full paths such as ``messages[2].role`` or ``chosen``. Rows are 0-based
    positions in ``frame``. The list is sorted by row, then field.

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
    return sorted(problems)
