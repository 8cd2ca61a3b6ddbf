"""Rule-based verifiers: ``fn(response: str, label: str) -> float`` reward in {0.0, 1.0}.

Registry ``VERIFIERS``:

- ``exact_match``: the response's final answer, whitespace-stripped, equals the
  whitespace-stripped label character for character. The final answer is, in order of
  preference: the content of the last ``\\boxed{...}`` (braces balanced, as MATH solutions
  write it); else the text after the last ``####`` (GSM8K style); else the last non-blank
  line of the response.
- ``gsm8k``: numeric equality of the final number. The response's number is the first
  number after its last ``####`` if it has one, else the last number anywhere in it
  (as in the GSM8K paper's "last number" extraction, Cobbe et al. 2021, arXiv:2110.14168);
  thousands commas are removed and values compare as exact decimals, so ``1,000.00``
  equals ``1000``. No number scores 0.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Callable

Verifier = Callable[[str, str], float]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_BOXED = "\\boxed{"


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (nested braces balanced), or None."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unbalanced: no complete box


def final_answer(response: str) -> str:
    """The final answer text of a response (see ``exact_match`` in the module docstring)."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed.strip()
    if "####" in response:
        return response.rsplit("####", 1)[1].strip()
    lines = [line for line in response.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def exact_match(response: str, label: str) -> float:
    """1.0 when ``final_answer(response) == label.strip()``, else 0.0."""
    return 1.0 if final_answer(response) == label.strip() else 0.0


def _decimal(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None


def final_number(response: str) -> Decimal | None:
    """The number a GSM8K-style response answers with, or None (see ``gsm8k``)."""
    if "####" in response:
        found = _NUMBER.search(response.rsplit("####", 1)[1])
        return _decimal(found.group()) if found else None
    numbers = _NUMBER.findall(response)
    return _decimal(numbers[-1]) if numbers else None


def gsm8k(response: str, label: str) -> float:
    """1.0 when the response's final number equals the numeric label, else 0.0.

    Raises:
        ValueError: the label is not a number (a data error, not a wrong response).
    """
    expected = _decimal(label.strip())
    if expected is None:
        raise ValueError(f"gsm8k label {label!r} is not a number")
    got = final_number(response)
    return 1.0 if got is not None and got == expected else 0.0


VERIFIERS: dict[str, Verifier] = {"exact_match": exact_match, "gsm8k": gsm8k}


def get_verifier(name: str) -> Verifier:
    """The verifier registered as ``name``.

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    if name not in VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; expected one of {', '.join(VERIFIERS)}")
    return VERIFIERS[name]
