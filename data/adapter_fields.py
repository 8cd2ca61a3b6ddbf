"""Typed access to the fields of a raw record, shared by every format adapter (:mod:`data.adapters`).

A structural fault (missing field, wrong type, invalid JSON inside a field) raises
``FieldError`` naming the source field; an ``Example`` holds one normalized row and, in
``origin``, the source field each normalized field path came from. ``_turns`` reads a list
of turn objects (``role``/``content``, or ShareGPT's ``from``/``value``) into messages.

Labels (``label``, a math ``answer``) may be JSON numbers; ``label_text`` gives their
canonical text (``27.0`` -> ``27``, ``0.5`` -> ``0.5``, ``1e-07`` -> ``0.0000001``) and
rejects NaN and infinities.

Tool calls (ShareGPT ``function_call`` / ``observation`` turns, LLaMA-Factory's tool format,
or transformers-style messages) are normalized to the transformers chat convention: an
assistant turn ``{"role": "assistant", "content": "", "tool_calls": [{"type": "function",
"function": {"name", "arguments": {...}}}]}``, a ``{"role": "tool", "content"}`` turn for
each result, and the row's ``tools`` as ``[{"type": "function", "function": <JSON schema>}]``
(what ``apply_chat_template(tools=...)`` takes). Rows without tools keep the plain
``{role, content}`` shape. RL prompts (prompt_label, gsm8k, math) keep their ``tools`` the
same way (checked as for SFT; the RL and evaluation prompts are rendered with them); prompt
turns themselves carry no tool calls.

Per-turn weights (SFT conversations): OpenAI's fine-tuning ``"weight"`` and LLaMA-Factory
v1's ``"loss_weight"`` on a turn are 0 (not trained) or 1 (trained, the default for assistant
turns). An assistant turn of weight 0 keeps ``"weight": 0`` in its normalized message, and
:func:`data.chat.encode_chat` leaves it out of the loss mask; any other value is an error.

Media are refused (:func:`no_media`, :func:`_content`): the pipeline trains text-only models,
so a LLaMA-Factory ``images`` / ``videos`` / ``audios`` field or an image content part would
be dropped and its ``<image>`` placeholder trained as text.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any


class FieldError(ValueError):
    """A record's field is missing or of the wrong type (``field`` is its source path)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Example:
    """One normalized row and where its fields came from (normalized path -> source path)."""

    row: dict[str, Any]
    origin: Mapping[str, str] = field(default_factory=dict)


# --- typed field access -------------------------------------------------------------------


def _json_type(value: Any) -> str:
    """The JSON name of a value's type; the Python type name for what JSON has no name for
    (a parquet ``date``, ``bytes``, ``timedelta``)."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    if type(value) in names:
        return names[type(value)]
    return "number" if isinstance(value, (int, float, Decimal)) else type(value).__name__


def _get(record: Mapping[str, Any], key: str, path: str | None = None) -> Any:
    if key not in record:
        raise FieldError(path or key, "missing field")
    return record[key]


def _text(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise FieldError(path, f"expected a string, got {_json_type(value)}")
    return value


def canonical_number(value: int | float | Decimal) -> str:
    """The canonical text of a finite JSON number used as a label.

    Integers (and floats with an integral value) are written without a decimal point:
    ``204`` -> ``"204"``, ``27.0`` -> ``"27"``, ``1e20`` -> ``"100000000000000000000"``.
    Other floats are their shortest round-tripping decimal (Python's ``repr``) written
    positionally, never with an exponent: ``0.5`` -> ``"0.5"``, ``1e-07`` -> ``"0.0000001"``
    (models write decimals, and the math verifier would read ``1e-07`` as ``1*e - 7``).
    ``-0.0`` is ``"0"``. A ``Decimal`` (a parquet decimal column) is written the same way:
    ``Decimal("72.00")`` -> ``"72"``.
    """
    if isinstance(value, int):
        return str(value)
    number = value if isinstance(value, Decimal) else Decimal(repr(value))
    if number == 0:
        return "0"
    return format(number.normalize(), "f")


def label_text(value: Any, path: str) -> str:
    """A label given as a string (kept as written) or a finite number (``canonical_number``).

    Raises:
        FieldError: at ``path`` for NaN, +-Infinity, booleans and non-scalar values.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, Decimal)):
        raise FieldError(path, f"expected a string or a number, got {_json_type(value)}")
    finite = value.is_finite() if isinstance(value, Decimal) else not isinstance(value, float) or math.isfinite(value)
    if not finite:
        spelled = "NaN" if value != value else ("-Infinity" if value < 0 else "Infinity")
        raise FieldError(path, f"{spelled} is not a valid label (expected a string or a finite number)")
    return canonical_number(value)


# Media a record may carry (LLaMA-Factory's multimodal formats: ``images``, ``videos``,
# ``audios``; LLaVA: ``image``), each named in the error for a record that has one.
MEDIA = ("image", "video", "audio")
MEDIA_FIELDS = tuple(f for m in MEDIA for f in (f"{m}s", m))


def no_media(record: Mapping[str, Any]) -> None:
    """Refuse a multimodal record: a non-empty ``images`` / ``videos`` / ``audios`` (or
    ``image`` / ``video`` / ``audio``) field.

    Raises:
        FieldError: at that field: media are not supported; dropping them would train the
            text's ``<image>`` placeholders as words.
    """
    for key in MEDIA_FIELDS:
        value = record.get(key)
        if value is None or (isinstance(value, (str, list, tuple, dict)) and not value):
            continue  # an empty field (exporters write one on text rows) holds no media
        medium = key.rstrip("s")
        raise FieldError(
            key,
            f"{medium}s are not supported (training is text-only): the {medium}s would be dropped "
            f"and '<{medium}>' placeholders trained as text; remove the '{key}' field (and the "
            "placeholders), remove these rows, or use a text-only dataset",
        )


def _content(value: Any, path: str) -> str:
    """A message content: a string, or a list of typed text parts (joined without separator)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise FieldError(path, f"expected a string or a list of text parts, got {_json_type(value)}")
    texts = []
    for j, part in enumerate(value):
        where = f"{path}[{j}]"
        if not isinstance(part, dict):
            raise FieldError(where, f"expected a content part object, got {_json_type(part)}")
        kind = part.get("type", "text")
        medium = next((m for m in MEDIA if isinstance(kind, str) and m in kind), None)
        if medium:
            raise FieldError(
                f"{where}.type",
                f"{medium}s are not supported (training is text-only; content part type "
                f"{kind!r}): remove the part (keep the text parts) or the row, or use a "
                "text-only dataset",
            )
        if kind != "text":
            raise FieldError(f"{where}.type", f"unsupported content part type {kind!r} (only text)")
        key = "value" if "value" in part else "text"  # LLaMA-Factory v1 / OpenAI spelling
        texts.append(_text(_get(part, key, f"{where}.{key}"), f"{where}.{key}"))
    return "".join(texts)


# --- tools and tool calls ---------------------------------------------------------------------


def _json_field(value: Any, path: str) -> Any:
    """A field that may hold JSON as a string (LLaMA-Factory) or the decoded value itself."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise FieldError(path, f"invalid JSON at column {e.colno}: {e.msg}") from None


def _tool_call(call: Any, path: str, where: str) -> dict[str, Any]:
    """One call as ``{"type": "function", "function": {"name", "arguments": dict}}``.

    Accepts LLaMA-Factory's ``{"name", "arguments"}`` and the OpenAI/transformers
    ``{"type": "function", "function": {...}}``; ``arguments`` may be an object or a JSON
    string of one, and may be left out (no arguments).
    """
    if not isinstance(call, dict):
        raise FieldError(path, f"{where}: expected a tool call object, got {_json_type(call)}")
    fn = call.get("function")
    if not isinstance(fn, dict):
        fn = call
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise FieldError(path, f'{where}: expected a non-empty string "name", got {_json_type(name)}')
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise FieldError(path, f'{where}: "arguments" is invalid JSON at column {e.colno}: {e.msg}') from None
    if not isinstance(arguments, dict):
        raise FieldError(path, f'{where}: "arguments" must be a JSON object, got {_json_type(arguments)}')
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def tool_calls(value: Any, path: str) -> list[dict[str, Any]]:
    """The calls of a ShareGPT ``function_call`` value or a message's ``tool_calls``.

    ``value``: one call or a non-empty list of calls, as decoded JSON or a JSON string.

    Raises:
        FieldError: at ``path`` for invalid JSON, an empty list or a call without a name.
    """
    calls = _json_field(value, path)
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        raise FieldError(
            path,
            f'expected a tool call {{"name", "arguments"}} or a non-empty list of them, '
            f"got {'an empty list' if calls == [] else _json_type(calls)}",
        )
    return [_tool_call(c, path, f"tool call [{j}]") for j, c in enumerate(calls)]


def tool_schemas(value: Any, path: str = "tools") -> list[dict[str, Any]]:
    """A row's tools as ``[{"type": "function", "function": <JSON schema>}]``.

    ``value``: a JSON string or list of schemas, each ``{"name", "description",
    "parameters"}`` (LLaMA-Factory) or already ``{"type": "function", "function": ...}``;
    ``None``, ``""`` and ``"[]"`` mean no tools.

    Raises:
        FieldError: at ``path`` for invalid JSON, a non-list, or a schema without a name.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return []
    tools = _json_field(value, path)
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list):
        raise FieldError(path, f"expected a list of tool schemas, got {_json_type(tools)}")
    out = []
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise FieldError(path, f"tool [{j}]: expected a JSON schema object, got {_json_type(tool)}")
        schema = tool["function"] if tool.get("type") == "function" and isinstance(tool.get("function"), dict) else tool
        name = schema.get("name")
        if not isinstance(name, str) or not name.strip():
            raise FieldError(path, f'tool [{j}]: expected a non-empty string "name", got {_json_type(name)}')
        out.append({"type": "function", "function": schema})
    return out


# --- turns ---------------------------------------------------------------------------------------


SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "observation": "tool",
    "tool": "tool",
    "function_call": "assistant",
}
FUNCTION_CALL = "function_call"  # the ShareGPT role whose value is a JSON tool call


def _turns(
    value: Any,
    src: str,
    dst: str,
    origin: dict[str, str],
    role_key: str = "role",
    content_key: str = "content",
    role_map: Mapping[str, str] | None = None,
    offset: int = 0,
    tools_allowed: bool = False,
) -> list[dict[str, Any]]:
    """Messages from a list of turn objects; records ``dst[i+offset].x -> src[i].y`` in origin.

    Unknown roles are kept as written (role_map applied when it knows them) so that the
    schema reports them under the source field. With ``tools_allowed`` (sft conversations),
    a ShareGPT ``function_call`` turn becomes an assistant turn with ``tool_calls`` and empty
    content, and a turn's own ``tool_calls`` are normalized (its content may then be null);
    otherwise both are errors, since prompts carry no tools. Sft conversations also read
    per-turn weights (:func:`_turn_weight`); prompts ignore them (nothing in a prompt is trained).
    """
    if not isinstance(value, list):
        raise FieldError(src, f"expected a list of turns, got {_json_type(value)}")
    out = []
    for i, turn in enumerate(value):
        where = f"{src}[{i}]"
        if not isinstance(turn, dict):
            raise FieldError(where, f"expected a turn object, got {_json_type(turn)}")
        raw_role = _text(_get(turn, role_key, f"{where}.{role_key}"), f"{where}.{role_key}")
        k = i + offset
        origin[f"{dst}[{k}].role"] = f"{where}.{role_key}"
        origin[f"{dst}[{k}].content"] = f"{where}.{content_key}"
        calls = None
        if role_key == "from" and raw_role == FUNCTION_CALL and tools_allowed:
            calls = tool_calls(_get(turn, content_key, f"{where}.{content_key}"), f"{where}.{content_key}")
            origin[f"{dst}[{k}].tool_calls"] = f"{where}.{content_key}"
            content = ""
        elif turn.get("tool_calls"):  # null or [] (exporters write both on plain turns): no calls
            if not tools_allowed:
                raise FieldError(f"{where}.tool_calls", "tool calls are supported in sft conversations only")
            calls = tool_calls(turn["tool_calls"], f"{where}.tool_calls")
            origin[f"{dst}[{k}].tool_calls"] = f"{where}.tool_calls"
            raw = turn.get(content_key)
            content = "" if raw is None else _content(raw, f"{where}.{content_key}")
        else:
            content = _content(_get(turn, content_key, f"{where}.{content_key}"), f"{where}.{content_key}")
        role = role_map.get(raw_role, raw_role) if role_map is not None else raw_role
        if not tools_allowed and raw_role in ("observation", FUNCTION_CALL):
            role = raw_role  # no tool turns in prompts: reported as an unknown role
        message: dict[str, Any] = {"role": role, "content": content}
        if calls:
            message["tool_calls"] = calls
        weight, weight_src = _turn_weight(turn, role, where) if tools_allowed else (1, None)
        if weight == 0 and role == "assistant":
            message["weight"] = 0
            if weight_src is not None:  # always set here: an assistant turn without a weight field weighs 1
                origin[f"{dst}[{k}].weight"] = weight_src
        out.append(message)
    if src != dst:
        origin[dst] = src
    answers = [k for k, m in enumerate(out, offset) if m["role"] == "assistant"]
    if answers and all(out[k - offset].get("weight") == 0 for k in answers):
        raise FieldError(
            origin[f"{dst}[{answers[-1]}].weight"],
            "every assistant turn has weight 0, so the "
            "conversation has nothing to train on; give a turn "
            "weight 1 or remove the row",
        )
    return out


WEIGHT_KEYS = ("weight", "loss_weight")  # OpenAI fine-tuning; LLaMA-Factory v1


def _turn_weight(turn: Mapping[str, Any], role: str, where: str) -> tuple[int, str | None]:
    """A turn's SFT weight, 1 (trained) or 0 (left out of the loss mask), and its source field
    (None when the turn has none: 1 for assistant turns, 0 for the others).

    Read from ``weight`` or ``loss_weight`` (null: absent); 0, 1, 0.0 and 1.0 are accepted.

    Raises:
        FieldError: at ``where.weight`` / ``where.loss_weight`` for any other value (0.5,
            ``"yes"``, ``true``), for both keys given with different values, and for weight 1
            on a turn that is not the assistant's (only assistant turns are trained).
    """
    found = [(key, turn[key]) for key in WEIGHT_KEYS if turn.get(key) is not None]
    for key, value in found:
        if isinstance(value, bool) or not isinstance(value, (int, float, Decimal)) or value not in (0, 1):
            shown = json.dumps(value, default=str)
            raise FieldError(
                f"{where}.{key}",
                f"expected 0 (not trained) or 1 (trained), got {shown}; "
                "a turn is either in the SFT loss or not: set 0 or 1, or remove it",
            )
    if len({v for _, v in found}) > 1:
        (first, a), (second, b) = found
        raise FieldError(f"{where}.{second}", f"{b} disagrees with {first} = {a}; keep one of the two")
    if not found:
        return (1 if role == "assistant" else 0), None
    key, weight = found[0][0], int(found[0][1])
    if weight == 1 and role in ("system", "user", "tool"):  # an unknown role is the schema's to report
        raise FieldError(f"{where}.{key}", f"only assistant turns are trained, not {role!r} turns; set 0 or remove it")
    return weight, f"{where}.{key}"


def _prompt(value: Any, src: str, origin: dict[str, str]) -> list[dict[str, str]]:
    """A prompt given as a plain string (one user turn) or as a list of messages."""
    if isinstance(value, str):
        origin["prompt[0].content"] = src
        return [{"role": "user", "content": value}]
    return _turns(value, src, "prompt", origin)


def _with_tools(row: dict[str, Any], record: Mapping[str, Any], origin: dict[str, str]) -> dict[str, Any]:
    tools = tool_schemas(record.get("tools"))
    if tools:
        row["tools"] = tools
        origin["tools"] = "tools"
    return row


def _no_tools(record: Mapping[str, Any]) -> None:
    # Dropping them silently would train a reward model on prompts it never sees with tools.
    if tool_schemas(record.get("tools")):
        raise FieldError("tools", "tool definitions are supported in sft data only, not in preference pairs")
