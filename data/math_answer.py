r"""When two final answers of math solutions are equal (the ``math`` verifier).

An answer (the content of a solution's last box: :mod:`data.math_extraction`) is normalised
to a canonical string (:mod:`data.math_normalize`), whose structure is read here; two
answers are equal when their structures are, item by item.

Structure
---------
- Bracketed ``(a, b)``, ``[a, b)``, ``(a, b]``, ``[a, b]``: tuples and intervals, equal
  only with the same brackets and items equal in order: ``(1,2)`` != ``(2,1)``,
  ``(3,4]`` != ``(3,4)``.
- ``\{a, b\}`` and a bare list ``a, b``: sets, equal when the items match in any order
  (``3, 5, 7`` = ``7, 3, 5`` = ``\{3,5,7\}``); a tuple never equals a set.
- ``A \cup B``: unions, components matched in any order.
- ``\begin{pmatrix}...\end{pmatrix}`` (also ``bmatrix``, ``matrix``...): matrices,
  cells equal in order, rows split at ``\\``, cells at ``&``.
- ``L = R`` left after normalisation step 8: an equation; equal to another when both sides match, or
  when ``L - R`` of one is a non-zero constant multiple of the other's
  (``2x+2y=4`` = ``x+y-2=0``).

Items (the atoms of the above)
------------------------------
1. Equal normalised strings are equal.
2. Otherwise both are parsed as LaTeX arithmetic and compared exactly when both are
   rational, else at fixed sample points (:mod:`data.math_expression`, which also holds
   the limits that keep this fast on any input).

Parsed answers are cached (an RL step grades many samples against one label).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from data.math_expression import MAX_PARSE_CHARS, _close, _sampled, expressions_equal, parse_expression
from data.math_normalize import _normalize, _strip_prefix


@dataclass(frozen=True)
class Answer:
    """A parsed answer: ``kind`` is atom, text, tuple, set, union, matrix or equation."""

    kind: str
    text: str = ""
    items: tuple = ()
    brackets: str = ""


_OPEN = "([{"
_CLOSE = ")]}"


def _split_top(s: str, sep: str) -> list[str]:
    """Split ``s`` at ``sep`` outside brackets and braces (``\\{``/``\\}`` count as braces)."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        if s.startswith("\\{", i) or s.startswith("\\}", i):
            depth += 1 if s[i + 1] == "{" else -1
            i += 2
            continue
        c = s[i]
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
        elif depth == 0 and s.startswith(sep, i):
            parts.append(s[start:i])
            i += len(sep)
            start = i
            continue
        i += 1
    parts.append(s[start:])
    return parts


def _outer_group(s: str) -> bool:
    """True when the bracket opening ``s`` is closed by its last character (any bracket kind)."""
    depth = 0
    for i, c in enumerate(s):
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
            if depth == 0:
                return i == len(s) - 1
    return False


def _structure(s: str, text: str | None = None) -> Answer:
    if text is not None:
        return Answer("text", text=text)
    m = re.fullmatch(r"\\begin\{([a-zA-Z]*matrix)\}(.*)\\end\{\1\}", s, re.DOTALL)
    if m:
        rows = [r for r in _split_top(m.group(2), "\\\\") if r.strip()]
        cells = tuple(tuple(_structure(_strip_prefix(c)) for c in _split_top(r, "&")) for r in rows)
        return Answer("matrix", items=cells)
    union = _split_top(s, "\\cup")
    if len(union) > 1:
        return Answer("union", items=tuple(_structure(p) for p in union))
    if s.startswith("\\{") and s.endswith("\\}"):
        inner = s[2:-2]
        return Answer("set", items=tuple(_structure(_strip_prefix(p)) for p in _split_top(inner, ",")))
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _outer_group(s):
        parts = _split_top(s[1:-1], ",")
        if len(parts) > 1:
            return Answer("tuple", items=tuple(_structure(_strip_prefix(p)) for p in parts), brackets=s[0] + s[-1])
    parts = _split_top(s, ",")
    if len(parts) > 1:
        return Answer("set", items=tuple(_structure(_strip_prefix(p)) for p in parts))
    sides = _split_top(s, "=")
    if len(sides) == 2 and sides[0] and sides[1]:
        return Answer("equation", items=(Answer("atom", text=sides[0]), Answer("atom", text=sides[1])))
    return Answer("atom", text=s)


@functools.lru_cache(maxsize=4096)
def parse_answer(answer: str) -> Answer:
    """The normalised, structured form of one answer."""
    s, is_text = _normalize(answer)
    if len(answer) > 4 * MAX_PARSE_CHARS:
        return Answer("atom", text=s)
    return _structure(s, s if is_text else None)


def _equations_equal(a: Answer, b: Answer) -> bool:
    la, ra = (item.text for item in a.items)
    lb, rb = (item.text for item in b.items)
    if (la, ra) in ((lb, rb), (rb, lb)):
        return True
    trees = [parse_expression(t) for t in (la, ra, lb, rb)]
    if any(t is None for t in trees):
        return False
    da, db = ("sub", trees[0], trees[1]), ("sub", trees[2], trees[3])
    pairs = _sampled(da, db)
    if len(pairs) < 2 or any(abs(va) < 1e-12 or abs(vb) < 1e-12 for va, vb in pairs):
        return False
    ratios = [vb / va for va, vb in pairs]
    return all(_close(r, ratios[0]) for r in ratios)


# ----------------------------------------------------------------------------------------
# Comparison


def _items_equal(a: Answer, b: Answer) -> bool:
    if a.kind != b.kind:
        if {a.kind, b.kind} == {"text", "atom"}:  # \text{East} vs East
            return a.text.casefold() == " ".join(b.text.split()).casefold()
        return False
    if a.kind == "text":
        return a.text.casefold() == b.text.casefold()
    if a.kind == "atom":
        if a.text == b.text:
            return True
        ta, tb = parse_expression(a.text), parse_expression(b.text)
        return ta is not None and tb is not None and expressions_equal(ta, tb)
    if a.kind == "tuple":
        return a.brackets == b.brackets and _in_order(a.items, b.items)
    if a.kind in ("set", "union"):
        return _any_order(a.items, b.items)
    if a.kind == "matrix":
        return len(a.items) == len(b.items) and all(_in_order(ra, rb) for ra, rb in zip(a.items, b.items))
    if a.kind == "equation":
        return _equations_equal(a, b)
    return False


def _in_order(xs: tuple, ys: tuple) -> bool:
    return len(xs) == len(ys) and all(_items_equal(x, y) for x, y in zip(xs, ys))


def _any_order(xs: tuple, ys: tuple) -> bool:
    if len(xs) != len(ys):
        return False
    unmatched = list(ys)
    for x in xs:
        for k, y in enumerate(unmatched):
            if _items_equal(x, y):
                del unmatched[k]
                break
        else:
            return False
    return True


def answers_equal(got: str, expected: str) -> bool:
    """Whether two final answers (box contents, not whole solutions) are equal (docstring)."""
    try:
        return _items_equal(parse_answer(got), parse_answer(expected))
    except RecursionError:  # absurdly nested brackets
        return got.strip() == expected.strip()
