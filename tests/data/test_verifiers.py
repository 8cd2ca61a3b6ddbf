"""data.rewards verifiers on hand cases and on the real GSM8K and MATH-500 references."""

from __future__ import annotations

import json
import re

import pytest

from data.rewards import VERIFIERS, exact_match, final_answer, get_verifier, gsm8k, last_boxed
from data.validate import validate_dataset


def _gsm8k_pairs(fixtures_dir):
    pairs = []
    for split in ("test.jsonl", "train_first2000.jsonl"):
        path = fixtures_dir / "gsm8k" / split
        raw = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        rows = validate_dataset(path, "rl").rows
        pairs += [(r["answer"], row["label"]) for r, row in zip(raw, rows)]
    return pairs


def _perturb_final(answer: str) -> str:
    """Replace the number after '####' by that number plus one."""
    head, tail = answer.rsplit("####", 1)
    value = int(tail.strip().replace(",", ""))
    return f"{head}#### {value + 1}"


def test_every_gsm8k_reference_scores_one_and_a_perturbed_one_zero(fixtures_dir):
    pairs = _gsm8k_pairs(fixtures_dir)
    assert len(pairs) == 3319
    assert [gsm8k(answer, label) for answer, label in pairs] == [1.0] * 3319
    assert [gsm8k(_perturb_final(answer), label) for answer, label in pairs] == [0.0] * 3319


def test_gsm8k_last_number_fallback_on_real_solutions(fixtures_dir):
    # Without the "#### N" line the last number in the worked solution is used: for 3232 of
    # the 3319 references that is the final answer; the rest end on another number
    # (a unit conversion, a check, a calculator annotation...).
    pairs = _gsm8k_pairs(fixtures_dir)
    scores = [gsm8k(answer.rsplit("####", 1)[0], label) for answer, label in pairs]
    assert sum(scores) == 3232


@pytest.mark.parametrize(
    "response, label, score",
    [
        ("She makes 9 * 2 = $18 every day.", "18", 1.0),
        ("The answer is $1,000.00.", "1000", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("It is 7, not 8.\n#### 8", "8", 1.0),  # '####' wins over the last number
        ("#### 8\nThen 5 more.", "8", 1.0),  # first number after the last '####'
        ("The temperature fell to -3 degrees.", "-3", 1.0),
        ("0.5 of 10 is 5", "5.0", 1.0),
        ("I got 17.", "18", 0.0),
        ("I don't know.", "18", 0.0),
        ("#### unknown", "18", 0.0),
        ("", "18", 0.0),
    ],
)
def test_gsm8k_hand_cases(response, label, score):
    assert gsm8k(response, label) == score


def test_gsm8k_bad_label_is_a_data_error():
    with pytest.raises(ValueError, match="gsm8k label 'eighteen' is not a number"):
        gsm8k("18", "eighteen")


@pytest.mark.parametrize(
    "response, answer",
    [
        ("So the result is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("\\boxed{1} first, then \\boxed{ 2 }", "2"),
        ("work\n#### 42 ", "42"),
        ("line one\nThe answer is B\n\n  ", "The answer is B"),
        ("\\boxed{unclosed", "\\boxed{unclosed"),
        ("", ""),
    ],
)
def test_final_answer(response, answer):
    assert final_answer(response) == answer


def test_exact_match_hand_cases():
    assert exact_match("  \\boxed{ x^2 } ", "x^2") == 1.0
    assert exact_match("so\n#### 1,000", "1000") == 0.0  # exact: no number normalisation
    assert exact_match("Paris", " Paris\n") == 1.0
    assert exact_match("Paris.", "Paris") == 0.0
    assert last_boxed("no box") is None


def test_math500_solutions_match_their_answers(fixtures_dir):
    path = fixtures_dir / "math500" / "test.jsonl"
    raw = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    rows = validate_dataset(path, "rl").rows
    assert [exact_match(r["solution"], row["label"]) for r, row in zip(raw, rows)] == [1.0] * 500
    # A wrong final box scores 0 for every problem.
    wrong = [re.sub(r"\\boxed\{", r"\\boxed{9", r["solution"]) for r in raw]
    assert sum(exact_match(w, row["label"]) for w, row in zip(wrong, rows)) == 0


def test_exact_match_on_gsm8k_differs_only_by_commas(fixtures_dir):
    # exact_match compares text: the 38 references written with thousands commas ("#### 2,125")
    # do not equal their comma-free labels; every other one does.
    pairs = _gsm8k_pairs(fixtures_dir)
    misses = [(a, lab) for a, lab in pairs if exact_match(a, lab) == 0.0]
    assert len(misses) == 38
    assert all("," in a.rsplit("####", 1)[1] for a, _ in misses)


def test_registry():
    assert {"exact_match", "gsm8k", "math"} <= set(VERIFIERS)
    assert VERIFIERS["gsm8k"] is gsm8k
    assert get_verifier("gsm8k")("#### 18", "18", "stop") == 1.0
    with pytest.raises(ValueError, match="unknown verifier 'f1'; expected one of exact_match, gsm8k"):
        get_verifier("f1")
