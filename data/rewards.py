"""Rule-based verifiers: ``fn(response: str, label: str) -> float`` reward in {0.0, 1.0}.

Registry ``VERIFIERS``:

- ``exact_match``: the response's final answer, whitespace-stripped, equals the
  whitespace-stripped label character for character. The final answer is, in order of
  preference: the content of the last ``\\boxed{...}`` (braces balanced, as MATH solutions
  write it); else the text after the last ``####`` (GSM8K style); else the last non-blank
  line of the response.
- ``gsm8k``: numeric equality of the final number. The response's number is the first
  number after its last ``####`` if it has one; else the first number in its last
  ``\\boxed{...}``; else the last number anywhere in it (as in the GSM8K paper's "last
  number" extraction, Cobbe et al. 2021, arXiv:2110.14168). A number is digits with an
  optional decimal part (``.5`` too), thousands commas only in groups of three
  (``1,000.00`` is one thousand, ``1,2`` is 1 then 2), and a minus sign only where it
  cannot be subtraction (not right after a digit, letter or closing bracket: ``5-3`` is
  5 then 3). Values compare as exact decimals, so ``1,000.00`` equals ``1000`` and
  ``18.0`` equals ``18``. No number scores 0.
- ``math``: boxed answers (MATH, MATH-500; label = the reference ``answer``). The final
  answer is the last ``\\boxed{...}`` or ``\\fbox{...}`` (no box, or an unclosed last box,
  scores 0), or, when that does not match, the list of all its distinct boxes; it equals the
  label after the normalisation documented in ``data.math_normalize``. In short, equal:
  ``1/2`` = ``0.5`` = ``\\frac{1}{2}`` = ``\\dfrac12`` = ``\\tfrac{1}{2}`` (rationals compare
  exactly); ``1,000`` = ``1,\\!000`` = ``1000``; ``5.0`` = ``5``; ``\\$5`` = ``5``;
  ``50\\%`` = ``50``; ``90^\\circ`` = ``90``;
  ``12\\text{ cm}`` = ``12``; ``\\left( 1, 2 \\right)`` = ``(1,2)``; spaces ignored;
  ``x = 3`` = ``3``; ``1\\frac{4}{5}`` = ``9/5``; ``\\sqrt2`` = ``\\sqrt{2}``;
  ``\\frac{\\sqrt3}{3}`` = ``\\frac{1}{\\sqrt3}`` and ``2k+2`` = ``2(k+1)`` (equal values at
  fixed sample points); ``\\text{East}`` = ``east``; ``(C)`` = ``C``; tuples and intervals
  item by item in order, ``\\{...\\}`` sets and bare ``a, b`` lists in any order;
  ``(p,q)=(3,2)`` = ``(3,2)``; ``x\\le5`` = ``5\\ge x`` = ``(-\\infty,5]``; ``x=5+6=11`` = ``11``;
  ``\\pm2`` = ``\\{2,-2\\}``; ``14{,}916`` = ``14916``; ``0,111`` = ``0.111``;
  ``0.0833333333333333`` = ``\\frac{1}{12}``. One grading stops after
  ``data.math_expression.TIME_LIMIT_S`` CPU seconds and then scores 0.
  Not equal: ``1/2`` vs ``2``, ``0.5`` vs ``0.05``, ``1/3`` vs ``0.333``, ``(1,2)`` vs
  ``(2,1)``, ``(1,2)`` vs ``[1,2]``, ``52_8`` vs ``52``, ``x<5`` vs ``x\\le5``, ``0,111``
  vs ``111``.
- ``code``: the response's Python run against the label's tests in a sandbox
  (``data.code_verifier``: label kinds, code extraction, the ``all_pass`` / ``fraction``
  reward; ``data.sandbox``: isolation and limits). Its settings are ``rl.reward.code``, passed
  to :func:`get_verifier` as ``code``.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal, InvalidOperation
from typing import Any, TypeVar

from data.code_verifier import code_reward, limits_of
from data.math_answer import answers_equal
from data.math_expression import start_clock, stop_clock
from data.math_extraction import boxed_answers
from data.stories import story_reward

Verifier = Callable[[str, str], float]

_NUMBER = re.compile(r"(?:(?<![\w)\]])-)?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)")
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
    boxed = last_boxed(response)
    if boxed is not None:
        found = _NUMBER.search(boxed)
        if found:
            return _decimal(found.group())
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


def _boxed_list(boxes: list[str]) -> str:
    """Several boxes as one bare list (``2, 3``), boxes with the same text once."""
    distinct = list(dict.fromkeys(b.strip() for b in boxes if b.strip()))
    return ", ".join(distinct)


def math_boxed(response: str, label: str) -> float:
    """1.0 when the response's last boxed answer equals the label (see ``math`` above); a
    response with several boxes also scores 1.0 when the list of its distinct boxes equals
    the label (``\\boxed{1} and \\boxed{2}`` against ``1, 2``: math-verify's reading of several
    boxes, huggingface/Math-Verify ``tests/test_open_thoughts.py``). A label with several
    boxes is the list of them.

    Raises:
        ValueError: the label is empty (a data error, not a wrong response).
    """
    label_boxes = boxed_answers(label)
    expected = label if label_boxes is None else _boxed_list(label_boxes)
    if not expected.strip():
        raise ValueError(f"math label {label!r} is empty")
    boxes = boxed_answers(response)
    if boxes is None:
        return 0.0
    started = start_clock()  # one time budget for both comparisons below
    try:
        if answers_equal(boxes[-1], expected):
            return 1.0
        # The last box alone is the answer first: "\boxed{4} ... no, \boxed{5}" is 5, not {4, 5}.
        if len(boxes) > 1:
            listed = _boxed_list(boxes)
            if listed != boxes[-1].strip() and answers_equal(listed, expected):
                return 1.0
        return 0.0
    finally:
        if started:
            stop_clock()


VERIFIERS: dict[str, Callable[..., float]] = {
    "exact_match": exact_match,
    "gsm8k": gsm8k,
    "math": math_boxed,
    "story": story_reward,
    "code": code_reward,
}


def label_problem(name: str, label: str) -> str | None:
    """Why verifier ``name`` cannot score against ``label`` (the ValueError it would raise at
    RL or evaluation time: ``gsm8k`` needs a number, ``math`` and ``story`` a non-blank
    label), or None when it can. The verifier is run on an empty response, which reads
    the label exactly as scoring does.

    Raises:
        ValueError: unknown verifier name.
    """
    fn = get_verifier(name)
    try:
        fn("", label, "stop")
    except ValueError as e:
        return str(e)
    return None


def _scorer(fn: Callable[..., float], response: str, label: str, finish_reason: str) -> float:
    if "finish_reason" in inspect.signature(fn).parameters:
        return float(fn(response, label, finish_reason=finish_reason))
    return float(fn(response, label))


def get_verifier(name: str, code: Any = None) -> Callable[[str, str, str], float]:
    """The verifier registered as ``name``, called as ``fn(response, label, finish_reason)``.

    ``code``: the ``code`` verifier's settings (``config.reward.CodeRewardConfig``,
    ``rl.reward.code``: reward mode and sandbox limits); None: its defaults. Other verifiers
    ignore it.

    Verifiers that judge the answer only take ``(response, label)``; those that also judge
    how generation ended (``story``: it must stop at EOS) take a keyword ``finish_reason``
    (``"stop"`` or ``"length"``). The returned callable accepts all three either way.

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    if name not in VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; expected one of {', '.join(VERIFIERS)}")
    fn = VERIFIERS[name]
    if name == "code" and code is not None:
        fn = functools.partial(code_reward, reward=code.reward, limits=limits_of(code))
    return functools.partial(_scorer, fn)


SCORING_THREADS = 4
"""Threads :func:`score_all` scores with. The ``code`` verifier spends its time waiting on a
sandbox process, so scorings overlap: 128 responses of the code quickstart on the 2-core CPU
(load average 14 from other jobs) took 36-43 ms each one after another, 21 ms on 2 threads and
17.5 ms on 4 or 8 (docs/quickstart.md, Code quickstart). Pure-Python verifiers gain nothing
and lose little (the GIL serialises them)."""


Label = TypeVar("Label")  # what score_all's verifier takes as a label (a string; any value for a wrapper)


def score_all(
    verifier: Callable[[str, Label, str], float],
    responses: Sequence[str],
    labels: Sequence[Label],
    finish_reasons: Sequence[str],
    threads: int = SCORING_THREADS,
) -> list[float]:
    """``[verifier(responses[i], labels[i], finish_reasons[i]) for i]`` (a :func:`get_verifier`
    callable), computed on up to ``threads`` threads, in input order.

    Raises:
        ValueError: the three sequences differ in length, or ``threads`` < 1.
        Whatever ``verifier`` raises, for the first failing response in input order.
    """
    if not len(responses) == len(labels) == len(finish_reasons):
        raise ValueError(
            f"score_all: {len(responses)} responses, {len(labels)} labels, "
            f"{len(finish_reasons)} finish reasons; they must match"
        )
    if threads < 1:
        raise ValueError(f"score_all: threads must be >= 1, got {threads}")
    if threads == 1 or len(responses) <= 1:
        return [float(verifier(r, lab, f)) for r, lab, f in zip(responses, labels, finish_reasons)]
    with ThreadPoolExecutor(min(threads, len(responses)), thread_name_prefix="verifier") as pool:
        return [float(x) for x in pool.map(verifier, responses, labels, finish_reasons)]
