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
- ``{a, b}`` (plain braces around a list) is a set too; an item with one ``\pm`` is its
  two values (``\pm 2`` = ``\{2, -2\}``; math-verify ``tests/test_yujianll.py``).
- ``L = M = R``: a chain of steps; the answer is its last side (``x=5+5+1=11`` is ``11``;
  math-verify ``tests/test_all.py``, "last = is considered").
- ``A \approx B``: ``B`` when ``A`` is a name (``x\approx 11``), else the exact ``A``.
- ``x \le 5``, ``5 \ge x``, ``a < x \le b``: a relation in one name (see
  ``data.math_normalize.is_name``) is the interval it describes, compared as a tuple
  (``-793<a<10`` = ``(-793,10)``; ``x<5`` != ``x\le5``).
- ``L = R`` left after normalisation step 8: an equation; equal to another when both sides match, or
  when ``L - R`` of one is a non-zero constant multiple of the other's
  (``2x+2y=4`` = ``x+y-2=0``).

Items (the atoms of the above)
------------------------------
1. Equal normalised strings are equal.
2. Otherwise both are parsed as LaTeX arithmetic and compared exactly when both are
   rational, else at fixed sample points (:mod:`data.math_expression`, which also holds
   the limits that keep this fast on any input). A decimal of ten or more significant
   digits also equals the rational it rounds or cuts to (``0.0833333333333333`` =
   ``\frac{1}{12}``).
3. ``1,22`` (read as a list) equals ``1.22``: a decimal comma, only against a decimal
   written with a point (math-verify ``tests/test_all.py``), so ``0,111`` != ``111``.

Parsed answers are cached (an RL step grades many samples against one label).
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

from data.math_expression import (
    MAX_PARSE_CHARS,
    TIME_LIMIT_S,
    TimeUp,
    _close,
    _sampled,
    check_clock,
    decimal_rounds_to,
    expressions_equal,
    parse_expression,
    start_clock,
    stop_clock,
)
from data.math_normalize import _normalize, _strip_prefix, is_name


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
    if sep not in s:  # the common case, without the walk
        return [s]
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        if not i & 255:
            check_clock()
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


_RELATION_OPS = ("\\le", "\\ge", "<", ">")


def _split_relations(s: str) -> tuple[list[str], list[str]]:
    r"""``s`` split at ``\le``, ``\ge``, ``<``, ``>`` outside brackets: (sides, operators)."""
    if "<" not in s and ">" not in s and "\\le" not in s and "\\ge" not in s:
        return [s.strip()], []
    sides, ops, depth, start, i = [], [], 0, 0, 0
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
        elif depth == 0:
            op = next((o for o in _RELATION_OPS if s.startswith(o, i)), None)
            if op and not (op[0] == "\\" and s[i + len(op) : i + len(op) + 1].isalpha()):
                sides.append(s[start:i])
                ops.append(op)
                i += len(op)
                start = i
                continue
        if c == "\\":
            m = re.match(r"\\(?:[A-Za-z]+|.)?", s[i:], re.DOTALL)  # a command is one step
            i += max(1, len(m.group()) if m else 1)
            continue
        i += 1
    sides.append(s[start:])
    return [side.strip() for side in sides], ops


_UPPER = {"<": ")", "\\le": "]"}
_LOWER = {"<": "(", "\\le": "["}
_FLIP = {"<": ">", ">": "<", "\\le": "\\ge", "\\ge": "\\le"}


def _interval(s: str) -> Answer | None:
    r"""The interval a relation in one name describes, else None: ``x\le5`` = ``5\ge x`` =
    ``(-\infty,5]``; ``-793<a<10`` = ``(-793,10)``; ``0<f(x)<1`` = ``(0,1)`` (math-verify's
    tests/test_all.py, test_open_thoughts.py and test_numina_cases.py)."""
    sides, ops = _split_relations(s)
    if not ops or not all(sides):
        return None
    if len(ops) == 1:
        (a, b), op = sides, ops[0]
        if is_name(b) and not is_name(a):
            a, b, op = b, a, _FLIP[op]
        if not is_name(a) or is_name(b):
            return None
        if op in _UPPER:
            lo, hi, brackets = "-\\infty", b, "(" + _UPPER[op]
        else:
            lo, hi, brackets = b, "\\infty", _LOWER[_FLIP[op]] + ")"
    elif len(ops) == 2 and is_name(sides[1]) and not is_name(sides[0]) and not is_name(sides[2]):
        lo, hi = sides[0], sides[2]
        if ops[0] in _FLIP and ops[1] in _FLIP and ops[0] in (">", "\\ge") and ops[1] in (">", "\\ge"):
            lo, hi, ops = hi, lo, [_FLIP[ops[1]], _FLIP[ops[0]]]
        if ops[0] not in _LOWER or ops[1] not in _UPPER:
            return None
        brackets = _LOWER[ops[0]] + _UPPER[ops[1]]
    else:
        return None
    return Answer("tuple", items=(_structure(lo), _structure(hi)), brackets=brackets)


def _pm_items(s: str) -> list[str]:
    r"""``a \pm b`` as its two values ``a+b``, ``a-b`` (one ``\pm`` or ``\mp`` only; more stay
    as written). math-verify reads ``\pm 2021`` as the set ``{-2021, 2021}``."""
    if s.count("\\pm") + s.count("\\mp") != 1:
        return [s]
    if "\\pm" in s:
        return [s.replace("\\pm", "+"), s.replace("\\pm", "-")]
    return [s.replace("\\mp", "-"), s.replace("\\mp", "+")]


def _set_items(parts: list[str]) -> tuple:
    """Items of a set or list: each without its ``x =`` prefix, each ``\\pm`` item as two."""
    return tuple(_structure(q) for p in parts for q in _pm_items(_strip_prefix(p)))


_PLAIN = re.compile(r"[-+*/^.\w ]*")  # no brackets, commands, lists or relations: an atom


def _structure(s: str, text: str | None = None) -> Answer:
    check_clock()
    if text is not None:
        return Answer("text", text=text)
    if _PLAIN.fullmatch(s):
        return Answer("atom", text=s)
    m = re.fullmatch(r"\\begin\{([a-zA-Z]*matrix)\}(.*)\\end\{\1\}", s, re.DOTALL)
    if m:
        rows = [r for r in _split_top(m.group(2), "\\\\") if r.strip()]
        cells = tuple(tuple(_structure(_strip_prefix(c)) for c in _split_top(r, "&")) for r in rows)
        return Answer("matrix", items=cells)
    union = _split_top(s, "\\cup")
    if len(union) > 1:
        return Answer("union", items=tuple(_structure(p) for p in union))
    if s.startswith("\\{") and s.endswith("\\}"):
        return Answer("set", items=_set_items(_split_top(s[2:-2], ",")), brackets="{}")
    if len(s) >= 2 and s[0] == "{" and s[-1] == "}" and _outer_group(s):
        parts = _split_top(s[1:-1], ",")  # {1,3}: braces a writer meant as a set
        if len(parts) > 1:
            return Answer("set", items=_set_items(parts), brackets="{}")
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _outer_group(s):
        parts = _split_top(s[1:-1], ",")
        if len(parts) > 1:
            return Answer("tuple", items=tuple(_structure(_strip_prefix(p)) for p in parts), brackets=s[0] + s[-1])
    parts = _split_top(s, ",")
    if len(parts) > 1:
        return Answer("set", items=_set_items(parts))
    sides = _split_top(s, "=")
    if len(sides) > 2 and all(sides):
        # x = 5+5+1 = 7 = 11: a chain of steps ends on the answer (math-verify: "last = is considered")
        return _structure(sides[-1])
    approx = _split_top(s, "\\approx")
    if len(approx) == 2 and all(approx):
        # "x \approx 11" is 11; "1/3 \approx 0.33" is 1/3: the exact value, not its rounding
        return _structure(approx[1] if is_name(approx[0]) else _strip_prefix(approx[0]))
    interval = _interval(s)
    if interval is not None:
        return interval
    if len(sides) == 2 and sides[0] and sides[1]:
        return Answer("equation", items=(Answer("atom", text=sides[0]), Answer("atom", text=sides[1])))
    values = _pm_items(s)
    if len(values) == 2:
        return Answer("set", items=tuple(_structure(v) for v in values))
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
    check_clock()
    if a.kind != b.kind:
        if {a.kind, b.kind} == {"text", "atom"}:  # \text{East} vs East
            return a.text.casefold() == " ".join(b.text.split()).casefold()
        if {a.kind, b.kind} == {"set", "atom"}:
            return _decimal_comma_equal(a, b) if a.kind == "set" else _decimal_comma_equal(b, a)
        return False
    if a.kind == "text":
        return a.text.casefold() == b.text.casefold()
    if a.kind == "atom":
        if a.text == b.text:
            return True
        ta, tb = parse_expression(a.text), parse_expression(b.text)
        if ta is None or tb is None:
            return False
        return expressions_equal(ta, tb) or decimal_rounds_to(a.text, tb) or decimal_rounds_to(b.text, ta)
    if a.kind == "tuple":
        return a.brackets == b.brackets and _in_order(a.items, b.items)
    if a.kind in ("set", "union"):
        return _any_order(a.items, b.items)
    if a.kind == "matrix":
        return len(a.items) == len(b.items) and all(_in_order(ra, rb) for ra, rb in zip(a.items, b.items))
    if a.kind == "equation":
        return _equations_equal(a, b)
    return False


_DECIMAL = re.compile(r"-?\d*\.\d+")


def _decimal_comma_equal(pair: Answer, number: Answer) -> bool:
    r"""``1,22`` (read as the list {1, 22}) against a decimal written with a point, ``1.22``: a
    decimal comma (math-verify's ``test_number_extraction``: ``0,111`` = ``0.111``). Only
    against a decimal with a point, so ``0,111`` never equals ``111``, and never for a set in
    braces (``\{1,22\}`` is two numbers)."""
    if pair.brackets or len(pair.items) != 2 or not _DECIMAL.fullmatch(number.text):
        return False
    whole, frac = (item.text for item in pair.items)
    if not re.fullmatch(r"-?\d+", whole) or not re.fullmatch(r"\d+", frac):
        return False
    return Fraction(f"{whole}.{frac}") == Fraction(number.text)


def _in_order(xs: tuple, ys: tuple) -> bool:
    return len(xs) == len(ys) and all(_items_equal(x, y) for x, y in zip(xs, ys))


def _any_order(xs: tuple, ys: tuple) -> bool:
    if len(xs) != len(ys):
        return False
    # Items written identically pair off first: the pairwise search below is quadratic.
    pool = Counter(ys)
    rest = []
    for x in xs:
        if pool[x] > 0:
            pool[x] -= 1
        else:
            rest.append(x)
    unmatched = list(pool.elements())
    for x in rest:
        for k, y in enumerate(unmatched):
            if _items_equal(x, y):
                del unmatched[k]
                break
        else:
            return False
    return True


def answers_equal(got: str, expected: str) -> bool:
    """Whether two final answers (box contents, not whole solutions) are equal (docstring).

    One call takes at most about ``TIME_LIMIT_S`` seconds: a comparison still running then is
    unequal (a reward must not stall an RL step on one pathological response).
    """
    started = start_clock(TIME_LIMIT_S)
    try:
        return _items_equal(parse_answer(got), parse_answer(expected))
    except RecursionError:  # absurdly nested brackets
        return got.strip() == expected.strip()
    except TimeUp:
        return False
    finally:
        if started:
            stop_clock()
