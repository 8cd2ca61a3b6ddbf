r"""Boxed final answers of math solutions and when two of them are equal (the ``math`` verifier).

Extraction
----------
``last_boxed_answer(text)`` is the content of the last ``\boxed{...}`` or ``\fbox{...}``
(nested braces balanced, ``\{``/``\}`` skipped), or ``\boxed 5`` without braces (the
token up to white space or ``$``). When that last box is not closed the text has no answer.

Normalisation (``normalize``)
-----------------------------
1. ``$`` and ``\$``, ``\displaystyle``, ``\left``/``\right`` (``\left.`` too),
   ``\big``-style sizes and a trailing ``.`` are dropped.
2. Thousands separators: ``,\!`` between digits, and a comma followed by exactly three
   digits, are removed, so ``10,\!080``, ``10,080`` and ``10080`` are equal. A comma
   followed by a space separates items (``2, 100`` is the list {2, 100}), and so does
   every plain comma of a number written directly inside brackets or next to another
   comma: ``(12,102)`` is a pair, ``(12,\!102)`` is one number in parentheses.
3. Spacing (``\! \, \; \: \quad \qquad ~``) and white space are dropped (one space is kept
   between a command and a letter, ``\cot x``).
4. ``\dfrac``/``\tfrac``/``\cfrac`` are ``\frac``; ``\dbinom``/``\tbinom`` are ``\binom``;
   TeX's one-token arguments get braces: ``\frac12`` = ``\frac 1 2`` = ``\frac{1}{2}``,
   ``\frac9{19}``, ``\sqrt2`` = ``\sqrt{2}``, ``x^2`` = ``x^{2}``, ``52_8`` = ``52_{8}``.
5. Units: degrees (``^\circ``, ``^{\circ}``, ``\circ`` after a number, ``\degree``, ``°``) and percent
   (``\%``, ``%``) are dropped (``50\%`` equals ``50``, not ``0.5``); a trailing
   ``\text{...}``/``\mbox{...}``/``\textrm{...}`` (or ``\mathrm{..}`` of two letters or
   more), with an optional power (``\mbox{ inches}^2``), after some other content is a
   unit and dropped; so is a trailing plain unit word from a short list (``cm``,
   ``inches``, ``degrees``, ``dollars``, ``cents``, ``units``...) after a number.
6. Remaining ``\text{}``, ``\textbf{}``, ``\mbox{}``, ``\mathrm{}``... wrappers are
   unwrapped. An answer that is one such wrapper is a *text answer* (``\text{East}``):
   compared case-insensitively with its spaces collapsed, never as math. A lone capital
   letter in parentheses is that letter: ``(C)`` = ``C`` = ``\text{(C)}``.
7. ``\cdot``, ``\times`` are ``*``; ``\leq``/``\geq`` are ``\le``/``\ge``; ``\text{ and }``
   and ``\text{ or }`` are commas (``2\text{ and }3`` = ``2, 3``).
8. A leading ``x =`` / ``x \in`` (one letter or Greek command, optionally with a
   subscript or ``(x)``: ``f(x) =``, ``\theta =``) is dropped, for the whole answer and
   for each item of a list.
9. A mixed number ``1\frac{4}{5}`` (an integer followed by a proper fraction of integers)
   is ``9/5``, not ``1 * 4/5``.

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
- ``L = R`` left after step 8: an equation; equal to another when both sides match, or
  when ``L - R`` of one is a non-zero constant multiple of the other's
  (``2x+2y=4`` = ``x+y-2=0``).

Items (the atoms of the above)
------------------------------
1. Equal normalised strings are equal.
2. Otherwise each is parsed by a small LaTeX arithmetic parser (numbers, letters,
   ``\pi``, ``i``, ``+ - * / ^``, juxtaposition, ``\frac``, ``\sqrt``, ``\sqrt[n]``,
   ``\binom``, ``!``, ``\sin``... ``\ln``, ``\log``, ``\exp``); nothing is ``eval``-ed.
   ``i`` is the imaginary unit, ``e`` a plain variable. An item it cannot parse (``\pm``,
   ``|x|``, ``\infty``, base subscripts ``52_8``, three or more letters in a row, which
   are a word rather than a product) is only string-compared.
3. When both sides are rational numbers (integers, decimals, fractions, powers with
   integer exponents) they are compared exactly with ``fractions.Fraction``: ``1/2`` =
   ``0.5`` = ``\frac{1}{2}`` = ``\dfrac12`` = ``2^{-1}`` = ``.50``; ``5`` = ``5.0``;
   ``-\frac{1}{2}`` = ``\frac{-1}{2}`` = ``-0.5``; ``1/3`` != ``0.333``, ``0.5`` != ``0.05``.
4. Otherwise (square roots, ``\pi``, variables, functions) both are evaluated at three
   fixed points of their variables in complex floating
   point, and are equal when they agree to a relative ``1e-10`` at every point where both
   are defined (at least two): ``\frac{\sqrt{3}}{3}`` = ``\frac{1}{\sqrt3}``,
   ``2k+2`` = ``2(k+1)``, ``x^2-1`` = ``(x-1)(x+1)``; ``3\sqrt{13}`` != ``3\sqrt{14}``.
   Consequently an expanded form equals a factored one, and a decimal equals an
   irrational number only when it is right to about ten significant digits.

Limits keep it fast on any input: items longer than ``MAX_PARSE_CHARS`` are only
string-compared (whole answers longer than four times that are not normalised at all),
expression trees are capped at ``MAX_NODES`` nodes, exact powers at ``MAX_EXACT_BITS``
bits and factorials/binomials at ``MAX_FACTORIAL``. Parsed answers are cached (an RL
step grades many samples against one label).
"""

from __future__ import annotations

import cmath
import functools
import math
import re
from dataclasses import dataclass
from fractions import Fraction

MAX_PARSE_CHARS = 400
MAX_NODES = 300
MAX_EXACT_BITS = 20_000
MAX_FACTORIAL = 1000
REL_TOL = 1e-10

# ----------------------------------------------------------------------------------------
# Extraction

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


# ----------------------------------------------------------------------------------------
# Normalisation to a canonical string

_TEXT_CMDS = (
    "text", "textbf", "textit", "textrm", "textnormal", "textsf", "texttt", "mbox",
    "mathrm", "mathbf", "mathit", "mathsf", "mathtt", "operatorname",
)
_TEXT_RE = "|".join(_TEXT_CMDS)
_TEXT_OPEN = re.compile(rf"\\(?:{_TEXT_RE})(?![A-Za-z])\s*(?=\{{)")
_WHOLE_TEXT = re.compile(rf"\\(?:{_TEXT_RE})\s*\{{([^{{}}]*)\}}")
_TRAILING_UNIT_TEXT = re.compile(
    rf"\\(?P<cmd>{_TEXT_RE})\s*\{{(?P<unit>[^{{}}]*)\}}(?:\s*\^\s*(?:\{{\s*\d\s*\}}|\d))?\s*$"
)
_UNIT_WORDS = (
    "degrees|degree|deg|radians|radian|rad|percent|cm|mm|km|meters|meter|metres|metre|inches|inch|"
    "feet|foot|ft|yards|yard|yd|miles|mile|units|unit|cents|cent|dollars|dollar|hours|hour|hrs|hr|"
    "minutes|minute|mins|min|seconds|second|secs|days|day|weeks|week|months|month|years|year|"
    "grams|gram|kg|pounds|pound|lbs|lb|ounces|ounce|oz|liters|liter|litres|litre|ml|gallons|gallon|mph|"
    "square|sq|cubic|people|students|ways|times|points|sides|tiles|boxes|marbles|coins|eggs|apples"
)
_TRAILING_UNIT_WORD = re.compile(
    rf"(?<=[\d}}).])\s*(?:(?:square|sq\.?|cubic)\s+)?(?:{_UNIT_WORDS})(?:\s*\^\s*(?:\{{\s*\d\s*\}}|\d))?\s*$",
    re.IGNORECASE,
)
_SIZES = re.compile(r"\\(?:big|Big|bigg|Bigg)[lrm]?(?![A-Za-z])")
_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?![A-Za-z])\s*\.?")
_SPACING = re.compile(r"(?<!\\)\\[!,;: ]|\\q?quad(?![A-Za-z])|~")
_DEGREES = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![A-Za-z])|(?<=[\d}])\s*\\circ(?![A-Za-z])|\^\s*\{\s*\\degree\s*\}|\\degree(?![A-Za-z])|°")
_LATEX_THOUSANDS = re.compile(r"(?<=\d),\\!\s*(?=\d{3}(?!\d))")
_THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?![\d])(?!,\d)")
_PREFIX = re.compile(r"^(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?[A-Za-z0-9]+\}?)?(?:\([A-Za-z]\))?(?:=|\\in(?![A-Za-z]))")
_MIXED = re.compile(r"^(-?)(\d+)\\frac\{(\d+)\}\{(\d+)\}$")
_CHOICE = re.compile(r"^\(([A-Z])\)$")


def _read_arg(s: str, i: int) -> tuple[str, int] | None:
    """One TeX argument at ``s[i:]``: a ``{group}``, a ``\\command`` or one character."""
    while i < len(s) and s[i].isspace():
        i += 1
    if i >= len(s):
        return None
    if s[i] == "{":
        end = _group_end(s, i)
        if end is None:
            return None
        return s[i + 1 : end], end + 1
    if s[i] == "\\":
        m = re.match(r"\\(?:[A-Za-z]+|.)", s[i:])
        return (m.group(), i + len(m.group())) if m else None
    if s[i] in "}^_":
        return None
    return s[i], i + 1


def _brace_commands(s: str) -> str:
    r"""Give ``\frac``, ``\binom``, ``\sqrt``, ``^`` and ``_`` braced arguments, recursively."""
    out: list[str] = []
    i = 0
    while i < len(s):
        m = re.match(r"\\(frac|binom|sqrt)(?![A-Za-z])", s[i:])
        if m:
            name = m.group(1)
            j = i + len(m.group())
            index = ""
            if name == "sqrt":
                k = j
                while k < len(s) and s[k].isspace():
                    k += 1
                if k < len(s) and s[k] == "[":
                    close = s.find("]", k)
                    if close > 0:
                        index = "[" + _brace_commands(s[k + 1 : close]) + "]"
                        j = close + 1
            args = []
            for _ in range(2 if name in ("frac", "binom") else 1):
                got = _read_arg(s, j)
                if got is None:
                    break
                args.append(_brace_commands(got[0]))
                j = got[1]
            else:
                out.append(f"\\{name}{index}" + "".join("{" + a + "}" for a in args))
                i = j
                continue
            out.append(s[i:])  # malformed: keep the rest as it is
            break
        if s[i] in "^_":
            got = _read_arg(s, i + 1)
            if got is not None:
                out.append(s[i] + "{" + _brace_commands(got[0]) + "}")
                i = got[1]
                continue
        if s[i] == "\\" and i + 1 < len(s):
            m = re.match(r"\\(?:[A-Za-z]+|.)", s[i:])
            out.append(m.group())
            i += len(m.group())
            continue
        out.append(s[i])
        i += 1
    return "".join(out)


def _drop_thousands(s: str, m: re.Match) -> str:
    """``1,000`` -> ``1000``, except as an item of a bracketed or comma list: ``(12,102)``."""
    before, after = s[: m.start()].rstrip(), s[m.end() :].lstrip()
    if before.endswith(("(", "[", "\\{", ",")) or after.startswith((")", "]", "\\}", ",")):
        return m.group()
    return m.group().replace(",", "")


def _unwrap_text(s: str) -> str:
    r"""``\text{abc}`` -> ``abc`` for every text-style wrapper (nested braces balanced)."""
    while True:
        m = _TEXT_OPEN.search(s)
        if not m:
            return s
        end = _group_end(s, m.end())
        if end is None:
            return s
        s = s[: m.start()] + s[m.end() + 1 : end] + s[end + 1 :]


def _squeeze_spaces(s: str) -> str:
    """Drop white space, keeping one space between a command name and a following letter."""

    def repl(m: re.Match) -> str:
        cmd = m.group(1) or ""
        return cmd + (" " if cmd and m.group(2).isalpha() else "")

    return re.sub(r"(\\[A-Za-z]+)?\s+(?=(.?))", repl, s)


def _strip_prefix(s: str) -> str:
    r"""Drop a leading ``x =``, ``f(x) =``, ``\theta =`` or ``x \in`` (see rule 8)."""
    m = _PREFIX.match(s)
    if not m or m.end() == len(s):
        return s
    head = re.match(r"\\([A-Za-z]+)", m.group())
    if head and head.group(1) not in _GREEK:
        return s
    rest = s[m.end() :]
    return s if "=" in rest else rest


def _is_text_answer(s: str) -> str | None:
    """The words of an answer that is one text wrapper (rule 6), else None."""
    m = _WHOLE_TEXT.fullmatch(s)
    return m.group(1) if m else None


def _clean(s: str) -> str:
    """Rules 1-5 and 7: string clean-up before text answers are recognised and unwrapped."""
    s = s.strip()
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\\(?:displaystyle|textstyle)(?![A-Za-z])", "", s)
    s = _SIZES.sub("", s)
    s = _LEFT_RIGHT.sub("", s)
    s = _LATEX_THOUSANDS.sub("", s)
    s = _SPACING.sub(" ", s)
    s = re.sub(r"\\[dtc]frac(?![A-Za-z])", r"\\frac", s)
    s = re.sub(r"\\[dt]binom(?![A-Za-z])", r"\\binom", s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.strip().rstrip(".").strip()
    for _ in range(3):  # "5\text{ cm}^2", "12 \text{ square} \text{ units}"
        m = _TRAILING_UNIT_TEXT.search(s)
        if not m or not s[: m.start()].strip():
            break
        unit = m.group("unit")
        if m.group("cmd") == "mathrm" and len(re.findall(r"[A-Za-z]", unit)) < 2:
            break
        s = s[: m.start()].rstrip()
    m = _TRAILING_UNIT_WORD.search(s)
    if m and s[: m.start()].strip():
        s = s[: m.start()].rstrip()
    s = re.sub(r"\\(?:text|mbox)\s*\{\s*(?:and|or|,)\s*\}", ",", s)
    s = s.replace("\\leq", "\\le").replace("\\geq", "\\ge")
    s = re.sub(r"\\(?:cdot|times)(?![A-Za-z])", "*", s)
    return s.strip()


def normalize(answer: str) -> str:
    """The canonical string of one answer (the rules in the module docstring)."""
    return _normalize(answer)[0]


def _normalize(answer: str) -> tuple[str, bool]:
    """``(canonical string, is a text answer)``."""
    if len(answer) > 4 * MAX_PARSE_CHARS:
        return answer.strip(), False
    s = _clean(answer)
    words = _is_text_answer(s)
    if words is not None:
        words = " ".join(words.split())
        choice = _CHOICE.fullmatch(words)
        return (choice.group(1) if choice else words), True
    s = _unwrap_text(s)
    s = _THOUSANDS.sub(lambda m: _drop_thousands(s, m), s)
    s = _brace_commands(s)
    s = _squeeze_spaces(s)
    s = s.rstrip(".")
    s = _strip_prefix(s)
    m = _MIXED.match(s)
    if m and int(m.group(3)) < int(m.group(4)):
        sign, whole, num, den = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
        s = f"{sign}\\frac{{{whole * den + num}}}{{{den}}}"
    choice = _CHOICE.fullmatch(s)
    return (choice.group(1) if choice else s), False


# ----------------------------------------------------------------------------------------
# Structure: tuples, intervals, sets, lists, unions, matrices, equations


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


# ----------------------------------------------------------------------------------------
# A small LaTeX arithmetic parser (no eval): expression trees of tuples
#   ("num", Fraction) ("sym", name) ("pi",) ("I",) ("add", a, b) ("sub", a, b) ("mul", a, b)
#   ("div", a, b) ("neg", a) ("pow", a, b) ("root", a, n) ("fact", a) ("binom", a, b)
#   ("fn", name, a) ("log", base, a)

Node = tuple


class _ParseError(Exception):
    pass


class _NotExact(Exception):
    pass


_FUNCS = {"sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh", "ln", "log", "exp"}
_GREEK = {
    "alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta", "vartheta", "iota",
    "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "upsilon", "phi", "varphi", "chi", "psi",
    "omega", "Gamma", "Delta", "Theta", "Lambda", "Xi", "Sigma", "Phi", "Psi", "Omega",
}
_TOKEN = re.compile(r"\d+\.?\d*|\.\d+|\\[A-Za-z]+|\\.|[A-Za-z]|\S")


class _Parser:
    """Recursive descent over tokens; ``_ParseError`` on anything outside the grammar."""

    def __init__(self, text: str):
        self.tokens = _TOKEN.findall(text)
        self.i = 0
        self.nodes = 0

    def parse(self) -> Node:
        node = self.expr()
        if self.i != len(self.tokens):
            raise _ParseError(f"unexpected {self.peek()!r}")
        return node

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise _ParseError(f"expected {expected!r}, got {tok!r}")
        self.i += 1
        return tok

    def node(self, *parts) -> Node:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise _ParseError("expression too large")
        return tuple(parts)

    def expr(self) -> Node:
        node = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            node = self.node("add" if op == "+" else "sub", node, self.term())
        return node

    def term(self) -> Node:
        node = self.signed()
        while self.peek() in ("*", "/", "\\div"):
            op = self.take()
            rhs = self.signed()
            node = self.node("mul", node, rhs) if op == "*" else self.node("div", node, rhs)
        return node

    def signed(self) -> Node:
        if self.peek() == "-":
            self.take()
            return self.node("neg", self.signed())
        if self.peek() == "+":
            self.take()
            return self.signed()
        return self.implicit()

    def _starts_factor(self, tok: str | None) -> bool:
        if tok is None:
            return False
        if tok in ("(", "{", "[") or tok[0].isdigit() or tok[0] == "." or tok.isalpha():
            return True
        return tok.startswith("\\") and tok[1:] in ({"frac", "sqrt", "binom", "pi"} | _FUNCS | _GREEK)

    def implicit(self, stop_at_function: bool = False) -> Node:
        node = self.power()
        while self._starts_factor(self.peek()):
            if stop_at_function and self.peek()[1:] in _FUNCS:
                break
            node = self.node("mul", node, self.power())
        return node

    def power(self) -> Node:
        base = self.postfix()
        if self.peek() == "^":
            self.take()
            if self.peek() != "{":
                raise _ParseError("exponent without braces")
            exponent = self.group()
            return self.node("pow", base, exponent)
        return base

    def postfix(self) -> Node:
        node = self.primary()
        while self.peek() == "!":
            self.take()
            node = self.node("fact", node)
        return node

    def group(self) -> Node:
        closing = {"(": ")", "{": "}", "[": "]"}[self.take()]
        node = self.expr()
        self.take(closing)
        return node

    def primary(self) -> Node:
        tok = self.peek()
        if tok is None:
            raise _ParseError("unexpected end")
        if tok in ("(", "{", "["):
            return self.group()
        if tok[0].isdigit() or tok[0] == ".":
            self.take()
            if self.peek() == "_":
                raise _ParseError("base subscript")
            return self.node("num", Fraction(tok))
        if tok.isalpha() and len(tok) == 1:
            self.take()
            name = tok
            if self.peek() == "_":  # x_1, a_{n}: part of the name
                self.take()
                if self.peek() != "{":
                    raise _ParseError("subscript without braces")
                start = self.i
                depth = 0
                while True:
                    t = self.take()
                    depth += (t == "{") - (t == "}")
                    if depth == 0:
                        break
                name += "_" + "".join(self.tokens[start : self.i])
            return self.node("I") if name == "i" else self.node("sym", name)
        if tok.startswith("\\"):
            cmd = tok[1:]
            self.take()
            if cmd == "frac":
                return self.node("div", self.braced(), self.braced())
            if cmd == "binom":
                return self.node("binom", self.braced(), self.braced())
            if cmd == "sqrt":
                index = None
                if self.peek() == "[":
                    index = self.group()
                return self.node("root", self.braced(), index or self.node("num", Fraction(2)))
            if cmd == "pi":
                return self.node("pi")
            if cmd in _GREEK:
                return self.node("sym", tok)
            if cmd in _FUNCS:
                return self.function(cmd)
        raise _ParseError(f"unsupported token {tok!r}")

    def braced(self) -> Node:
        if self.peek() != "{":
            raise _ParseError("expected a braced argument")
        return self.group()

    def function(self, name: str) -> Node:
        base = None
        if name == "log" and self.peek() == "_":
            self.take()
            base = self.braced()
        power = None
        if self.peek() == "^":  # \sin^{2}x = (\sin x)^2
            self.take()
            power = self.braced()
        if self.peek() in ("(", "{", "["):
            arg = self.group()
            while self.peek() == "!":
                self.take()
                arg = self.node("fact", arg)
        else:
            arg = self.implicit(stop_at_function=True)
        node = self.node("log", base, arg) if base is not None else self.node("fn", name, arg)
        return self.node("pow", node, power) if power is not None else node


@functools.lru_cache(maxsize=4096)
def parse_expression(text: str) -> Node | None:
    """The expression tree of ``text`` (a normalised item), or None when outside the grammar."""
    if not text or len(text) > MAX_PARSE_CHARS:
        return None
    if re.search(r"[A-Za-z]{3,}", re.sub(r"\\[A-Za-z]+", " ", text)):
        return None  # a word, not a product of one-letter variables
    try:
        return _Parser(text).parse()
    except (_ParseError, ValueError, ZeroDivisionError, RecursionError):
        return None


# ----------------------------------------------------------------------------------------
# Evaluation: exact (Fraction) and sampled (complex floats)


def _exact_pow(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise _NotExact
    e = exponent.numerator
    bits = max(base.numerator.bit_length(), base.denominator.bit_length())
    if abs(e) * bits > MAX_EXACT_BITS:
        raise _NotExact
    if base == 0 and e < 0:
        raise _NotExact
    return base**e


def _exact_root(value: Fraction, index: Fraction) -> Fraction:
    if index != 2 or value < 0:
        raise _NotExact
    n, d = math.isqrt(value.numerator), math.isqrt(value.denominator)
    if n * n != value.numerator or d * d != value.denominator:
        raise _NotExact
    return Fraction(n, d)


def _small_int(value: Fraction) -> int:
    if value.denominator != 1 or not 0 <= value.numerator <= MAX_FACTORIAL:
        raise _NotExact
    return value.numerator


def exact_value(node: Node) -> Fraction:
    """The rational value of a tree of numbers and arithmetic; ``_NotExact`` otherwise."""
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind == "neg":
        return -exact_value(node[1])
    if kind in ("add", "sub", "mul", "div"):
        a, b = exact_value(node[1]), exact_value(node[2])
        if kind == "add":
            return a + b
        if kind == "sub":
            return a - b
        if kind == "mul":
            return a * b
        if b == 0:
            raise _NotExact
        return a / b
    if kind == "pow":
        return _exact_pow(exact_value(node[1]), exact_value(node[2]))
    if kind == "root":
        return _exact_root(exact_value(node[1]), exact_value(node[2]))
    if kind == "fact":
        return Fraction(math.factorial(_small_int(exact_value(node[1]))))
    if kind == "binom":
        return Fraction(math.comb(_small_int(exact_value(node[1])), _small_int(exact_value(node[2]))))
    raise _NotExact


_FN = {
    "sin": cmath.sin, "cos": cmath.cos, "tan": cmath.tan,
    "cot": lambda z: 1 / cmath.tan(z), "sec": lambda z: 1 / cmath.cos(z), "csc": lambda z: 1 / cmath.sin(z),
    "arcsin": cmath.asin, "arccos": cmath.acos, "arctan": cmath.atan,
    "sinh": cmath.sinh, "cosh": cmath.cosh, "tanh": cmath.tanh,
    "ln": cmath.log, "log": cmath.log, "exp": cmath.exp,
}


def _num(node: Node, env: dict[str, complex]) -> complex:
    kind = node[0]
    if kind == "num":
        return complex(node[1])
    if kind == "sym":
        return env[node[1]]
    if kind == "pi":
        return complex(math.pi)
    if kind == "I":
        return 1j
    if kind == "neg":
        return -_num(node[1], env)
    if kind in ("add", "sub", "mul", "div"):
        a, b = _num(node[1], env), _num(node[2], env)
        return a + b if kind == "add" else a - b if kind == "sub" else a * b if kind == "mul" else a / b
    if kind == "pow":
        base, exponent = _num(node[1], env), _num(node[2], env)
        if exponent.imag == 0 and exponent.real == int(exponent.real) and abs(exponent.real) <= 10_000:
            return base ** int(exponent.real)  # integer powers of negatives stay real
        return base**exponent
    if kind == "root":
        value, index = _num(node[1], env), _num(node[2], env)
        if value.imag == 0 and index == 3 and value.real < 0:
            return complex(-((-value.real) ** (1 / 3)))  # the real cube root
        return value ** (1 / index)
    if kind in ("fact", "binom"):
        return complex(exact_value(node))
    if kind == "fn":
        return _FN[node[1]](_num(node[2], env))
    if kind == "log":
        return cmath.log(_num(node[2], env)) / cmath.log(_num(node[1], env))
    raise ValueError(kind)


def _symbols(node: Node, found: set[str]) -> set[str]:
    if node[0] == "sym":
        found.add(node[1])
    for part in node[1:]:
        if isinstance(part, tuple):
            _symbols(part, found)
    return found


# Sample values: away from 0, 1, small integers and each other.
_SAMPLES = (1.3717, 2.2361, 0.6142, 1.7913, 2.9137, 0.8317, 3.4641, 1.1513)


def _environments(names: list[str]) -> list[dict[str, complex]]:
    return [
        {name: complex(_SAMPLES[(j + 3 * k) % len(_SAMPLES)] + 0.1 * k) for j, name in enumerate(names)}
        for k in range(3)
    ]


def _close(a: complex, b: complex) -> bool:
    return abs(a - b) <= REL_TOL * max(1.0, abs(a), abs(b))


def _sampled(a: Node, b: Node) -> list[tuple[complex, complex]]:
    """Values of both trees at the fixed points where both are defined and finite."""
    names = sorted(_symbols(a, set()) | _symbols(b, set()))
    pairs = []
    for env in _environments(names):
        try:
            va, vb = _num(a, env), _num(b, env)
        except (ArithmeticError, ValueError, _NotExact, KeyError):
            continue
        if all(cmath.isfinite(v) for v in (va, vb)):
            pairs.append((va, vb))
    return pairs


def expressions_equal(a: Node, b: Node) -> bool:
    """Exact when both are rational, else agreement at the fixed sample points (docstring)."""
    try:
        return exact_value(a) == exact_value(b)
    except _NotExact:
        pass
    except (ArithmeticError, ValueError):
        return False
    pairs = _sampled(a, b)
    return len(pairs) >= 2 and all(_close(va, vb) for va, vb in pairs)


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

