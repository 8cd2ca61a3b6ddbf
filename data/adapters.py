"""Format adapters: turn one raw record into normalized examples of a kind (sft/preference/rl).

Each entry of the ``ADAPTERS`` registry (name -> ``Adapter``) is called as
``adapter(record, kind) -> list[Example]`` (usually one example; none for a skipped KTO row,
several for a seed task with several instances). An
``Example`` holds the normalized row (see ``data.schemas``) and ``origin``, a map from
normalized field paths to the source fields they came from, so that a problem found later
by the schema (say an empty ``messages[1].content`` of an alpaca record) is reported under
the field the user wrote (``output``). Structural faults (missing field, wrong type,
invalid JSON inside a field) raise ``FieldError`` naming the source field.

| format | keys that identify it | kinds |
|---|---|---|
| kto | messages + label (boolean; any ``label`` key beside messages makes it KTO, a non-boolean label is a bad row) | sft: rows labelled true only; false rows are skipped |
| messages | messages (role/content; content may be typed parts ``[{"type": "text", "value"}]``; assistant ``tool_calls``, ``tool`` turns), optional tools | sft |
| dpo | conversations + chosen + rejected (``{from, value}``) | preference |
| sharegpt | conversations (``from``: system/human/gpt/function_call/observation, ``value``), optional system, tools | sft |
| seed_tasks | instruction + instances (``[{input, output}]``): one example per instance | sft |
| alpaca | instruction + output, optional input, system, history (``[[query, response]]``) | sft |
| gsm8k | question + answer ending ``#### N`` | rl (label N, commas removed), sft (full answer) |
| math | problem or question + answer without ``####`` (+ solution); an answer with ``#### `` is an error (format gsm8k) | rl (label = answer), sft (solution, else answer) |
| preference | prompt + chosen + rejected (already normalized) | preference |
| dpo_messages | chosen_messages + rejected_messages (two conversations sharing the prompt) | preference |
| hh_rlhf | chosen + rejected transcripts ``\\n\\nHuman: ...\\n\\nAssistant: ...`` | preference |
| prompt_label | prompt (string or messages) + label, optional tools | rl |

KTO rows labelled false are skipped, not errors: they are responses the model should *not*
imitate, and SFT has no way to use them (a KTO or preference stage would).

Alpaca joins instruction and input with a newline, as LLaMA-Factory's alpaca converter does.
GSM8K as sft keeps the answer verbatim, calculator annotations (``<<2*3=6>>``) included.

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

Detection (``detect_format``): the candidates are the formats whose keys the first records
have; given the kind wanted, the one under which most of those records are valid wins (the
adapter and the kind's schema are run on them), then the one most records match, then the
earlier in the table. ``Detection.reason`` says which was chosen and why, for the report.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Callable, Iterable, Mapping, Sequence

from data.schemas import frame_problems, rows_to_frame

DETECT_SAMPLE = 32


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
        if part.get("type", "text") != "text":
            raise FieldError(f"{where}.type", f"unsupported content part type {part.get('type')!r} (only text)")
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
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise FieldError(path, f"{where}: expected a non-empty string \"name\", got {_json_type(name)}")
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise FieldError(path, f"{where}: \"arguments\" is invalid JSON at column {e.colno}: {e.msg}") from None
    if not isinstance(arguments, dict):
        raise FieldError(path, f"{where}: \"arguments\" must be a JSON object, got {_json_type(arguments)}")
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
        raise FieldError(path, f"expected a tool call {{\"name\", \"arguments\"}} or a non-empty list of them, "
                               f"got {'an empty list' if calls == [] else _json_type(calls)}")
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
            raise FieldError(path, f"tool [{j}]: expected a non-empty string \"name\", got {_json_type(name)}")
        out.append({"type": "function", "function": schema})
    return out


# --- turns ---------------------------------------------------------------------------------------


SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
    "observation": "tool", "tool": "tool", "function_call": "assistant",
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
    otherwise both are errors, since prompts carry no tools.
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
        out.append(message)
    if src != dst:
        origin[dst] = src
    return out


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


def _unsupported(name: str, kind: str, kinds: Iterable[str]) -> ValueError:
    return ValueError(f"format {name!r} cannot produce kind {kind!r} (it gives: {', '.join(sorted(kinds))})")


# --- adapters ---------------------------------------------------------------------------


def messages_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """``{"messages": [{"role", "content", "tool_calls"?}, ...], "tools"?}`` -> sft.

    Content may be typed text parts; an assistant turn with ``tool_calls`` may have null
    content; ``tools`` as in ``tool_schemas``.
    """
    origin: dict[str, str] = {}
    messages = _turns(_get(record, "messages"), "messages", "messages", origin, tools_allowed=True)
    return [Example(_with_tools({"messages": messages}, record, origin), origin)]


def kto_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """``{"messages", "label": bool}`` -> sft from rows labelled true; false rows give nothing."""
    label = _get(record, "label")
    if not isinstance(label, bool):
        raise FieldError("label", f"expected true or false, got {_json_type(label)}")
    examples = messages_adapter(record, kind)
    return examples if label else []


def sharegpt_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """``{"conversations": [{"from", "value"}], "system"?, "tools"?}`` -> sft.

    human -> user, gpt -> assistant, observation -> tool, and function_call (a JSON
    ``{"name", "arguments"}`` or a list of them) -> an assistant turn with ``tool_calls``;
    ``tools`` (a JSON string or list of schemas) -> the row's ``tools``.
    """
    origin: dict[str, str] = {}
    messages: list[dict[str, Any]] = []
    if record.get("system"):
        messages.append({"role": "system", "content": _text(record["system"], "system")})
        origin["messages[0].content"] = "system"
    messages += _turns(
        _get(record, "conversations"), "conversations", "messages", origin,
        role_key="from", content_key="value", role_map=SHAREGPT_ROLES, offset=len(messages), tools_allowed=True,
    )
    return [Example(_with_tools({"messages": messages}, record, origin), origin)]


def _reply(value: Any, src: str) -> str:
    """A DPO response: a ``{from, value}`` turn from the assistant, or a plain string."""
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise FieldError(src, f"expected a turn object or a string, got {_json_type(value)}")
    speaker = _text(_get(value, "from", f"{src}.from"), f"{src}.from")
    if speaker not in ("gpt", "assistant"):
        raise FieldError(f"{src}.from", f"expected an assistant turn ('gpt'), got {speaker!r}")
    return _text(_get(value, "value", f"{src}.value"), f"{src}.value")


def dpo_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """LLaMA-Factory DPO: ``{"conversations", "chosen": {from, value}, "rejected": ...}``."""
    _no_tools(record)
    origin: dict[str, str] = {"chosen": "chosen.value", "rejected": "rejected.value"}
    prompt = _turns(
        _get(record, "conversations"), "conversations", "prompt", origin,
        role_key="from", content_key="value", role_map=SHAREGPT_ROLES,
    )
    row = {
        "prompt": prompt,
        "chosen": _reply(_get(record, "chosen"), "chosen"),
        "rejected": _reply(_get(record, "rejected"), "rejected"),
    }
    return [Example(row, origin)]


def dpo_messages_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """LLaMA-Factory's newer DPO layout ``{"chosen_messages": [...], "rejected_messages": [...]}``.

    Each is a whole conversation (``{role, content}`` turns, content a string or typed text
    parts; ``loss_weight`` is ignored). The prompt is the turns they share from the start
    (at most all but each one's last turn); what follows must be one assistant turn in each,
    the chosen and rejected responses.
    """
    _no_tools(record)
    chosen_origin: dict[str, str] = {}
    rejected_origin: dict[str, str] = {}
    chosen = _turns(_get(record, "chosen_messages"), "chosen_messages", "prompt", chosen_origin)
    rejected = _turns(_get(record, "rejected_messages"), "rejected_messages", "prompt", rejected_origin)
    for turns, src in ((chosen, "chosen_messages"), (rejected, "rejected_messages")):
        if not turns:
            raise FieldError(src, "empty conversation")
    n = 0
    while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
        n += 1
    responses = []
    for turns, src in ((chosen, "chosen_messages"), (rejected, "rejected_messages")):
        rest = turns[n:]
        if len(rest) != 1:
            raise FieldError(
                f"{src}[{n}]",
                f"expected one assistant turn after the {n} turns shared with the other conversation, got {len(rest)} turns",
            )
        if rest[0]["role"] != "assistant":
            raise FieldError(f"{src}[{n}].role", f"the response must be an 'assistant' turn, got {rest[0]['role']!r}")
        responses.append(rest[0]["content"])
    origin = {k: v for k, v in chosen_origin.items() if k.startswith("prompt[") and int(k[7:k.index("]")]) < n}
    origin |= {"prompt": "chosen_messages", "chosen": f"chosen_messages[{n}].content",
               "rejected": f"rejected_messages[{n}].content"}
    return [Example({"prompt": chosen[:n], "chosen": responses[0], "rejected": responses[1]}, origin)]


def _instruction_example(
    record: Mapping[str, Any], query_input: Any, output: Any, output_src: str, input_src: str
) -> Example:
    origin: dict[str, str] = {}
    messages: list[dict[str, str]] = []
    if record.get("system"):
        messages.append({"role": "system", "content": _text(record["system"], "system")})
        origin["messages[0].content"] = "system"
    history = record.get("history") or []
    if not isinstance(history, list):
        raise FieldError("history", f"expected a list of [query, response] pairs, got {_json_type(history)}")
    for i, pair in enumerate(history):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise FieldError(f"history[{i}]", "expected a [query, response] pair")
        for j, role in enumerate(("user", "assistant")):
            origin[f"messages[{len(messages)}].content"] = f"history[{i}][{j}]"
            messages.append({"role": role, "content": _text(pair[j], f"history[{i}][{j}]")})
    instruction = _text(_get(record, "instruction"), "instruction")
    extra = _text(query_input, input_src) if query_input is not None else ""
    origin[f"messages[{len(messages)}].content"] = "instruction"
    messages.append({"role": "user", "content": f"{instruction}\n{extra}" if extra else instruction})
    origin[f"messages[{len(messages)}].content"] = output_src
    messages.append({"role": "assistant", "content": _text(output, output_src)})
    return Example({"messages": messages}, origin)


def alpaca_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """``{"instruction", "input"?, "output", "system"?, "history"?}`` -> sft."""
    return [_instruction_example(record, record.get("input"), _get(record, "output"), "output", "input")]


def seed_tasks_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """Stanford Alpaca seed tasks ``{"instruction", "instances": [{input, output}]}`` -> sft."""
    instances = _get(record, "instances")
    if not isinstance(instances, list) or not instances:
        raise FieldError("instances", "expected a non-empty list of {input, output}")
    examples = []
    for j, inst in enumerate(instances):
        if not isinstance(inst, dict):
            raise FieldError(f"instances[{j}]", f"expected an object, got {_json_type(inst)}")
        out_src = f"instances[{j}].output"
        examples.append(
            _instruction_example(record, inst.get("input"), _get(inst, "output", out_src), out_src, f"instances[{j}].input")
        )
    return examples


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
GSM8K_MARK = "####"


def gsm8k_label(answer: str) -> str:
    """The final answer of a GSM8K solution: the text after its last ``####``, commas removed.

    Raises:
        ValueError: no ``####`` or the text after it is not a number.
    """
    if GSM8K_MARK not in answer:
        raise ValueError("no '#### <number>' final answer")
    label = answer.rsplit(GSM8K_MARK, 1)[1].strip().replace(",", "")
    if not _NUMBER.fullmatch(label):
        raise ValueError(f"final answer {label!r} after '####' is not a number")
    return label


def gsm8k_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """GSM8K ``{"question", "answer"}``: rl (label = number after ``####``) or sft (full answer).

    An answer given as a JSON number is the label itself (``label_text``).
    """
    question = _text(_get(record, "question"), "question")
    raw = _get(record, "answer")
    answer = label_text(raw, "answer")
    if kind == "sft":
        return [Example(
            {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]},
            {"messages[0].content": "question", "messages[1].content": "answer"},
        )]
    if isinstance(raw, str):
        try:
            answer = gsm8k_label(answer)
        except ValueError as e:
            raise FieldError("answer", str(e)) from None
    origin = {"prompt[0].content": "question", "label": "answer"}
    return [Example(_with_tools({"prompt": [{"role": "user", "content": question}], "label": answer}, record, origin),
                    origin)]


def math_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """MATH / MATH-500 ``{"problem" | "question", "answer", "solution"?}``.

    rl: label = answer (a string, stripped, or a number as ``label_text``); sft: the
    assistant turn is the solution, or the answer when there is no ``solution`` field.
    """
    key = "question" if "problem" not in record and "question" in record else "problem"
    problem = _text(_get(record, key), key)
    answer = record.get("answer")
    if isinstance(answer, str) and GSM8K_MARK + " " in answer:
        # a GSM8K solution: as math its whole text (working and '#### 72') would be the label
        raise FieldError("answer", "a GSM8K answer ('#### <number>' final answer); set the dataset's format: gsm8k")
    if kind == "sft":
        src = "solution" if "solution" in record else "answer"
        reply = _text(record[src], src) if src == "solution" else label_text(_get(record, src), src)
        return [Example(
            {"messages": [{"role": "user", "content": problem}, {"role": "assistant", "content": reply}]},
            {"messages[0].content": key, "messages[1].content": src},
        )]
    label = label_text(_get(record, "answer"), "answer").strip()
    origin = {"prompt[0].content": key, "label": "answer"}
    return [Example(_with_tools({"prompt": [{"role": "user", "content": problem}], "label": label}, record, origin),
                    origin)]


def preference_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """Normalized ``{"prompt": str | messages, "chosen": str, "rejected": str}``."""
    _no_tools(record)
    origin: dict[str, str] = {}
    prompt = _prompt(_get(record, "prompt"), "prompt", origin)
    row = {
        "prompt": prompt,
        "chosen": _text(_get(record, "chosen"), "chosen"),
        "rejected": _text(_get(record, "rejected"), "rejected"),
    }
    return [Example(row, origin)]


_HH_TURN = re.compile(r"\n\n(Human|Assistant):")
_HH_ROLES = {"Human": "user", "Assistant": "assistant"}
_HH_ANSWER = "\n\nAssistant:"


def hh_rlhf_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """Anthropic HH-RLHF transcripts -> preference.

    The prompt is the longest common prefix of the two transcripts, cut after its last
    ``\\n\\nAssistant:``; it is split into user/assistant turns at ``\\n\\nHuman:`` and
    ``\\n\\nAssistant:``. ``chosen``/``rejected`` are the rest of each transcript (stripped).
    Cutting at the shared prefix rather than at each transcript's own last ``Assistant:``
    keeps pairs whose responses hold several assistant turns aligned on one prompt.
    """
    chosen = _text(_get(record, "chosen"), "chosen")
    rejected = _text(_get(record, "rejected"), "rejected")
    n = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        n += 1
    cut = chosen.rfind(_HH_ANSWER, 0, n)
    if cut < 0:  # rfind within [0, n) keeps the whole marker inside the shared prefix
        raise FieldError("rejected", "chosen and rejected share no prompt ending in '\\n\\nAssistant:'")
    prompt_text = chosen[:cut]
    parts = _HH_TURN.split(prompt_text)
    if parts[0].strip():
        raise FieldError("chosen", "transcript must start with '\\n\\nHuman:'")
    prompt = [
        {"role": _HH_ROLES[speaker], "content": text.strip()} for speaker, text in zip(parts[1::2], parts[2::2])
    ]
    start = cut + len(_HH_ANSWER)
    row = {"prompt": prompt, "chosen": chosen[start:].strip(), "rejected": rejected[start:].strip()}
    origin = {f"prompt[{i}].{k}": "chosen" for i in range(len(prompt)) for k in ("role", "content")}
    origin["prompt"] = "chosen"
    return [Example(row, origin)]


def prompt_label_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """``{"prompt": str | messages, "label": str | number}`` -> rl (a number label as ``label_text``)."""
    origin: dict[str, str] = {}
    prompt = _prompt(_get(record, "prompt"), "prompt", origin)
    row = {"prompt": prompt, "label": label_text(_get(record, "label"), "label")}
    return [Example(_with_tools(row, record, origin), origin)]


@dataclass(frozen=True)
class Adapter:
    """A registered format: its function, the kinds it yields and the keys that identify it."""

    name: str
    fn: Callable[[Mapping[str, Any], str], list[Example]]
    kinds: frozenset[str]
    keys: frozenset[str]
    extra: Callable[[Mapping[str, Any]], bool] = lambda record: True

    def matches(self, record: Mapping[str, Any]) -> bool:
        return self.keys <= record.keys() and self.extra(record)

    def __call__(self, record: Mapping[str, Any], kind: str) -> list[Example]:
        if kind not in self.kinds:
            raise _unsupported(self.name, kind, self.kinds)
        return self.fn(record, kind)


def _adapter(name, fn, kinds, keys, extra=lambda record: True) -> Adapter:
    return Adapter(name, fn, frozenset(kinds), frozenset(keys), extra)


def _gsm8k_answer(record: Mapping[str, Any]) -> bool:
    return isinstance(record["answer"], str) and GSM8K_MARK in record["answer"]


# Order breaks ties in detection: the earlier adapter wins.
ADAPTERS: dict[str, Adapter] = {
    a.name: a
    for a in (
        # A label beside messages makes a KTO file: a row whose label is not a boolean is a bad
        # KTO row, not a plain conversation (reading it as one would train on false rows).
        _adapter("kto", kto_adapter, {"sft"}, {"messages", "label"}),
        _adapter("messages", messages_adapter, {"sft"}, {"messages"}, lambda r: "label" not in r),
        _adapter("dpo", dpo_adapter, {"preference"}, {"conversations", "chosen", "rejected"}),
        _adapter("sharegpt", sharegpt_adapter, {"sft"}, {"conversations"}),
        _adapter("seed_tasks", seed_tasks_adapter, {"sft"}, {"instruction", "instances"}),
        _adapter("alpaca", alpaca_adapter, {"sft"}, {"instruction", "output"}),
        _adapter("gsm8k", gsm8k_adapter, {"rl", "sft"}, {"question", "answer"}, _gsm8k_answer),
        _adapter("math", math_adapter, {"rl", "sft"}, {"answer"},
                 lambda r: ("problem" in r or "question" in r) and not _gsm8k_answer(r)),
        _adapter("preference", preference_adapter, {"preference"}, {"prompt", "chosen", "rejected"}),
        _adapter("dpo_messages", dpo_messages_adapter, {"preference"}, {"chosen_messages", "rejected_messages"}),
        _adapter("hh_rlhf", hh_rlhf_adapter, {"preference"}, {"chosen", "rejected"}),
        _adapter("prompt_label", prompt_label_adapter, {"rl"}, {"prompt", "label"}),
    )
}


@dataclass(frozen=True)
class Detection:
    """The outcome of ``detect``: the format, why (one sentence for the report) and the
    candidates' scores (name -> (records matching its keys, records valid under it))."""

    format: str
    reason: str
    scores: Mapping[str, tuple[int, int]]


def _n_valid(adapter: Adapter, records: Sequence[Mapping[str, Any]], kind: str) -> int:
    """How many of ``records`` the adapter converts and the kind's schema accepts."""
    bad: set[int] = set()
    examples: list[tuple[int, Example]] = []
    for i, record in enumerate(records):
        try:
            examples += [(i, ex) for ex in adapter(record, kind)]
        except FieldError:
            bad.add(i)
    for index, _, _ in frame_problems(rows_to_frame([ex.row for _, ex in examples], kind), kind):
        bad.add(examples[index][0])
    return len(records) - len(bad)


def detect(records: Iterable[Mapping[str, Any]], kind: str | None = None, sample: int = DETECT_SAMPLE) -> Detection:
    """Pick the format of a file from its first ``sample`` records.

    Candidates are the formats whose keys at least one of those records has. With ``kind``,
    the candidates that can give it are tried on the records they match, and the most valid
    rows win; ties go to the format most records match, then to the earlier in ``ADAPTERS``.
    Without ``kind``, when no candidate gives it, or when none gives a single valid row,
    the format most records match is named (a DPO file asked for sft rows is then reported
    as ``dpo``, which gives preference rows, rather than as broken ShareGPT). So a file
    of ``question`` + ``answer`` rows is GSM8K only when its answers carry ``####``, and one
    broken record does not decide the format of the whole file.

    Raises:
        ValueError: no record matches any registered format (the message lists the keys seen).
    """
    head = [r for _, r in zip(range(sample), records)]
    seen = sorted({k for r in head for k in r})
    order = list(ADAPTERS)
    matching = {name: [r for r in head if a.matches(r)] for name, a in ADAPTERS.items()}
    matching = {name: rs for name, rs in matching.items() if rs}
    if not matching:
        raise ValueError(f"cannot detect the dataset format from keys {seen}")
    by_keys = max(matching, key=lambda n: (len(matching[n]), -order.index(n)))
    keys_reason = f"{by_keys} ({len(matching[by_keys])} of the first {len(head)} records have its keys"
    usable = [name for name in matching if kind is not None and kind in ADAPTERS[name].kinds]
    if not usable:
        return Detection(by_keys, keys_reason + ")", {n: (len(rs), 0) for n, rs in matching.items()})
    scores = {n: (len(matching[n]), _n_valid(ADAPTERS[n], matching[n], kind)) for n in usable}
    best = max(scores, key=lambda n: (scores[n][1], scores[n][0], -order.index(n)))
    if scores[best][1] == 0:  # valid under nothing: name the format the keys say (maybe another kind's)
        return Detection(by_keys, keys_reason + f"; none is a valid {kind} row under any format)", scores)
    others = "".join(f"; as {n}: {v}" for n, (_, v) in scores.items() if n != best)
    reason = f"{best} ({scores[best][1]} of the first {len(head)} records are valid {kind} rows as {best}{others})"
    return Detection(best, reason, scores)


def detect_format(records: Iterable[Mapping[str, Any]], kind: str | None = None, sample: int = DETECT_SAMPLE) -> str:
    """The format name ``detect`` picks (see there)."""
    return detect(records, kind, sample).format


def get_adapter(name: str) -> Adapter:
    """The registered adapter called ``name``.

    Raises:
        ValueError: no such format (the message lists the known ones).
    """
    if name not in ADAPTERS:
        raise ValueError(f"unknown dataset format {name!r}; expected one of {', '.join(ADAPTERS)}")
    return ADAPTERS[name]
