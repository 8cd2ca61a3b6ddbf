r"""The final answer of a math solution: the content of its last ``\boxed{}``.

``last_boxed_answer(text)`` is the content of the last ``\boxed{...}`` or ``\fbox{...}``
(nested braces balanced, ``\{``/``\}`` skipped), or ``\boxed 5`` without braces (the
token up to white space or ``$``). When that last box is not closed the text has no answer.

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
