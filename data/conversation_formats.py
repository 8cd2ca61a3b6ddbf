"""Conversation and instruction formats: ``messages``, ``kto``, ``sharegpt``, ``seed_tasks`` and
``alpaca`` give sft; ``kto`` also gives the unpaired kind ``kto`` (keys and kinds: the table of
:mod:`data.adapters`).

Read as sft, KTO rows labelled false are skipped, not errors: they are responses the model
should *not* imitate, and SFT has no way to use them (the po stage's KTO does, as kind ``kto``).

Alpaca joins instruction and input with a newline, as LLaMA-Factory's alpaca converter does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from data.adapter_fields import SHAREGPT_ROLES, Example, FieldError, _get, _json_type, _text, _turns, _with_tools


def messages_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """``{"messages": [{"role", "content", "tool_calls"?}, ...], "tools"?}`` -> sft.

    Content may be typed text parts; an assistant turn with ``tool_calls`` may have null
    content; ``tools`` as in ``tool_schemas``.
    """
    origin: dict[str, str] = {}
    messages = _turns(_get(record, "messages"), "messages", "messages", origin, tools_allowed=True)
    return [Example(_with_tools({"messages": messages}, record, origin), origin)]


def kto_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """``{"messages", "label": bool}`` (LLaMA-Factory's kto format) -> sft from rows labelled
    true (false rows give nothing), or one kto row from every record: ``prompt`` (every turn
    but the last), ``completion`` (the last turn, which must be the assistant's) and ``label``.

    Raises:
        FieldError: a non-boolean ``label``; for kto, a last turn that is not the assistant's
            or tool calls (a kto prompt carries none).
    """
    label = _get(record, "label")
    if not isinstance(label, bool):
        raise FieldError("label", f"expected true or false, got {_json_type(label)}")
    if kind == "sft":
        examples = messages_adapter(record, kind)
        return examples if label else []
    origin: dict[str, str] = {}
    turns = _turns(_get(record, "messages"), "messages", "messages", origin)
    if not turns or turns[-1]["role"] != "assistant":
        where = f"messages[{len(turns) - 1}].role" if turns else "messages"
        raise FieldError(where, "the last turn must be the assistant's completion")
    last = len(turns) - 1
    origin = {k.replace("messages", "prompt", 1): v for k, v in origin.items() if not k.startswith(f"messages[{last}]")}
    origin["completion"] = f"messages[{last}].content"
    row = {"prompt": turns[:-1], "completion": turns[-1]["content"], "label": label}
    return [Example(row, origin)]


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
        _get(record, "conversations"),
        "conversations",
        "messages",
        origin,
        role_key="from",
        content_key="value",
        role_map=SHAREGPT_ROLES,
        offset=len(messages),
        tools_allowed=True,
    )
    return [Example(_with_tools({"messages": messages}, record, origin), origin)]


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
            _instruction_example(
                record, inst.get("input"), _get(inst, "output", out_src), out_src, f"instances[{j}].input"
            )
        )
    return examples
