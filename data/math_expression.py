r"""A small LaTeX arithmetic parser and when two parsed expressions are equal (nothing is ``eval``-ed).

These are the items (the atoms of tuples, sets and equations) of :mod:`data.math_answer`,
compared after their normalised strings (:mod:`data.math_normalize`) differ:

1. Each is parsed by a small LaTeX arithmetic parser (numbers, letters,
   ``\pi``, ``i``, ``+ - * / ^``, juxtaposition, ``\frac``, ``\sqrt``, ``\sqrt[n]``,
   ``\binom``, ``!``, ``\sin``... ``\ln``, ``\log``, ``\exp``); nothing is ``eval``-ed.
   ``i`` is the imaginary unit, ``e`` a plain variable. An item it cannot parse (``\pm``,
   ``|x|``, ``\infty``, base subscripts ``52_8``, three or more letters in a row, which
   are a word rather than a product) is only string-compared.
2. When both sides are rational numbers (integers, decimals, fractions, powers with
   integer exponents) they are compared exactly with ``fractions.Fraction``: ``1/2`` =
   ``0.5`` = ``\frac{1}{2}`` = ``\dfrac12`` = ``2^{-1}`` = ``.50``; ``5`` = ``5.0``;
   ``-\frac{1}{2}`` = ``\frac{-1}{2}`` = ``-0.5``; ``1/3`` != ``0.333``, ``0.5`` != ``0.05``.
3. Otherwise (square roots, ``\pi``, variables, functions) both are evaluated at three
   fixed points of their variables in complex floating
   point, and are equal when they agree to a relative ``1e-10`` at every point where both
   are defined (at least two): ``\frac{\sqrt{3}}{3}`` = ``\frac{1}{\sqrt3}``,
   ``2k+2`` = ``2(k+1)``, ``x^2-1`` = ``(x-1)(x+1)``; ``3\sqrt{13}`` != ``3\sqrt{14}``.
   Consequently an expanded form equals a factored one, and a decimal equals an
   irrational number only when it is right to about ten significant digits.

Limits keep it fast on any input: items longer than ``MAX_PARSE_CHARS`` are only
string-compared (whole answers longer than four times that are not normalised at all),
expression trees are capped at ``MAX_NODES`` nodes, exact powers at ``MAX_EXACT_BITS``
bits and factorials/binomials at ``MAX_FACTORIAL``, and one grading at ``TIME_LIMIT_S``
CPU seconds (``start_clock``; past it the answers count as unequal). Parsed answers are cached (an RL
step grades many samples against one label).
"""

from __future__ import annotations

import cmath
import functools
import math
import re
import threading
import time
from fractions import Fraction

MAX_PARSE_CHARS = 400
MAX_NODES = 300
MAX_EXACT_BITS = 20_000
MAX_FACTORIAL = 1000
REL_TOL = 1e-10
TIME_LIMIT_S = 0.05


class TimeUp(Exception):
    """A comparison ran past its deadline (``start_clock``); the caller treats it as unequal."""


_clock = threading.local()  # each thread (reward worker) has its own deadline


def start_clock(limit_s: float = TIME_LIMIT_S) -> bool:
    """Start the time budget of one grading: normalising, parsing and evaluation raise
    ``TimeUp`` after ``limit_s`` seconds of this thread's CPU time (not wall time: a busy
    machine that pauses the thread must not turn a right answer wrong). The size caps keep
    every known input far below it; the clock bounds the inputs nobody thought of. A clock
    already running is kept (one budget for all comparisons of one response); returns whether
    this call started it, in which case the caller calls ``stop_clock``."""
    if getattr(_clock, "deadline", None) is not None:
        return False
    _clock.deadline = time.thread_time() + limit_s
    return True


def check_clock() -> None:
    """Raise ``TimeUp`` when the current comparison's budget is spent (no clock: no limit)."""
    deadline = getattr(_clock, "deadline", None)
    if deadline is not None and time.thread_time() > deadline:
        raise TimeUp


def stop_clock() -> None:
    """End the budget ``start_clock`` started."""
    _clock.deadline = None


# A small LaTeX arithmetic parser (no eval): expression trees of tuples
#   ("num", Fraction) ("sym", name) ("pi",) ("I",) ("add", a, b) ("sub", a, b) ("mul", a, b)
#   ("div", a, b) ("neg", a) ("pow", a, b) ("root", a, n) ("fact", a) ("binom", a, b)
#   ("fn", name, a) ("log", base, a)

Node = tuple


class _ParseError(Exception):
    pass


class _NotExact(Exception):
    pass


_FUNCS = {
    "sin",
    "cos",
    "tan",
    "cot",
    "sec",
    "csc",
    "arcsin",
    "arccos",
    "arctan",
    "sinh",
    "cosh",
    "tanh",
    "ln",
    "log",
    "exp",
}
_GREEK = {
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "varepsilon",
    "zeta",
    "eta",
    "theta",
    "vartheta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "rho",
    "sigma",
    "tau",
    "upsilon",
    "phi",
    "varphi",
    "chi",
    "psi",
    "omega",
    "Gamma",
    "Delta",
    "Theta",
    "Lambda",
    "Xi",
    "Sigma",
    "Phi",
    "Psi",
    "Omega",
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
        if self.nodes % 16 == 0:
            check_clock()
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
            if stop_at_function and (self.peek() or "")[1:] in _FUNCS:
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
    "sin": cmath.sin,
    "cos": cmath.cos,
    "tan": cmath.tan,
    "cot": lambda z: 1 / cmath.tan(z),
    "sec": lambda z: 1 / cmath.cos(z),
    "csc": lambda z: 1 / cmath.sin(z),
    "arcsin": cmath.asin,
    "arccos": cmath.acos,
    "arctan": cmath.atan,
    "sinh": cmath.sinh,
    "cosh": cmath.cosh,
    "tanh": cmath.tanh,
    "ln": cmath.log,
    "log": cmath.log,
    "exp": cmath.exp,
}


def _real_zero(z: complex) -> complex:
    """``z`` with a zero imaginary part made +0.0: ``-a`` of a real ``a`` is ``(-a-0j)``, whose
    square root Python puts on the other side of the branch cut (``-i sqrt(a)``); the principal
    root of a negative real is ``+i sqrt(a)``."""
    return complex(z.real, 0.0) if z.imag == 0 else z


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
        base, exponent = _real_zero(_num(node[1], env)), _num(node[2], env)
        if exponent.imag == 0 and exponent.real == int(exponent.real) and abs(exponent.real) <= 10_000:
            return base ** int(exponent.real)  # integer powers of negatives stay real
        return base**exponent
    if kind == "root":
        value, index = _real_zero(_num(node[1], env)), _num(node[2], env)
        if value.imag == 0 and index == 3 and value.real < 0:
            return complex(-((-value.real) ** (1 / 3)))  # the real cube root
        return value ** (1 / index)
    if kind in ("fact", "binom"):
        return complex(exact_value(node))
    if kind == "fn":
        return _FN[node[1]](_real_zero(_num(node[2], env)))
    if kind == "log":
        return cmath.log(_real_zero(_num(node[2], env))) / cmath.log(_real_zero(_num(node[1], env)))
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
        check_clock()
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


_LONG_DECIMAL = re.compile(r"-?(\d*)\.(\d+)")
MIN_ROUNDED_DIGITS = 10


def decimal_rounds_to(text: str, node: Node) -> bool:
    """Whether ``text``, a decimal of at least ``MIN_ROUNDED_DIGITS`` significant digits, is the
    rational value of ``node`` rounded or cut at its last digit (``0.0833333333333333`` =
    ``\\frac{1}{12}``, as math-verify's ``test_complex_math_expressions`` has it). Shorter
    decimals stay exact (``0.333`` != ``1/3``); irrational values are the sampled comparison's.
    """
    m = _LONG_DECIMAL.fullmatch(text)
    if not m or len((m.group(1) + m.group(2)).lstrip("0")) < MIN_ROUNDED_DIGITS:
        return False
    try:
        value = exact_value(node)
    except (_NotExact, ArithmeticError, ValueError):
        return False
    return abs(Fraction(text) - value) <= Fraction(1, 10 ** len(m.group(2)))
