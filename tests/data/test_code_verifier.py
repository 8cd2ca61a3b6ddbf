"""The ``code`` verifier (data.code_verifier) and the mbpp / humaneval / apps formats (data.code_formats)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from config.reward import CodeRewardConfig, RewardConfig
from data.code_verifier import extract_code, parse_tests
from data.rewards import get_verifier, label_problem
from data.validate import validate_dataset

FAST = CodeRewardConfig(wall_s=10.0, cpu_s=2.0, memory_mb=256, max_processes=8, max_output_bytes=100_000)
ASSERTS = json.dumps({"asserts": ["assert square(2) == 4", "assert square(3) == 9", "assert square(-1) == 1"]})
STDIO = json.dumps({"stdin_stdout": [["2 3\n", "5\n"], ["10 -4\n", "6\n"]]})
RIGHT = "Here is the function.\n```python\ndef square(x):\n    return x * x\n```\nDone."
HALF = "```python\ndef square(x):\n    return x * x if x >= 0 else x\n```"  # wrong for -1: 2 of 3 pass


def _verifier(mode: str):
    return get_verifier("code", FAST.model_copy(update={"reward": mode}))


def test_code_extraction():
    assert extract_code("```python\na = 1\n```\ntext\n```python\nb = 2\n```") == "b = 2\n"
    assert extract_code("```\nc = 3\n```") == "c = 3\n"
    assert extract_code("```py\nd = 4\n```\n```\nnot python\n```") == "d = 4\n"
    assert extract_code("def f():\n    return 1") == "def f():\n    return 1"


@pytest.mark.parametrize(
    "mode,response,reward",
    [
        ("all_pass", RIGHT, 1.0),
        ("fraction", RIGHT, 1.0),
        ("all_pass", HALF, 0.0),
        ("fraction", HALF, 2 / 3),
        ("all_pass", "def square(x):\n    return x * x", 1.0),  # no fence: the whole response
        ("fraction", "```python\ndef square(x)\n    return x * x\n```", 0.0),  # syntax error: every test errors
        ("all_pass", "I cannot solve this.", 0.0),
    ],
)
def test_asserts_both_modes(mode, response, reward):
    assert _verifier(mode)(response, ASSERTS, "stop") == pytest.approx(reward)


def test_stdin_stdout_and_check_labels():
    program = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert _verifier("all_pass")(program, STDIO, "stop") == 1.0
    wrong = "```python\na, b = map(int, input().split())\nprint(abs(a) + abs(b))\n```"
    assert _verifier("fraction")(wrong, STDIO, "stop") == 0.5
    check = json.dumps(
        {
            "check": "def check(candidate):\n    assert candidate([1, 2]) == 3\n",
            "entry_point": "total",
            "setup": "from typing import List\n",
        }
    )
    assert (
        _verifier("all_pass")("```python\ndef total(xs: List[int]) -> int:\n    return sum(xs)\n```", check, "stop")
        == 1.0
    )
    assert _verifier("all_pass")("```python\ndef total(xs):\n    return 0\n```", check, "stop") == 0.0


def test_bad_labels_are_named():
    assert label_problem("code", ASSERTS) is None
    assert "not JSON" in label_problem("code", "assert f(1) == 2")
    assert "give exactly one" in label_problem(
        "code", json.dumps({"asserts": ["assert 1"], "stdin_stdout": [["", ""]]})
    )
    assert "entry_point" in label_problem("code", json.dumps({"check": "def check(c): pass", "entry_point": "1x"}))
    assert "[input, output]" in label_problem("code", json.dumps({"stdin_stdout": [["only input"]]}))
    assert len(parse_tests(ASSERTS).tests) == 3


def test_config_takes_code():
    assert RewardConfig(verifier="code").code.reward == "all_pass"
    with pytest.raises(ValueError):
        CodeRewardConfig(reward="most")


# ----------------------------------------------------------------------------- dataset formats


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


MBPP = {
    "task_id": 2,
    "text": "Write a function to square a number.",
    "code": "def square(x):\n    return x * x",
    "test_list": ["assert square(2) == 4", "assert square(3) == 9"],
    "test_setup_code": "",
    "challenge_test_list": [],
}
HUMANEVAL = {
    "task_id": "HumanEval/0",
    "prompt": 'from typing import List\n\ndef total(xs: List[int]) -> int:\n    """Sum of xs."""\n',
    "canonical_solution": "    return sum(xs)\n",
    "test": "def check(candidate):\n    assert candidate([1, 2]) == 3\n",
    "entry_point": "total",
}
APPS = {
    "problem_id": 1,
    "question": "Print the sum of two integers.",
    "input_output": json.dumps({"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6\n"]}),
    "difficulty": "intro",
}


@pytest.mark.parametrize(
    "fmt,good,label,bad,error",
    [
        (
            "mbpp",
            MBPP,
            {"asserts": MBPP["test_list"]},
            {**MBPP, "test_list": "assert square(2) == 4"},
            "test_list: expected a non-empty list of assert strings, got string",
        ),
        (
            "humaneval",
            HUMANEVAL,
            {"check": HUMANEVAL["test"], "entry_point": "total", "setup": HUMANEVAL["prompt"]},
            {**HUMANEVAL, "entry_point": "total sum"},
            "entry_point: 'total sum' is not a function name",
        ),
        (
            "apps",
            APPS,
            {"stdin_stdout": [["2 3\n", "5\n"], ["10 -4\n", "6\n"]]},
            {**APPS, "input_output": json.dumps({"inputs": ["1\n"], "outputs": [1]})},
            "input_output.outputs[0]: expected a string, got number",
        ),
    ],
)
def test_code_formats(tmp_path, fmt, good, label, bad, error):
    path = _write(tmp_path / f"{fmt}.jsonl", [good, good, bad])
    result = validate_dataset(path, "rl", key="data.rl_train")
    assert result.format == fmt
    assert len(result.rows) == 2 and json.loads(result.rows[0]["label"]) == label
    assert [str(e) for e in result.errors] == [f"{path}:3: {error}"]  # file, line, field, message
    # the normalized row is scored by the code verifier: the reference solution passes
    solution = {
        "mbpp": MBPP["code"],
        "humaneval": HUMANEVAL["prompt"] + HUMANEVAL["canonical_solution"],
        "apps": "a, b = map(int, input().split())\nprint(a + b)",
    }[fmt]
    assert _verifier("all_pass")(f"```python\n{solution}\n```", result.rows[0]["label"], "stop") == 1.0


def test_apps_call_based_is_refused(tmp_path):
    row = {**APPS, "input_output": json.dumps({"fn_name": "solve", "inputs": [[1]], "outputs": [[2]]})}
    result = validate_dataset(_write(tmp_path / "apps.jsonl", [APPS, row]), "rl", key="data.rl_train", format="apps")
    assert len(result.rows) == 1 and "call-based problem (fn_name 'solve')" in str(result.errors[0])


def test_validate_refuses_without_network_namespace(monkeypatch):
    import data.sandbox
    from flows.run_checks import check_code_sandbox

    cfg = SimpleNamespace(
        rl=SimpleNamespace(reward=RewardConfig(verifier="code")),
        data=SimpleNamespace(rl_train=None),
        evaluate=SimpleNamespace(datasets=[]),
    )
    monkeypatch.setattr(data.sandbox, "network_isolation_problem", lambda: "no unshare binary (util-linux) on PATH")
    problems = check_code_sandbox(cfg)
    assert len(problems) == 1 and problems[0].startswith("rl.reward.verifier: the code verifier runs")
    assert "rl.reward.code.allow_network: true" in problems[0]
    cfg.rl.reward = RewardConfig(verifier="code", code=CodeRewardConfig(allow_network=True))
    assert check_code_sandbox(cfg) == []
    cfg.rl.reward = RewardConfig(verifier="math")
    assert check_code_sandbox(cfg) == []
