"""The ``gsm8k`` and ``math`` verifiers on every real GSM8K / MATH-500 reference, and by hand."""

from __future__ import annotations

import itertools
import json
import random
import re
import time

import pytest

from data.math_answer import answers_equal, parse_answer
from data.math_extraction import last_boxed_answer
from data.math_normalize import normalize
from data.rewards import VERIFIERS, get_verifier, gsm8k, math_boxed
from data.validate import validate_dataset

# ---------------------------------------------------------------------------------------
# Fixture rows


def _gsm8k_rows(fixtures_dir) -> list[tuple[str, str]]:
    """(reference solution, label) for all 3319 GSM8K rows, labels as the rl adapter makes them."""
    pairs = []
    for split in ("test.jsonl", "train_first2000.jsonl"):
        path = fixtures_dir / "gsm8k" / split
        raw = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        rows = validate_dataset(path, "rl").rows
        pairs += [(r["answer"], row["label"]) for r, row in zip(raw, rows)]
    return pairs


def _math500_rows(fixtures_dir) -> list[dict]:
    path = fixtures_dir / "math500" / "test.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _bump_digit(text: str, index: int) -> str:
    return text[:index] + str((int(text[index]) + 1) % 10) + text[index + 1 :]


# A unit after the value (``\mbox{ inches}^2``): its digits are not the answer's.
_UNIT_SPAN = re.compile(r"\\(?:text|mbox)\{[^{}]*\}(?:\^\{?\d\}?)?")


def _perturb_math_answer(answer: str) -> str:
    """A different answer: the last digit of the value bumped; else the text's last letter
    shifted (``\\text{east}`` -> ``\\text{easu}``, ``\\text{(C)}`` -> ``\\text{(D)}``);
    else ``+1`` appended (``\\pi`` -> ``\\pi+1``)."""
    masked = _UNIT_SPAN.sub(lambda m: "#" * len(m.group()), answer)
    digits = [i for i, c in enumerate(masked) if c.isdigit()]
    if digits:
        return _bump_digit(answer, digits[-1])
    if re.fullmatch(r"\\text\{.*\}", answer):
        letters = [i for i, c in enumerate(answer) if c.isalpha() and i >= len("\\text{")]
        i = letters[-1]
        shifted = chr(ord("a") + (ord(answer[i].lower()) - ord("a") + 1) % 26)
        return answer[:i] + (shifted.upper() if answer[i].isupper() else shifted) + answer[i + 1 :]
    return answer + "+1"


def _replace_last_box(solution: str, new_content: str) -> str:
    content = last_boxed_answer(solution)
    start = solution.rfind("\\boxed{") + len("\\boxed{")
    assert solution[start : start + len(content)] == content
    return solution[:start] + new_content + solution[start + len(content) :]


# ---------------------------------------------------------------------------------------
# GSM8K


def test_gsm8k_every_reference_scores_one_and_a_changed_last_digit_zero(fixtures_dir):
    pairs = _gsm8k_rows(fixtures_dir)
    assert len(pairs) == 3319
    assert [gsm8k(solution, label) for solution, label in pairs] == [1.0] * 3319
    perturbed = []
    for solution, _ in pairs:
        head, tail = solution.rsplit("####", 1)
        last_digit = max(i for i, c in enumerate(tail) if c.isdigit())
        perturbed.append(head + "####" + _bump_digit(tail, last_digit))
    assert [gsm8k(p, label) for p, (_, label) in zip(perturbed, pairs)] == [0.0] * 3319


def test_gsm8k_references_rewritten_with_a_box(fixtures_dir):
    # Chat models often end "... so the answer is \boxed{N}." instead of "#### N"; the box
    # wins over the last number of the text, and the `math` verifier agrees on these rows.
    pairs = _gsm8k_rows(fixtures_dir)
    boxed = []
    for solution, _ in pairs:
        head, tail = solution.rsplit("####", 1)
        boxed.append(f"{head}So the answer is $\\boxed{{{tail.strip()}}}$ (checked twice, 2 ways).")
    assert [gsm8k(b, label) for b, (_, label) in zip(boxed, pairs)] == [1.0] * 3319
    assert [math_boxed(b, label) for b, (_, label) in zip(boxed, pairs)] == [1.0] * 3319


@pytest.mark.parametrize(
    "response, label, score",
    [
        ("so \\boxed{18} dollars for 2 days", "18", 1.0),  # the box beats the last number
        ("\\boxed{\\$1,250} in 3 weeks", "1250", 1.0),
        ("#### 7\nor \\boxed{8}", "7", 1.0),  # '####' beats the box
        ("10-3 = 7", "7", 1.0),
        ("It changed by 10-3", "3", 1.0),  # '-' after a digit is subtraction
        ("It changed by 10-3", "-3", 0.0),
        ("The low was (-3) today", "-3", 1.0),
        ("It fell to -3.", "-3", 1.0),
        ("A total of 1,234,567 people", "1234567", 1.0),
        ("Pick 1,2 or 3,4", "4", 1.0),  # not thousands groups: 4 is last
        ("Pick 1,2 or 3,4", "34", 0.0),
        ("half is .5", "0.5", 1.0),
        ("18.00", "18", 1.0),
        ("18.01", "18", 0.0),
        ("#### 1,000", "1000", 1.0),
    ],
)
def test_gsm8k_number_rules(response, label, score):
    assert gsm8k(response, label) == score


# ---------------------------------------------------------------------------------------
# MATH-500


def test_math_every_reference_scores_one(fixtures_dir):
    rows = _math500_rows(fixtures_dir)
    assert len(rows) == 500
    start = time.perf_counter()
    assert [math_boxed(r["solution"], r["answer"]) for r in rows] == [1.0] * 500
    # The labels the rl adapter makes (stripped `answer`) give the same.
    labels = [row["label"] for row in validate_dataset(fixtures_dir / "math500" / "test.jsonl", "rl").rows]
    assert [math_boxed(r["solution"], label) for r, label in zip(rows, labels)] == [1.0] * 500
    assert time.perf_counter() - start < 5


def test_math_every_reference_with_a_changed_answer_scores_zero(fixtures_dir):
    rows = _math500_rows(fixtures_dir)
    changed = [_replace_last_box(r["solution"], _perturb_math_answer(r["answer"])) for r in rows]
    assert all(c != r["solution"] for c, r in zip(changed, rows))
    wrong = [(r["unique_id"], r["answer"]) for c, r in zip(changed, rows) if math_boxed(c, r["answer"]) != 0.0]
    assert wrong == []


def test_math_perturbations_cover_every_kind_of_answer():
    assert _perturb_math_answer("864 \\mbox{ inches}^2") == "865 \\mbox{ inches}^2"
    assert _perturb_math_answer("\\text{(C)}") == "\\text{(D)}"
    assert _perturb_math_answer("\\text{Evelyn}") == "\\text{Evelyo}"
    assert _perturb_math_answer("\\pi") == "\\pi+1"
    assert _perturb_math_answer("(2,\\infty)") == "(3,\\infty)"


# Distinct MATH-500 answer strings that are the same answer under the documented rules;
# every other pair of the 301 distinct answers must compare unequal.
_EQUIVALENT_FIXTURE_ANSWERS = {
    ("-2,1", "1,-2"),  # solution lists in any order
    ("10,\\!080", "10080"),  # thousands separator
    ("120", "120^\\circ"),  # degrees dropped
    ("15", "15\\mbox{ cm}^2"),  # unit dropped
    ("2 \\sqrt{5}", "2\\sqrt{5}"),  # spaces
    ("30", "30^\\circ"),
    ("36", "36^\\circ"),
    ("36", "\\$36"),  # dollar sign dropped
    ("36^\\circ", "\\$36"),
    ("5", "x=5"),  # leading "x ="
    ("90", "90^\\circ"),
    ("\\frac14", "\\frac{1}{4}"),  # TeX one-token arguments
}


def test_math_distinct_fixture_answers_are_unequal_except_known_equivalents(fixtures_dir):
    answers = sorted({r["answer"] for r in _math500_rows(fixtures_dir)})
    assert len(answers) == 301
    equal = {(a, b) for a, b in itertools.combinations(answers, 2) if answers_equal(a, b)}
    assert equal == _EQUIVALENT_FIXTURE_ANSWERS


@pytest.mark.parametrize(
    "got, label",
    [
        # fractions and decimals (exact rationals)
        ("1/2", "0.5"),
        ("0.5", "\\frac{1}{2}"),
        ("\\dfrac12", "\\frac{1}{2}"),
        ("\\tfrac{1}{2}", "1/2"),
        ("\\frac 1 2", ".50"),
        ("2^{-1}", "0.5"),
        ("-\\frac12", "-0.5"),
        ("\\frac{-1}{2}", "-\\frac{1}{2}"),
        ("\\frac9{19}", "\\frac{9}{19}"),
        ("1\\frac{4}{5}", "\\frac{9}{5}"),  # mixed number
        ("137 \\frac{1}{2}", "137.5"),
        ("1.2\\times10^{3}", "1200"),
        ("1 \\cdot 10^{3}", "1000"),
        # thousands, trailing .0, units, wrappers
        ("1,000", "1000"),
        ("1,\\!000", "1000"),
        ("11,\\! 111,\\! 111,\\! 100", "11111111100"),
        ("5.0", "5"),
        ("5.", "5"),
        ("\\$5", "5"),
        ("\\$18.90", "18.9"),
        ("50\\%", "50"),
        ("90^\\circ", "90"),
        ("90^{\\circ}", "90"),
        ("90 degrees", "90"),
        ("12\\text{ cm}", "12"),
        ("12 cm", "12"),
        ("864 \\mbox{ inches}^2", "864"),
        ("\\frac{270}7\\text{ degrees}", "\\frac{270}{7}"),
        ("\\text{east}", "\\text{East}"),
        ("East", "\\text{east}"),
        ("\\textbf{(C)}", "\\text{(C)}"),
        ("(C)", "C"),
        # brackets, spaces, leading "x ="
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("\\left[ 1 , 2 \\right)", "[1,2)"),
        ("( 3 ,  \\frac{\\pi}{2} )", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("x = 3", "3"),
        ("x=3", "x = 3"),
        ("\\theta = 30^\\circ", "30"),
        ("f(x) = x^2", "x^2"),
        ("x \\in [-2,7]", "[-2, 7]"),
        ("y = 2x + 3", "2x+3"),
        # negatives
        ("-3", "-3.0"),
        ("- 3", "-3"),
        ("-\\sqrt{3}", "-\\sqrt3"),
        # sqrt and symbolic forms
        ("\\sqrt2", "\\sqrt{2}"),
        ("11\\sqrt2", "11 \\sqrt{2}"),
        ("\\frac{\\sqrt3}{3}", "\\frac{1}{\\sqrt{3}}"),
        ("\\sqrt{3}/3", "\\frac{\\sqrt{3}}{3}"),
        ("3\\sqrt{13}", "\\sqrt{117}"),
        ("\\sqrt{4}", "2"),
        ("\\sqrt[3]{-8}", "-2"),
        ("\\pi/2", "\\frac{\\pi}{2}"),
        ("2k+2", "2(k+1)"),
        ("x^2-1", "(x-1)(x+1)"),
        ("6-5i", "-5i+6"),
        ("(1+i)^{2}", "2i"),
        ("\\cot x", "\\frac{\\cos x}{\\sin x}"),
        ("\\sin^{2}x+\\cos^{2}x", "1"),
        ("\\log_{2}8", "3"),
        ("\\binom{5}{2}", "10"),
        ("5!", "120"),
        # tuples, sets, lists, intervals, unions, matrices, equations
        ("(1, 2)", "(1,2)"),
        ("(0.5, -1)", "\\left(\\frac12, -1\\right)"),
        ("3, 5, 7", "7,3,5"),
        ("\\{3,5,7\\}", "\\left\\{ 7, 5, 3 \\right\\}"),
        ("x=1, x=-2", "1,-2"),
        ("2\\text{ and }3", "2, 3"),
        ("(-\\infty, 0]", "(-\\infty,0]"),
        ("(9,36) \\cup (0,9)", "(0,9) \\cup (9,36)"),
        ("\\begin{bmatrix} 1/5 \\\\ -3.6 \\end{bmatrix}", "\\begin{pmatrix} 1/5 \\\\ -18/5 \\end{pmatrix}"),
        ("10x - 14y + 22z + 8 = 0", "5x - 7y + 11z + 4 = 0"),
    ],
)
def test_math_equivalent_forms(got, label):
    assert math_boxed(f"Hence the answer is $\\boxed{{{got}}}$.", label) == 1.0
    assert answers_equal(label, got)  # symmetric


@pytest.mark.parametrize(
    "got, label",
    [
        ("1/2", "2"),
        ("\\frac{1}{2}", "\\frac{2}{1}"),
        ("0.5", "0.05"),
        ("1/3", "0.333"),  # rationals compare exactly
        ("3.1416", "\\pi"),  # not to ten digits
        ("(1,2)", "(2,1)"),  # tuples in order
        ("(1,2)", "[1,2]"),  # interval ends differ
        ("(3,4]", "(3,4)"),
        ("(1,2)", "1,2"),  # a point is not a solution list
        ("(1,2,3)", "(1,2)"),
        ("(12,102)", "(12102)"),  # plain commas inside brackets separate items
        ("2, 100", "2100"),  # comma + space separates items
        ("-3", "3"),
        ("-\\frac{1}{2}", "\\frac{1}{2}"),
        ("50\\%", "0.5"),  # percent is dropped, not divided
        ("52", "52_8"),  # base subscripts must match
        ("3\\sqrt{13}", "3\\sqrt{14}"),
        ("x^2", "x^3"),
        ("p-q", "q-p"),
        ("1\\frac{4}{5}", "\\frac{4}{5}"),
        ("\\text{east}", "\\text{eats}"),  # words are not products of letters
        ("east", "eats"),
        ("1\\pm\\sqrt{19}", "1+\\sqrt{19}"),
        ("\\infty", "-\\infty"),
        ("10^{100}", "10^{100}+1"),
        ("12345678901234567890", "12345678901234567891"),
        ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} 2 \\\\ 1 \\end{pmatrix}"),
        ("x + y = 2", "x - y = 2"),
        ("B", "\\text{(C)}"),
    ],
)
def test_math_unequal_forms(got, label):
    assert math_boxed(f"\\boxed{{{got}}}", label) == 0.0
    assert math_boxed(f"\\boxed{{{label}}}", got) == 0.0


@pytest.mark.parametrize(
    "response, label, score",
    [
        ("The answer is 5.", "5", 0.0),  # no box, no answer
        ("\\boxed{4} ... wait, \\boxed{5}", "5", 1.0),  # the last box counts
        ("\\boxed{5} then \\boxed{6", "5", 0.0),  # unclosed last box: truncated
        ("\\fbox{5}", "5", 1.0),
        ("$\\boxed 5$.", "5", 1.0),
        ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0),  # escaped braces inside a box
        ("\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", 1.0),  # a boxed label is unboxed
        ("\\boxedx{5}", "5", 0.0),  # another command
    ],
)
def test_math_extraction(response, label, score):
    assert math_boxed(response, label) == score


def test_math_empty_label_is_a_data_error():
    with pytest.raises(ValueError, match="math label ' ' is empty"):
        math_boxed("\\boxed{1}", " ")


@pytest.mark.parametrize(
    "answer, canonical",
    [
        ("\\dfrac12", "\\frac{1}{2}"),
        ("\\frac 59", "\\frac{5}{9}"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
        ("x^2 + \\sqrt3", "x^{2}+\\sqrt{3}"),
        ("\\$32,\\!348", "32348"),
        ("52_8", "52_{8}"),
        ("\\cot x", "\\cot x"),
        ("1\\frac{4}{5}", "\\frac{9}{5}"),
        ("\\text{ Navin  Smith }", "Navin Smith"),
    ],
)
def test_normalize(answer, canonical):
    assert normalize(answer) == canonical


def test_backslash_before_a_line_break_is_scored_not_raised():
    # A backslash followed by a line break inside the box used to raise AttributeError in
    # normalize (the command pattern's "." does not match a newline): math_boxed raised on
    # such a response instead of scoring it. The pair is read as one command now.
    assert normalize("a\\\nb") == "a\\b"
    assert math_boxed("The answer is \\boxed{a\\\nb}", "ab") == 0.0
    assert math_boxed("\\boxed{a\\\nb}", "a\\b") == 1.0


def test_math_is_registered():
    assert VERIFIERS["math"] is math_boxed
    assert get_verifier("math")("\\boxed{0.5}", "\\frac12", "stop") == 1.0


def test_math_never_raises_and_stays_fast_on_garbage():
    pieces = list("0123456789+-*/^_{}()[],.=xyi!|&$% ") + [
        "\\frac",
        "\\sqrt",
        "\\pi",
        "\\left(",
        "\\right)",
        "\\text{ cm}",
        "\\{",
        "\\}",
        "\\\\",
        "\\cup",
        "\\infty",
        "\\dfrac",
        "^\\circ",
        "\\!",
        "\\sin",
        "\\log_",
        "\\binom",
        "\\begin{pmatrix}",
        "\\end{pmatrix}",
        "\\boxed{",
        "\\pm",
    ]
    label_pieces = [p for p in pieces if p != "\\boxed{"]  # a label with an empty box is a data error
    rng = random.Random(0)
    start = time.perf_counter()
    for _ in range(2000):
        a = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        b = "1" + "".join(rng.choice(label_pieces) for _ in range(rng.randint(0, 40)))
        assert isinstance(normalize(a), str) and isinstance(answers_equal(a, b), bool)
        assert math_boxed(f"\\boxed{{{a}}}", b) in (0.0, 1.0)
    for nasty in (
        "(" * 700 + "1" + ")" * 700,
        "(1," * 500 + "2" + ")" * 500,
        "2^{" * 100 + "2" + "}" * 100,
        "9!!!!",
        "x^{99999}",
        "2^{2^{2^{100}}}",
        "\\sqrt{" * 200 + "2" + "}" * 200,
        "1" * 5000,
    ):
        assert answers_equal(nasty, nasty + "1") is False
    assert time.perf_counter() - start < 10


def test_parse_answer_kinds():
    assert parse_answer("(1,2]").kind == "tuple"
    assert parse_answer("\\{1,2\\}").kind == "set"
    assert parse_answer("1, 2").kind == "set"
    assert parse_answer("(0,1) \\cup (2,3)").kind == "union"
    assert parse_answer("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}").kind == "matrix"
    assert parse_answer("x + y = 1").kind == "equation"
    assert parse_answer("\\text{Evelyn}").kind == "text"
    assert parse_answer("(a+5)(b+2)").kind == "atom"
