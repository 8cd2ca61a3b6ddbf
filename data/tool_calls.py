"""Tool calls in the model's own format, derived from its chat template (as the turn end is,
``data.chat_template``): how an assistant turn writes a call, and what text the template puts
between the policy's turn end and its next turn once the tools have answered.

**The call format.** The template renders a probe conversation whose assistant turn holds one
call (``{"name": "probe_fn", "arguments": {"probe_arg": 7}}``, given as the
``tool_calls`` field transformers passes to templates) and the same turn without it; the
call's serialization is what the first has and the second lacks. In it the JSON object holding
the probe's name is located (``json.JSONDecoder.raw_decode``); the keys holding the name and
the arguments, and the text written right before and after the object, are the format:

- Qwen2.5 / Qwen3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  (open ``<tool_call>``, close ``</tool_call>``, keys ``name`` / ``arguments``);
- Llama-3.1 style: a bare ``{"name": ..., "parameters": {...}}`` (no markers; keys
  ``name`` / ``parameters``).

Parsing a response (:meth:`ToolCallFormat.parse`) finds every object between the markers (or,
without markers, every top-level JSON object with the name key) in order; text that is not a
well-formed call is reported as a :class:`MalformedCall`, not dropped silently.

**The observation** (:func:`tool_observation`). After the policy's turn, which ends with the
template's turn end (``<|im_end|>``), the tools' results are appended as tokens (the policy's
own tokens are never re-rendered or re-tokenized, ``engine.rollout.multi_turn``). Their text is
what the template writes after that turn end for ``k`` tool messages holding the results,
followed by the next assistant turn's header: the probe conversation is rendered with the
results and a generation prompt, and cut after the assistant turn's end.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from data.chat_template import ChatTemplateError, _name, _render_or_raise, end_of_turn

PROBE_NAME = "probe_fn"
PROBE_ARGS = {"probe_arg": 7}
PROBE_QUESTION = "probe question"
PROBE_CONTENT = "\u00a7probe answer"  # starts with a character no template writes at a turn's start
PROBE_RESULT = "\u00a7probe result "
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": PROBE_NAME,
        "description": "probe",
        "parameters": {"type": "object", "properties": {"probe_arg": {"type": "integer"}}},
    },
}


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict


@dataclass(frozen=True)
class MalformedCall:
    """Text between the call markers that is not a call: the text and why (the tool loop
    answers it with the reason, so the policy sees its mistake)."""

    text: str
    reason: str


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes a tool call (module docstring).

    Attributes:
        open: text written before the call's JSON object, stripped of whitespace (``""``: bare JSON).
        close: text written after it, stripped (``""`` with ``open`` ``""``).
        name_key: the object's key holding the tool's name.
        args_key: the object's key holding the arguments.
    """

    open: str
    close: str
    name_key: str
    args_key: str

    def parse(self, text: str) -> list[ToolCall | MalformedCall]:
        """The calls in ``text`` (a policy turn's text), in order.

        With markers, each ``open ... close`` span is one call (an unclosed last span runs to
        the end of the text); without, each top-level JSON object that has :attr:`name_key`.
        A span that is not a JSON object with a string name and object arguments is a
        :class:`MalformedCall` (arguments given as a JSON string are decoded, as OpenAI's
        format writes them)."""
        if not self.open:
            return [
                self._call(obj, raw) for obj, raw in _objects(text) if isinstance(obj, dict) and self.name_key in obj
            ]
        out: list[ToolCall | MalformedCall] = []
        at = 0
        while (start := text.find(self.open, at)) >= 0:
            body_start = start + len(self.open)
            end = text.find(self.close, body_start) if self.close else -1
            body = text[body_start:] if end < 0 else text[body_start:end]
            at = len(text) if end < 0 else end + len(self.close)
            try:
                obj = json.loads(body)
            except ValueError as exc:
                out.append(MalformedCall(body.strip(), f"not JSON: {exc}"))
                continue
            out.append(self._call(obj, body.strip()))
        return out

    def _call(self, obj: Any, raw: str) -> ToolCall | MalformedCall:
        if not isinstance(obj, dict) or not isinstance(obj.get(self.name_key), str):
            return MalformedCall(raw, f"expected a JSON object with a string {self.name_key!r}")
        args = obj.get(self.args_key, {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return MalformedCall(raw, f"{self.args_key!r} is a string that is not JSON")
        if not isinstance(args, dict):
            return MalformedCall(raw, f"expected {self.args_key!r} to be a JSON object")
        return ToolCall(obj[self.name_key], args)


def _objects(text: str):
    """``(object, its text)`` of every top-level JSON value starting at a ``{`` in ``text``."""
    decoder = json.JSONDecoder()
    at = 0
    while (start := text.find("{", at)) >= 0:
        try:
            obj, end = decoder.raw_decode(text, start)
        except ValueError:
            at = start + 1
            continue
        yield obj, text[start:end]
        at = end


def _probe_turns(with_call: bool, content: str = "") -> list[dict]:
    turn: dict[str, Any] = {"role": "assistant", "content": content}
    if with_call:
        turn["tool_calls"] = [{"type": "function", "function": {"name": PROBE_NAME, "arguments": PROBE_ARGS}}]
    return [{"role": "user", "content": PROBE_QUESTION}, turn]


def tool_call_format(tokenizer: Any) -> ToolCallFormat:
    """The tool-call format of ``tokenizer``'s chat template (module docstring).

    Raises:
        ChatTemplateError: the template does not render tool calls (no call of the probe
            appears, e.g. Gemma's or Phi-4's templates, which take tool schemas at most), or
            renders it in a form without a JSON object naming the tool. Names the model.
    """
    with_call = _render_or_raise(tokenizer, _probe_turns(True), False, [PROBE_TOOL], "an assistant tool call")
    with_text = _render_or_raise(
        tokenizer, _probe_turns(False, PROBE_CONTENT), False, [PROBE_TOOL], "an assistant turn"
    )
    # the assistant turn's body starts where the two renderings part (the header is common)
    body = 0
    while body < min(len(with_call), len(with_text)) and with_call[body] == with_text[body]:
        body += 1
    turn_end = end_of_turn(tokenizer)
    for obj, raw in _objects(with_call[body:]):
        if not isinstance(obj, dict):
            continue
        name_key = next((k for k, v in obj.items() if v == PROBE_NAME), None)
        args_key = next((k for k, v in obj.items() if v == PROBE_ARGS or v == json.dumps(PROBE_ARGS)), None)
        if name_key is None or args_key is None:
            continue
        start = with_call.index(raw, body)
        end = start + len(raw)
        stop = with_call.find(turn_end, end)
        close = with_call[end : stop if stop >= 0 else len(with_call)].strip()
        return ToolCallFormat(with_call[body:start].strip(), close, name_key, args_key)
    raise ChatTemplateError(
        f"the chat template of {_name(tokenizer)} does not render assistant tool calls as a JSON "
        "object naming the tool (tool_calls of an assistant message), so its tool-call format is "
        "unknown; use a model whose template writes tool calls (Qwen2.5, Qwen3, Llama-3.1) for "
        "tool-using RL"
    )


def tool_observation(tokenizer: Any, results: Sequence[str]) -> str:
    """The text to append after the policy's turn end for tool results ``results`` (one per
    call, in order), up to and including the next assistant turn's header (module docstring).

    The probe conversation is rendered twice with tool messages after the call: once holding
    placeholders, to find the end of the calling turn (the last turn end before the first
    placeholder; a template may render that turn differently once it is not the last, as
    Qwen3 drops its empty think block, but not what follows it), and once holding
    ``results``, cut there.

    Raises:
        ChatTemplateError: the template cannot render tool messages, or writes no turn end
            before them. Names the model.
    """
    turns = _probe_turns(True)
    marks = [f"{PROBE_RESULT}{i}" for i in range(len(results))]

    def render(contents: Sequence[str]) -> str:
        tools = [{"role": "tool", "name": PROBE_NAME, "content": c} for c in contents]
        return _render_or_raise(tokenizer, turns + tools, True, [PROBE_TOOL], "tool results")

    placed = render(marks or [PROBE_RESULT])
    turn_end = end_of_turn(tokenizer)
    cut = placed.rfind(turn_end, 0, placed.index(PROBE_RESULT))
    if cut < 0:
        raise ChatTemplateError(
            f"the chat template of {_name(tokenizer)} writes no turn end {turn_end!r} between a tool "
            "call and its results; tool observations cannot be appended to the sampled tokens"
        )
    cut += len(turn_end)
    full = render(results)
    if full[:cut] != placed[:cut]:
        raise ChatTemplateError(
            f"the chat template of {_name(tokenizer)} renders the turns before tool results "
            "differently by their content; tool observations cannot be appended to the sampled tokens"
        )
    return full[cut:]
