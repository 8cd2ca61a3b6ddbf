"""Coding problems with tests: ``mbpp``, ``humaneval`` and ``apps`` give rl rows whose label is
the JSON test spec of the ``code`` verifier (:mod:`data.code_verifier`).

- mbpp ``{"text" | "prompt", "test_list": [assert, ...], "test_setup_code"?, "test_imports"?}``
  (the original and the sanitized MBPP): prompt = the task, then "Your code should pass these
  tests:" and the asserts (the prompt of Austin et al. 2021, arXiv:2108.07732, which shows the
  tests so the function name is known); label ``{"asserts", "setup"?}``.
- humaneval ``{"prompt", "test", "entry_point"}``: prompt = "Complete the following Python
  function" and the function stub; label ``{"check": test, "entry_point", "setup": prompt}``
  (the stub runs first, so its imports hold for a response that repeats only the function).
- apps ``{"question", "input_output": "{\\"inputs\\": [...], \\"outputs\\": [...]}"}`` (APPS,
  TACO; ``input_output`` a JSON string or object): label ``{"stdin_stdout": [[in, out], ...]}``.
  Call-based problems (``fn_name``) are refused: their tests call a function, not stdin.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from data.adapter_fields import Example, FieldError, _get, _json_type, _text
from data.code_verifier import parse_tests

MBPP_TEMPLATE = "{task}\nYour code should pass these tests:\n\n{tests}\n"
HUMANEVAL_TEMPLATE = "Complete the following Python function. Answer with the whole function in a ```python block.\n\n```python\n{stub}```\n"
APPS_TEMPLATE = (
    "{question}\n\nWrite a Python program that reads the input from standard input and prints the "
    "answer to standard output. Answer with the program in a ```python block."
)


def _row(prompt: str, label: dict[str, Any], origin: dict[str, str], label_field: str) -> list[Example]:
    text = json.dumps(label)
    try:
        parse_tests(text)
    except ValueError as exc:
        raise FieldError(label_field, str(exc)) from None
    return [Example({"prompt": [{"role": "user", "content": prompt}], "label": text}, origin)]


def _optional_text(record: Mapping[str, Any], key: str) -> str:
    value = record.get(key) or ""
    if isinstance(value, list):  # sanitized MBPP: test_imports is a list of import lines
        if not all(isinstance(v, str) for v in value):
            raise FieldError(key, "expected a string or a list of strings")
        return "\n".join(value)
    return _text(value, key)


def mbpp_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """MBPP ``{"text" | "prompt", "test_list", "test_setup_code"?, "test_imports"?}`` -> rl."""
    key = "text" if "text" in record else "prompt"
    task = _text(_get(record, key), key).strip()
    if not task:
        raise FieldError(key, "empty task")
    tests = _get(record, "test_list")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
        raise FieldError("test_list", f"expected a non-empty list of assert strings, got {_json_type(tests)}")
    setup = "\n".join(
        s for s in (_optional_text(record, "test_imports"), _optional_text(record, "test_setup_code")) if s.strip()
    )
    label: dict[str, Any] = {"asserts": tests, **({"setup": setup} if setup else {})}
    prompt = MBPP_TEMPLATE.format(task=task, tests="\n".join(tests))
    return _row(prompt, label, {"prompt[0].content": key, "label": "test_list"}, "test_list")


def humaneval_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """HumanEval ``{"prompt", "test", "entry_point"}`` -> rl."""
    stub = _text(_get(record, "prompt"), "prompt")
    if not stub.strip():
        raise FieldError("prompt", "empty function stub")
    test = _text(_get(record, "test"), "test")
    if "def check" not in test:
        raise FieldError("test", "expected the source of def check(candidate)")
    entry = _text(_get(record, "entry_point"), "entry_point")
    if not entry.isidentifier():
        raise FieldError("entry_point", f"{entry!r} is not a function name")
    label = {"check": test, "entry_point": entry, "setup": stub}
    return _row(
        HUMANEVAL_TEMPLATE.format(stub=stub if stub.endswith("\n") else stub + "\n"),
        label,
        {"prompt[0].content": "prompt", "label": "test"},
        "test",
    )


def apps_adapter(record: Mapping[str, Any], kind: str) -> list[Example]:
    """APPS / TACO ``{"question", "input_output"}`` (stdin/stdout problems) -> rl."""
    question = _text(_get(record, "question"), "question").strip()
    if not question:
        raise FieldError("question", "empty question")
    io = _get(record, "input_output")
    if isinstance(io, str):
        try:
            io = json.loads(io)
        except ValueError as exc:
            raise FieldError("input_output", f"not JSON: {exc}") from None
    if not isinstance(io, dict):
        raise FieldError("input_output", f"expected an object with inputs and outputs, got {_json_type(io)}")
    if io.get("fn_name"):
        raise FieldError(
            "input_output",
            f"a call-based problem (fn_name {io['fn_name']!r}); only stdin/stdout "
            "problems are supported: filter these rows out",
        )
    inputs, outputs = io.get("inputs"), io.get("outputs")
    for name, value in (("inputs", inputs), ("outputs", outputs)):
        if not isinstance(value, list) or not value:
            raise FieldError(f"input_output.{name}", f"expected a non-empty list of strings, got {_json_type(value)}")
        bad = [i for i, v in enumerate(value) if not isinstance(v, str)]
        if bad:
            raise FieldError(f"input_output.{name}[{bad[0]}]", f"expected a string, got {_json_type(value[bad[0]])}")
    assert isinstance(inputs, list) and isinstance(outputs, list)  # checked above, one at a time
    if len(inputs) != len(outputs):
        raise FieldError("input_output", f"{len(inputs)} inputs but {len(outputs)} outputs")
    label = {"stdin_stdout": [[i, o] for i, o in zip(inputs, outputs)]}
    return _row(
        APPS_TEMPLATE.format(question=question),
        label,
        {"prompt[0].content": "question", "label": "input_output"},
        "input_output",
    )
