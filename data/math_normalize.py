r"""Normalisation of one math answer to a canonical string (``normalize``), by these rules in order:

1. ``$`` and ``\$``, ``\displaystyle``, ``\left``/``\right`` (``\left.`` too),
   ``\big``-style sizes and a trailing ``.`` are dropped.
2. Thousands separators: ``,\!`` and ``{,}`` between digits, and a comma followed by exactly
   three digits after a leading group that is not ``0`` (``0,111`` is not 111), are
   removed, so ``10,\!080``, ``14{,}916``, ``10,080`` and ``10080`` are equal. A comma
   followed by a space separates items (``2, 100`` is the list {2, 100}), and so does
   every plain comma of a number written directly inside brackets or next to another
   comma: ``(12,102)`` is a pair, ``(12,\!102)`` is one number in parentheses.
3. Spacing (``\! \, \; \: \quad \qquad ~``) and white space are dropped (one space is kept
   between a command and a letter, ``\cot x``).
4. ``\dfrac``/``\tfrac``/``\cfrac`` are ``\frac``; ``\dbinom``/``\tbinom`` are ``\binom``;
   TeX's one-token arguments get braces: ``\frac12`` = ``\frac 1 2`` = ``\frac{1}{2}``,
   ``\frac9{19}``, ``\sqrt2`` = ``\sqrt{2}``, ``x^2`` = ``x^{2}``, ``52_8`` = ``52_{8}``.
5. Units: degrees (``^\circ``, ``^{\circ}``, ``\circ`` after a number, ``\degree``, ``°``) and percent
   (``\%``, ``%``, and ``percent``, ``pct``, ``percentage`` after a number) are dropped
   (``50\%`` equals ``50``, not ``0.5``); a trailing
   ``\text{...}``/``\mbox{...}``/``\textrm{...}`` (or ``\mathrm{..}`` of two letters or
   more), with an optional power (``\mbox{ inches}^2``), after some other content is a
   unit and dropped; so is a trailing plain unit word from a short list (``cm``,
   ``inches``, ``degrees``, ``dollars``, ``cents``, ``units``...) after a number.
6. Remaining ``\text{}``, ``\textbf{}``, ``\mbox{}``, ``\mathrm{}``... wrappers are
   unwrapped. An answer that is one such wrapper is a *text answer* (``\text{East}``):
   compared case-insensitively with its spaces collapsed, never as math. A lone capital
   letter in parentheses is that letter: ``(C)`` = ``C`` = ``\text{(C)}``.
7. ``\cdot``, ``\times`` are ``*``; relations have one spelling (``\leq``, ``\leqslant``,
   ``<=`` are ``\le``; ``\lt`` is ``<``; ``!=``, ``\neq`` are ``\ne``); ``\text{ and }``,
   ``\text{ or }`` and, outside text answers, the plain words ``and``/``or`` between items
   are commas (``2\text{ and }3`` and ``2 and 3`` are ``2, 3``); ``;`` is a comma
   (``-12; -11``); ``+\infty`` is ``\infty``.
8. A leading name and ``=`` or ``\in`` is dropped, for the whole answer and for each item
   of a list. A name is a letter, up to four capitals (``AB``), or a Greek command, with
   primes, a subscript or an argument list (``f(x) =``, ``\theta =``, ``a_{37} =``); also
   ``|AB|``, ``\frac{NO}{BO}``, ratios (``V_1:V_2 = 11:21``) and tuples of names
   (``(p,q) = (3,2)``), as in math-verify's named-answer tests.
9. A mixed number ``1\frac{4}{5}`` (an integer followed by a proper fraction of integers)
   is ``9/5``, not ``1 * 4/5``.

:mod:`data.math_answer` reads the structure of the canonical string (tuples, sets,
equations...) and compares its items.
"""

from __future__ import annotations

import re

from data.math_expression import _GREEK, MAX_PARSE_CHARS, check_clock
from data.math_extraction import _group_end

_TEXT_CMDS = (
    "text",
    "textbf",
    "textit",
    "textrm",
    "textnormal",
    "textsf",
    "texttt",
    "mbox",
    "mathrm",
    "mathbf",
    "mathit",
    "mathsf",
    "mathtt",
    "operatorname",
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
    "pct|percentage|square|sq|cubic|people|students|ways|times|points|sides|tiles|boxes|marbles|coins|eggs|apples"
)
_TRAILING_UNIT_WORD = re.compile(
    rf"(?<=[\d}}).])\s*(?:(?:square|sq\.?|cubic)\s+)?(?:{_UNIT_WORDS})(?:\s*\^\s*(?:\{{\s*\d\s*\}}|\d))?\s*$",
    re.IGNORECASE,
)
_SIZES = re.compile(r"\\(?:big|Big|bigg|Bigg)[lrm]?(?![A-Za-z])")
_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?![A-Za-z])\s*\.?")
_SPACING = re.compile(r"(?<!\\)\\[!,;: ]|\\q?quad(?![A-Za-z])|~")
_DEGREES = re.compile(
    r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![A-Za-z])|(?<=[\d}])\s*\\circ(?![A-Za-z])|\^\s*\{\s*\\degree\s*\}|\\degree(?![A-Za-z])|°"
)
_LATEX_THOUSANDS = re.compile(r"(?<=\d)(?:,\\!\s*|\{,\})(?=\d{3}(?!\d))")
# A leading group of 0 is never thousands: "0,111" is a decimal comma or a list, not 111.
_THOUSANDS = re.compile(r"(?<![\d.])[1-9]\d{0,2}(?:,\d{3})+(?![\d])(?!,\d)")
# A name, in canonical strings: a letter, up to four capitals (a segment, AB), or a Greek
# command, with primes, a subscript and an argument list (x, AB, x_{1}, f(x), g(x,y), \theta);
# |AB|, \frac{NO}{BO}; ratios V_{1}:V_{2}; tuples of names (p,q). Named answers of
# math-verify's tests/test_numina_cases.py and tests/test_open_thoughts.py.
_NAME_ATOM = r"(?:[A-Z]{1,4}|[a-z]|\\[A-Za-z]+)'*(?:_\{[A-Za-z0-9,]+\})?(?:\([A-Za-z](?:,[A-Za-z])*\))?"
_NAME_ONE = rf"(?:{_NAME_ATOM}|\|{_NAME_ATOM}\||\\frac\{{{_NAME_ATOM}\}}\{{{_NAME_ATOM}\}})"
_NAMES = rf"(?:{_NAME_ONE}(?::{_NAME_ONE})*|\({_NAME_ATOM}(?:,{_NAME_ATOM})+\))"
_NAME = re.compile(_NAMES)
_PREFIX = re.compile(rf"^{_NAMES}(?:=|\\in(?![A-Za-z]))")
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
        check_clock()
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
        if s[i] == "\\" and (m := re.match(r"\\(?:[A-Za-z]+|.)", s[i:], re.DOTALL)):  # "\\\n" too
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
        check_clock()
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


def _greek_only(s: str) -> bool:
    """Whether every command in ``s`` other than ``\\frac`` is a Greek letter."""
    return all(c in _GREEK or c == "frac" for c in re.findall(r"\\([A-Za-z]+)", s))


def is_name(s: str) -> bool:
    r"""Whether the canonical string ``s`` is a name (``x``, ``AB``, ``f(x)``, ``V_{1}:V_{2}``,
    ``(p,q)``, ``\theta``; see ``_NAME_ATOM``), not a value."""
    return bool(_NAME.fullmatch(s)) and _greek_only(s)


def _strip_prefix(s: str) -> str:
    r"""Drop a leading name and ``=`` or ``\in`` (rule 8): ``x =``, ``f(x) =``, ``\theta =``,
    ``(p,q)=``, ``V_{1}:V_{2}=``, ``AB=``, ``x \in``. A chain ``x=a=b`` keeps its prefix here;
    :mod:`data.math_answer` reads its last side."""
    m = _PREFIX.match(s)
    if not m or m.end() == len(s) or not _greek_only(re.sub(r"\\in$", "", m.group())):
        return s
    rest = s[m.end() :]
    return s if "=" in rest else rest


def _is_text_answer(s: str) -> str | None:
    """The words of an answer that is one text wrapper (rule 6), else None."""
    m = _WHOLE_TEXT.fullmatch(s)
    return m.group(1) if m else None


_RELATIONS = (
    (re.compile(r"\\(?:leqslant|leq|le)(?![A-Za-z])|<=|≤"), r"\\le "),
    (re.compile(r"\\(?:geqslant|geq|ge)(?![A-Za-z])|>=|≥"), r"\\ge "),
    (re.compile(r"\\(?:neq|ne)(?![A-Za-z])|!=|≠"), r"\\ne "),
    (re.compile(r"\\lt(?![A-Za-z])"), "<"),
    (re.compile(r"\\gt(?![A-Za-z])"), ">"),
)


def _relations(s: str) -> str:
    r"""One spelling per relation: ``\leq``, ``\leqslant``, ``<=`` -> ``\le``; ``\lt`` -> ``<``;
    ``!=``, ``\neq`` -> ``\ne`` (the relation cases of math-verify's ``tests/test_all.py``)."""
    for pattern, canonical in _RELATIONS:
        s = pattern.sub(canonical, s)
    return s


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
    s = _relations(s)
    s = s.replace(";", ",")  # "-12; -11" and "(0; -2; 6)": a semicolon separates items
    s = re.sub(r"(?:(?<=^)|(?<=[(\[,]))\s*\+\s*(?=\\infty)", "", s)  # (1, +\infty) = (1, \infty)
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
    # "12 and 13", "(11,7) or (7,11)": plain words between items separate them (math-verify's
    # tests/test_numina_cases.py); inside a text answer they are words, kept above.
    s = re.sub(r"(?<=\S)\s+(?:and|or)\s+(?=\S)|(?<=[)\]])(?:and|or)(?=[(\[])", ",", s)
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
