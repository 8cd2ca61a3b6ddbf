"""Problems with a reference answer: ``gsm8k``, ``math`` and ``prompt_label`` give rl prompts
and labels, gsm8k and math sft rows too (keys and kinds: the table of :mod:`data.adapters`).

GSM8K as sft keeps the answer verbatim, calculator annotations (``<<2*3=6>>``) included.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from data.adapter_fields import Example, FieldError, _get, _prompt, _text, _with_tools, label_text

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
        return [
            Example(
                {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]},
                {"messages[0].content": "question", "messages[1].content": "answer"},
            )
        ]
    if isinstance(raw, str):
        try:
            answer = gsm8k_label(answer)
        except ValueError as e:
            raise FieldError("answer", str(e)) from None
    origin = {"prompt[0].content": "question", "label": "answer"}
    return [
        Example(
            _with_tools({"prompt": [{"role": "user", "content": question}], "label": answer}, record, origin), origin
        )
    ]


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
        return [
            Example(
                {"messages": [{"role": "user", "content": problem}, {"role": "assistant", "content": reply}]},
                {"messages[0].content": key, "messages[1].content": src},
            )
        ]
    label = label_text(_get(record, "answer"), "answer").strip()
    origin = {"prompt[0].content": key, "label": "answer"}
    return [
        Example(_with_tools({"prompt": [{"role": "user", "content": problem}], "label": label}, record, origin), origin)
    ]


def prompt_label_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """``{"prompt": str | messages, "label": str | number}`` -> rl (a number label as ``label_text``)."""
    origin: dict[str, str] = {}
    prompt = _prompt(_get(record, "prompt"), "prompt", origin)
    row = {"prompt": prompt, "label": label_text(_get(record, "label"), "label")}
    return [Example(_with_tools(row, record, origin), origin)]
