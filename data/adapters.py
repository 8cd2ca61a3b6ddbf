"""Format adapters: turn one raw record into normalized examples of a kind (sft/preference/rl).

Each entry of the ``ADAPTERS`` registry (name -> ``Adapter``) is called as
``adapter(record, kind) -> list[Example]`` (usually one example; none for a skipped KTO row,
several for a seed task with several instances). An
``Example`` holds the normalized row (see ``data.schemas``) and ``origin``, a map from
normalized field paths to the source fields they came from, so that a problem found later
by the schema (say an empty ``messages[1].content`` of an alpaca record) is reported under
the field the user wrote (``output``). Structural faults (missing field, wrong type) raise
``FieldError`` naming the source field.

| format | keys that identify it | kinds |
|---|---|---|
| kto | messages + label (boolean) | sft: rows labelled true only; false rows are skipped |
| messages | messages (role/content; content may be typed parts ``[{"type": "text", "value"}]``) | sft |
| dpo | conversations + chosen + rejected (``{from, value}``) | preference |
| sharegpt | conversations (``from``: system/human/gpt, ``value``), optional system | sft |
| seed_tasks | instruction + instances (``[{input, output}]``): one example per instance | sft |
| alpaca | instruction + output, optional input, system, history (``[[query, response]]``) | sft |
| gsm8k | question + answer ending ``#### N`` | rl (label N, commas removed), sft (full answer) |
| math | problem + answer (+ solution) | rl (label = answer), sft (assistant = solution) |
| preference | prompt + chosen + rejected (already normalized) | preference |
| hh_rlhf | chosen + rejected transcripts ``\\n\\nHuman: ...\\n\\nAssistant: ...`` | preference |
| prompt_label | prompt (string or messages) + label | rl |

KTO rows labelled false are skipped, not errors: they are responses the model should *not*
imitate, and SFT has no way to use them (a KTO or preference stage would).

Alpaca joins instruction and input with a newline, as LLaMA-Factory's alpaca converter does.
GSM8K as sft keeps the answer verbatim, calculator annotations (``<<2*3=6>>``) included.
``format="auto"`` detection (``detect_format``) takes the first format in the table order
whose keys a record has, by majority over the first records of a file.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

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
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _get(record: Mapping[str, Any], key: str, path: str | None = None) -> Any:
    if key not in record:
        raise FieldError(path or key, "missing field")
    return record[key]


def _text(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise FieldError(path, f"expected a string, got {_json_type(value)}")
    return value


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


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def _turns(
    value: Any,
    src: str,
    dst: str,
    origin: dict[str, str],
    role_key: str = "role",
    content_key: str = "content",
    role_map: Mapping[str, str] | None = None,
    offset: int = 0,
) -> list[dict[str, str]]:
    """Messages from a list of turn objects; records ``dst[i+offset].x -> src[i].y`` in origin.

    Unknown roles are kept as written (role_map applied when it knows them) so that the
    schema reports them under the source field.
    """
    if not isinstance(value, list):
        raise FieldError(src, f"expected a list of turns, got {_json_type(value)}")
    out = []
    for i, turn in enumerate(value):
        where = f"{src}[{i}]"
        if not isinstance(turn, dict):
            raise FieldError(where, f"expected a turn object, got {_json_type(turn)}")
        role = _text(_get(turn, role_key, f"{where}.{role_key}"), f"{where}.{role_key}")
        content = _content(_get(turn, content_key, f"{where}.{content_key}"), f"{where}.{content_key}")
        if role_map is not None:
            role = role_map.get(role, role)
        k = i + offset
        origin[f"{dst}[{k}].role"] = f"{where}.{role_key}"
        origin[f"{dst}[{k}].content"] = f"{where}.{content_key}"
        out.append({"role": role, "content": content})
    if src != dst:
        origin[dst] = src
    return out


def _prompt(value: Any, src: str, origin: dict[str, str]) -> list[dict[str, str]]:
    """A prompt given as a plain string (one user turn) or as a list of messages."""
    if isinstance(value, str):
        origin["prompt[0].content"] = src
        return [{"role": "user", "content": value}]
    return _turns(value, src, "prompt", origin)


def _unsupported(name: str, kind: str, kinds: Iterable[str]) -> ValueError:
    return ValueError(f"format {name!r} cannot produce kind {kind!r} (it gives: {', '.join(sorted(kinds))})")


# --- adapters ---------------------------------------------------------------------------


def messages_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """``{"messages": [{"role", "content"}, ...]}`` -> sft (content may be typed text parts)."""
    origin: dict[str, str] = {}
    return [Example({"messages": _turns(_get(record, "messages"), "messages", "messages", origin)}, origin)]


def kto_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """``{"messages", "label": bool}`` -> sft from rows labelled true; false rows give nothing."""
    label = _get(record, "label")
    if not isinstance(label, bool):
        raise FieldError("label", f"expected true or false, got {_json_type(label)}")
    examples = messages_adapter(record, kind)
    return examples if label else []


def sharegpt_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """``{"conversations": [{"from", "value"}], "system"?}`` -> sft (human->user, gpt->assistant)."""
    origin: dict[str, str] = {}
    messages = []
    if record.get("system"):
        messages.append({"role": "system", "content": _text(record["system"], "system")})
        origin["messages[0].content"] = "system"
    messages += _turns(
        _get(record, "conversations"), "conversations", "messages", origin,
        role_key="from", content_key="value", role_map=SHAREGPT_ROLES, offset=len(messages),
    )
    return [Example({"messages": messages}, origin)]


def _reply(value: Any, src: str) -> str:
    """A DPO response: a ``{from, value}`` turn from the assistant, or a plain string."""
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise FieldError(src, f"expected a turn object or a string, got {_json_type(value)}")
    speaker = _text(_get(value, "from", f"{src}.from"), f"{src}.from")
    if SHAREGPT_ROLES.get(speaker) != "assistant":
        raise FieldError(f"{src}.from", f"expected an assistant turn ('gpt'), got {speaker!r}")
    return _text(_get(value, "value", f"{src}.value"), f"{src}.value")


def dpo_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """LLaMA-Factory DPO: ``{"conversations", "chosen": {from, value}, "rejected": ...}``."""
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


def gsm8k_label(answer: str) -> str:
    """The final answer of a GSM8K solution: the text after its last ``####``, commas removed.

    Raises:
        ValueError: no ``####`` or the text after it is not a number.
    """
    if "####" not in answer:
        raise ValueError("no '#### <number>' final answer")
    label = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not _NUMBER.fullmatch(label):
        raise ValueError(f"final answer {label!r} after '####' is not a number")
    return label


def gsm8k_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """GSM8K ``{"question", "answer"}``: rl (label = number after ``####``) or sft (full answer)."""
    question = _text(_get(record, "question"), "question")
    answer = _text(_get(record, "answer"), "answer")
    if kind == "sft":
        return [Example(
            {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]},
            {"messages[0].content": "question", "messages[1].content": "answer"},
        )]
    try:
        label = gsm8k_label(answer)
    except ValueError as e:
        raise FieldError("answer", str(e)) from None
    return [Example({"prompt": [{"role": "user", "content": question}], "label": label},
                    {"prompt[0].content": "question", "label": "answer"})]


def math_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """MATH / MATH-500 ``{"problem", "answer", "solution"}``: rl (label = answer) or sft (solution)."""
    problem = _text(_get(record, "problem"), "problem")
    if kind == "sft":
        solution = _text(_get(record, "solution"), "solution")
        return [Example(
            {"messages": [{"role": "user", "content": problem}, {"role": "assistant", "content": solution}]},
            {"messages[0].content": "problem", "messages[1].content": "solution"},
        )]
    label = _text(_get(record, "answer"), "answer").strip()
    return [Example({"prompt": [{"role": "user", "content": problem}], "label": label},
                    {"prompt[0].content": "problem", "label": "answer"})]


def preference_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """Normalized ``{"prompt": str | messages, "chosen": str, "rejected": str}``."""
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
    """``{"prompt": str | messages, "label": str | number}`` -> rl (a number label becomes its text)."""
    origin: dict[str, str] = {}
    prompt = _prompt(_get(record, "prompt"), "prompt", origin)
    label = _get(record, "label")
    if isinstance(label, (int, float)) and not isinstance(label, bool):
        label = str(label)
    return [Example({"prompt": prompt, "label": _text(label, "label")}, origin)]


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


# Order matters for detection: the first adapter whose keys a record has wins.
ADAPTERS: dict[str, Adapter] = {
    a.name: a
    for a in (
        _adapter("kto", kto_adapter, {"sft"}, {"messages", "label"}, lambda r: isinstance(r["label"], bool)),
        _adapter("messages", messages_adapter, {"sft"}, {"messages"}),
        _adapter("dpo", dpo_adapter, {"preference"}, {"conversations", "chosen", "rejected"}),
        _adapter("sharegpt", sharegpt_adapter, {"sft"}, {"conversations"}),
        _adapter("seed_tasks", seed_tasks_adapter, {"sft"}, {"instruction", "instances"}),
        _adapter("alpaca", alpaca_adapter, {"sft"}, {"instruction", "output"}),
        _adapter("gsm8k", gsm8k_adapter, {"rl", "sft"}, {"question", "answer"}),
        _adapter("math", math_adapter, {"rl", "sft"}, {"problem", "answer"}),
        _adapter("preference", preference_adapter, {"preference"}, {"prompt", "chosen", "rejected"}),
        _adapter("hh_rlhf", hh_rlhf_adapter, {"preference"}, {"chosen", "rejected"}),
        _adapter("prompt_label", prompt_label_adapter, {"rl"}, {"prompt", "label"}),
    )
}


def detect_format(records: Iterable[Mapping[str, Any]], sample: int = DETECT_SAMPLE) -> str:
    """The format most of the first ``sample`` records match (ties go to the earlier adapter).

    Voting over several records keeps one broken record (say a missing key) from deciding
    the format of the whole file.

    Raises:
        ValueError: no record matches any registered format (the message lists the keys seen).
    """
    votes: Counter[str] = Counter()
    seen: set[str] = set()
    for i, record in enumerate(records):
        if i >= sample:
            break
        seen.update(record.keys())
        for adapter in ADAPTERS.values():
            if adapter.matches(record):
                votes[adapter.name] += 1
                break
    if not votes:
        raise ValueError(
            f"cannot detect the dataset format from keys {sorted(seen)}; pass format= one of {', '.join(ADAPTERS)}"
        )
    order = list(ADAPTERS)
    return max(votes, key=lambda name: (votes[name], -order.index(name)))


def get_adapter(name: str) -> Adapter:
    """The registered adapter called ``name``.

    Raises:
        ValueError: no such format (the message lists the known ones).
    """
    if name not in ADAPTERS:
        raise ValueError(f"unknown dataset format {name!r}; expected one of {', '.join(ADAPTERS)}")
    return ADAPTERS[name]
