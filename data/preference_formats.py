"""Preference-pair formats: ``dpo``, ``dpo_messages``, ``preference`` and ``hh_rlhf`` (keys
and kinds: the table of :mod:`data.adapters`). Rows with tool definitions are refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from data.adapter_fields import SHAREGPT_ROLES, Example, FieldError, _get, _json_type, _no_tools, _prompt, _text, _turns


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
        _get(record, "conversations"),
        "conversations",
        "prompt",
        origin,
        role_key="from",
        content_key="value",
        role_map=SHAREGPT_ROLES,
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
    origin = {k: v for k, v in chosen_origin.items() if k.startswith("prompt[") and int(k[7 : k.index("]")]) < n}
    origin |= {
        "prompt": "chosen_messages",
        "chosen": f"chosen_messages[{n}].content",
        "rejected": f"rejected_messages[{n}].content",
    }
    return [Example({"prompt": chosen[:n], "chosen": responses[0], "rejected": responses[1]}, origin)]


def _completion(value: Any) -> str:
    """An unpaired row's completion: a string, or (TRL's conversational form) a list holding one
    assistant message."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or len(value) != 1 or not isinstance(value[0], dict):
        raise FieldError("completion", f"expected a string or a list of one assistant message, got {_json_type(value)}")
    role = value[0].get("role")
    if role != "assistant":
        raise FieldError("completion[0].role", f"expected 'assistant', got {role!r}")
    return _text(_get(value[0], "content", "completion[0].content"), "completion[0].content")


def unpaired_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """TRL's unpaired preference rows (``KTOTrainer``'s dataset format)
    ``{"prompt": str | messages, "completion": str | [assistant message], "label": bool}`` -> one
    kto row: the prompt as messages, the completion's text and the label.

    Raises:
        FieldError: a non-boolean ``label``; a completion that is neither a string nor one
            assistant message; ``tools`` (a kto prompt carries none).
    """
    _no_tools(record)
    label = _get(record, "label")
    if not isinstance(label, bool):
        raise FieldError("label", f"expected true or false, got {_json_type(label)}")
    origin: dict[str, str] = {}
    prompt = _prompt(_get(record, "prompt"), "prompt", origin)
    completion = record.get("completion")
    origin["completion"] = "completion" if isinstance(completion, str) else "completion[0].content"
    return [Example({"prompt": prompt, "completion": _completion(_get(record, "completion")), "label": label}, origin)]


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
    prompt = [{"role": _HH_ROLES[speaker], "content": text.strip()} for speaker, text in zip(parts[1::2], parts[2::2])]
    start = cut + len(_HH_ANSWER)
    row = {"prompt": prompt, "chosen": chosen[start:].strip(), "rejected": rejected[start:].strip()}
    origin = {f"prompt[{i}].{k}": "chosen" for i in range(len(prompt)) for k in ("role", "content")}
    origin["prompt"] = "chosen"
    return [Example(row, origin)]
