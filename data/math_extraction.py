r"""The final answer of a math solution: the content of its last ``\boxed{}``.

``last_boxed_answer(text)`` is the content of the last ``\boxed{...}`` or ``\fbox{...}``
(nested braces balanced, ``\{``/``\}`` skipped), or ``\boxed 5`` without braces (the
token up to white space or ``$``). When that last box is not closed the text has no answer.

``boxed_answers(text)`` is the content of every box, in order (None under the same
conditions): a solution that boxes each of several answers (``\boxed{2}, \boxed{3}``) is read
as their list by :func:`data.rewards.math_boxed`, as math-verify reads it
(huggingface/Math-Verify, ``parser.py``: the boxes of a final answer become one set).

Whether two such answers are equal is :mod:`data.math_answer`.
"""

from __future__ import annotations

import re

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _group_end(text: str, open_at: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_at`` (escaped braces skipped), or None."""
    depth, j = 0, open_at
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return j
        j += 1
    return None


def boxed_answers(text: str) -> list[str] | None:
    r"""Contents of every ``\boxed{}``/``\fbox{}`` in ``text``, in order; None when there is no
    box or the last one is unclosed (a truncated response). An unclosed box before the last
    is skipped."""
    found = []
    for m in _BOX.finditer(text):
        j = m.end()
        while j < len(text) and text[j].isspace():
            j += 1
        if j < len(text) and text[j] == "{":
            end = _group_end(text, j)
            if end is not None:
                found.append(text[j + 1 : end])
        elif j > m.end():
            token = re.match(r"[^\s$]+", text[j:])
            if token:
                found.append(token.group())
    last = last_boxed_answer(text)
    if last is None or not found or found[-1] != last:
        return None
    return found


def last_boxed_answer(text: str) -> str | None:
    r"""Content of the last ``\boxed{}``/``\fbox{}`` (or ``\boxed 5``) in ``text``, else None."""
    matches = list(_BOX.finditer(text))
    if not matches:
        return None
    i = matches[-1].end()
    j = i
    while j < len(text) and text[j].isspace():
        j += 1
    if j < len(text) and text[j] == "{":
        end = _group_end(text, j)
        return None if end is None else text[j + 1 : end]
    if j == i:  # "\boxedx" is some other command; "\boxed" at the very end has no answer
        return None
    token = re.match(r"[^\s$]+", text[j:])
    return token.group() if token else None
