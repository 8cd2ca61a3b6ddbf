"""The ``code`` verifier: run the response's Python against the label's tests in the sandbox.

The label is a JSON object (a string in the dataset row) of one of three kinds:

- ``{"asserts": ["assert f(2) == 4", ...]}`` (MBPP): each assert is one test, run after the
  program in its globals;
- ``{"check": "def check(candidate):\\n    assert candidate(2) == 4", "entry_point": "f"}``
  (HumanEval): one test, ``check(f)`` after the program;
- ``{"stdin_stdout": [["2 3\\n", "5\\n"], ...]}`` (APPS, TACO, LiveCodeBench): each pair is one
  test, the program run on the input, its stdout compared with the output line by line after
  stripping trailing whitespace (:func:`data.sandbox.run_test`).

Any kind may add ``"setup"``: code run before the program in the same globals (MBPP's
``test_setup_code``, the imports of a HumanEval prompt).

The program is the content of the response's last fenced block tagged ``python`` / ``py`` /
``python3`` (:func:`extract_code`), else of its last untagged fenced block, else the whole
response. Reward (``rl.reward.code.reward``): ``all_pass`` 1.0 when every test passes, else 0.0
(the tests run in order and stop at the first that does not pass); ``fraction``: passed / tests
(every test runs). Evaluation counts a response correct when its reward is 1.0 (every test
passed), in either mode.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from data.sandbox import CaseResult, SandboxLimits, run_test

REWARD_MODES = ("all_pass", "fraction")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.S)
_PYTHON_TAGS = {"python", "py", "python3"}


@dataclass(frozen=True)
class CodeTest:
    """One test: ``test`` source (assert mode) or ``stdin`` + ``expected_stdout``."""

    test: str | None = None
    stdin: str = ""
    expected_stdout: str | None = None


@dataclass(frozen=True)
class CodeTests:
    """A parsed ``code`` label: ``setup`` code run before the program, and the tests."""

    setup: str
    tests: tuple[CodeTest, ...]


def extract_code(response: str) -> str:
    """The program in ``response``: its last ```` ```python ```` (``py``, ``python3``) block,
    else its last untagged fenced block, else the whole response."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(response)]
    for wanted in (lambda tag: tag in _PYTHON_TAGS, lambda tag: tag == ""):
        chosen = [body for tag, body in blocks if wanted(tag)]
        if chosen:
            return chosen[-1]
    return response


def _strings(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError(f"code label: {where} must be a non-empty list of non-empty strings")
    return value


def parse_tests(label: str) -> CodeTests:
    """The setup and tests of a ``code`` label (the module docstring gives the three kinds).

    Raises:
        ValueError: not JSON, not an object, none or several of the kinds, or a kind's
            fields of the wrong type (the message names the field).
    """
    try:
        spec = json.loads(label)
    except ValueError as exc:
        raise ValueError(
            f"code label is not JSON ({exc}); expected an object with asserts, check + entry_point or stdin_stdout"
        ) from None
    if not isinstance(spec, dict):
        raise ValueError(f"code label is a JSON {type(spec).__name__}, expected an object")
    kinds = [k for k in ("asserts", "check", "stdin_stdout") if k in spec]
    if len(kinds) != 1:
        raise ValueError(f"code label has {kinds or 'none'} of asserts, check, stdin_stdout; give exactly one")
    setup = spec.get("setup") or ""
    if not isinstance(setup, str):
        raise ValueError("code label: setup must be a string")
    if kinds == ["asserts"]:
        return CodeTests(setup, tuple(CodeTest(test=a) for a in _strings(spec["asserts"], "asserts")))
    if kinds == ["check"]:
        check, entry = spec["check"], spec.get("entry_point")
        if not isinstance(check, str) or "def check" not in check:
            raise ValueError("code label: check must be a string defining check(candidate)")
        if not isinstance(entry, str) or not entry.isidentifier():
            raise ValueError(f"code label: entry_point must be a function name, got {entry!r}")
        return CodeTests(setup, (CodeTest(test=f"{check}\ncheck({entry})\n"),))
    pairs = spec["stdin_stdout"]
    if (
        not isinstance(pairs, list)
        or not pairs
        or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in pairs)
    ):
        raise ValueError("code label: stdin_stdout must be a non-empty list of [input, output] string pairs")
    return CodeTests(setup, tuple(CodeTest(stdin=i, expected_stdout=o) for i, o in pairs))


def run_code_tests(
    program: str, tests: Sequence[CodeTest], limits: SandboxLimits = SandboxLimits(), stop_at_failure: bool = False
) -> list[CaseResult]:
    """Each test of ``tests`` on ``program``, one sandbox each, in order (wall time at most
    ``len(tests) * limits.wall_s`` plus start-up); with ``stop_at_failure`` the results end at
    the first test that did not pass."""
    results = []
    for t in tests:
        results.append(run_test(program, test=t.test, stdin=t.stdin, expected_stdout=t.expected_stdout, limits=limits))
        if stop_at_failure and not results[-1].passed:
            break
    return results


def code_reward(
    response: str, label: str, *, reward: str = "all_pass", limits: SandboxLimits = SandboxLimits()
) -> float:
    """The ``code`` verifier: the reward of ``response`` against the tests of ``label``.

    A blank program scores 0.0 without running anything (so ``data.rewards.label_problem``
    checks a label without starting a sandbox).

    Raises:
        ValueError: a bad label (:func:`parse_tests`), an unknown ``reward`` mode.
    """
    if reward not in REWARD_MODES:
        raise ValueError(f"code reward mode {reward!r}; expected one of {', '.join(REWARD_MODES)}")
    parsed = parse_tests(label)
    program = extract_code(response)
    if not program.strip():
        return 0.0
    if parsed.setup:
        program = parsed.setup + "\n" + program
    results = run_code_tests(program, parsed.tests, limits, stop_at_failure=reward == "all_pass")
    passed = sum(r.passed for r in results)
    if reward == "all_pass":
        return 1.0 if passed == len(parsed.tests) else 0.0
    return passed / len(parsed.tests)


def limits_of(settings: Any) -> SandboxLimits:
    """:class:`SandboxLimits` of a ``config.reward.CodeRewardConfig`` (``rl.reward.code``)."""
    return SandboxLimits(
        wall_s=settings.wall_s,
        cpu_s=settings.cpu_s,
        memory_mb=settings.memory_mb,
        max_processes=settings.max_processes,
        max_output_bytes=settings.max_output_bytes,
    )
