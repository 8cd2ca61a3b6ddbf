"""The code quickstart's splits: formats, every reference solution through the real sandbox,
near misses rejected, held-out expressions, determinism, bad counts."""

from __future__ import annotations

import json
import re

import pytest

from data.code_task import ALL_EXPRESSIONS, CodeProblem, Expression, make_code_datasets
from data.code_verifier import parse_tests
from data.rewards import get_verifier, score_all

QUESTION = re.compile(
    r"^Write a Python function (\w+)\((\w+), (\w+)\) that returns (\w+) (plus|minus|times) (\d) "
    r"(plus|minus|times) (\w+)\.$"
)
SYMBOL = {"plus": "+", "minus": "-", "times": "*"}
COUNTS = dict(num_sft=60, num_rl=50, num_eval=40)


def _rows(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _parse(user: dict) -> tuple[str, tuple[str, str], tuple[str, str, int, str, str]]:
    """(name, args, (first, op1, constant, op2, second)) of a user turn; the expression's key is
    everything but the names."""
    assert user["role"] == "user"
    m = QUESTION.match(user["content"])
    assert m, user
    name, a, b, u, o1, c, o2, v = m.groups()
    assert {u, v} == {a, b}
    return name, (a, b), (u, SYMBOL[o1], int(c), SYMBOL[o2], v)


def _expression_key(user: dict) -> tuple:
    _, args, (u, o1, c, o2, _) = _parse(user)
    return (u == args[1], o1, c, o2)


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    return make_code_datasets(tmp_path_factory.mktemp("code"), seed=3, **COUNTS)


def test_files_rows_and_the_sft_target_is_the_formula_in_python(splits):
    assert {k: p.name for k, p in splits.items()} == {
        "sft": "sft.jsonl",
        "rl_train": "rl_train.jsonl",
        "rl_eval": "rl_eval.jsonl",
    }
    sft = _rows(splits["sft"])
    assert len(sft) == 60 and len(_rows(splits["rl_train"])) == 50 and len(_rows(splits["rl_eval"])) == 40
    for row in sft:
        user, assistant = row["messages"]
        name, (a, b), (u, o1, c, o2, v) = _parse(user)
        assert assistant == {"role": "assistant", "content": f"def {name}({a}, {b}): return {u} {o1} {c} {o2} {v}"}
    assert len({json.dumps(r) for r in sft}) == 60  # distinct problems


def test_held_out_expressions_appear_in_no_training_problem(splits):
    held = {_expression_key(r["prompt"][0]) for r in _rows(splits["rl_eval"])}
    train = {_expression_key(r["messages"][0]) for r in _rows(splits["sft"])}
    train |= {_expression_key(r["prompt"][0]) for r in _rows(splits["rl_train"])}
    assert held and train and not held & train
    assert len(held) == 3  # 40 problems need ceil(40 / 16) held-out expressions


def test_every_reference_solution_passes_its_tests_in_the_sandbox_and_a_near_miss_fails(splits):
    """The real sandbox (data.sandbox via the code verifier, on 4 threads) on rl_eval and rl_train
    rows: the reference solution passes; the same function with its constant one higher fails."""
    rows = _rows(splits["rl_eval"])[:16] + _rows(splits["rl_train"])[:8]
    responses, labels = [], []
    for row in rows:
        name, (a, b), (u, o1, c, o2, v) = _parse(row["prompt"][0])
        tests = parse_tests(row["label"]).tests
        assert len(tests) == 1 and tests[0].test.count("assert ") == 3
        responses += [
            f"def {name}({a}, {b}): return {u} {o1} {c} {o2} {v}",
            f"def {name}({a}, {b}): return {u} {o1} {c + 1} {o2} {v}",
        ]
        labels += [row["label"]] * 2
    responses.append("```python\n" + responses[-2] + "\n```")  # a fenced answer too
    labels.append(labels[-1])
    rewards = score_all(get_verifier("code"), responses, labels, ["stop"] * len(labels))
    assert rewards == [1.0, 0.0] * len(rows) + [1.0], list(zip(responses, rewards))


def test_every_sft_target_passes_the_tests_of_its_problem(splits):
    """SFT answers, run in the sandbox against the asserts their problem gets as an rl row."""
    import random

    rng = random.Random(0)
    answers, labels = [], []
    for row in _rows(splits["sft"])[:24]:
        user, assistant = row["messages"]
        name, args, (u, o1, c, o2, _) = _parse(user)
        problem = CodeProblem(name, args, Expression(u == args[1], o1, c, o2))
        assert problem.question() == user["content"]
        answers.append(assistant["content"])
        labels.append(problem.label(rng))
    assert score_all(get_verifier("code"), answers, labels, ["stop"] * 24) == [1.0] * 24


def test_tests_tell_every_neighbour_apart():
    """Hand-checked: ``a * 3 + b`` has 2 + 2 + 8 + 1 neighbours, all different functions; the
    label's three asserts reject each one (pure arithmetic, no sandbox)."""
    import random

    e = Expression(False, "*", 3, "+")
    assert e.value(4, 5) == 17 and Expression(True, "+", 3, "*").value(4, 5) == 5 + 12
    assert Expression(False, "-", 2, "-").value(1, 7) == -8
    assert len(e.neighbours()) == 13
    assert Expression(True, "+", 3, "+") not in Expression(False, "+", 3, "+").neighbours()  # the same function
    problem = CodeProblem("f", ("a", "b"), e)
    test = parse_tests(problem.label(random.Random(0))).tests[0].test
    inputs = [tuple(map(int, m)) for m in re.findall(r"f\((\d+), (\d+)\)", test)]
    assert [int(x) for x in re.findall(r"== (-?\d+)", test)] == [3 * a + b for a, b in inputs]
    for n in e.neighbours():
        assert any(n.value(a, b) != 3 * a + b for a, b in inputs), n
    assert len(ALL_EXPRESSIONS) == 162


def test_same_seed_same_bytes_and_bad_counts_are_named(tmp_path, splits):
    again = make_code_datasets(tmp_path / "again", seed=3, **COUNTS)
    assert all(again[k].read_bytes() == splits[k].read_bytes() for k in splits)
    with pytest.raises(ValueError, match=r"num_rl must be a positive int, got 0"):
        make_code_datasets(tmp_path / "x", num_sft=1, num_rl=0, num_eval=1, seed=0)
    with pytest.raises(ValueError, match=r"num_eval=2600 would hold out 163 of the 162 expressions"):
        make_code_datasets(tmp_path / "x", num_sft=1, num_rl=1, num_eval=2600, seed=0)
    with pytest.raises(ValueError, match=r"num_sft=2500 exceeds the 2384 problems of its pool .*lower num_sft"):
        make_code_datasets(tmp_path / "x", num_sft=2500, num_rl=1, num_eval=200, seed=0)
