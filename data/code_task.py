"""The code quickstart's own task: write a one-line Python function from a worded formula.

"Write a Python function f(a, b) that returns a times 3 plus b." -> ``def f(a, b): return a * 3 + b``

No dataset hub is needed: every split is generated from a seed. A problem is a function name
(:data:`FUNCTION_NAMES`), an argument pair (:data:`ARGUMENT_PAIRS`) and an *expression*: the
two arguments in either order around ``op1 c op2`` (``op1``, ``op2`` in ``+ - *``, ``c`` in
1..9), read with Python's precedence (``a plus 3 times b`` is ``a + 3 * b``). The model must
map the words to operators and copy names and the constant: a task to learn, not to recall.

Files, in the normalized formats the rest of the data layer reads:

- ``sft.jsonl``: ``{"messages": [user turn, {"role": "assistant", "content": "def f(a, b): return a * 3 + b"}]}``
  (the bare function: the ``code`` verifier runs the whole response when it has no fenced
  block, ``data.code_verifier.extract_code``);
- ``rl_train.jsonl`` / ``rl_eval.jsonl``: ``{"prompt": [user turn], "label": <code label>}``
  (format ``prompt_label``), the label the ``code`` verifier's JSON ``{"asserts": [test]}``.

Tests: :data:`NUM_ASSERTS` asserts on argument values in 0..:data:`MAX_INPUT`, chosen so that
every *neighbour* of the expression (one operator or the constant changed, or the arguments
swapped) fails at least one of them, when such values exist among :data:`MAX_TRIES` draws.
The asserts are one test (one string, one sandbox process per response: about 35 ms here
against about 110 ms for three processes, measured on the 2-core CPU), so the reward is
all-or-nothing in either ``rl.reward.code.reward`` mode.

Held out: the evaluation problems use expressions that no training split contains under any
name or argument pair, so evaluation measures the mapping, not recall of a seen formula.
"""

from __future__ import annotations

import itertools
import json
import operator
import os
import random
from dataclasses import dataclass
from pathlib import Path

from data.validate import write_jsonl_atomic

FUNCTION_NAMES = ("f", "g", "calc", "compute")
ARGUMENT_PAIRS = (("a", "b"), ("x", "y"), ("m", "n"), ("p", "q"))
OPERATORS = {"+": "plus", "-": "minus", "*": "times"}
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul}
CONSTANTS = range(1, 10)
NUM_ASSERTS = 3
MAX_INPUT = 20
MAX_TRIES = 200

SPLIT_FILES = {"sft": "sft.jsonl", "rl_train": "rl_train.jsonl", "rl_eval": "rl_eval.jsonl"}


@dataclass(frozen=True)
class Expression:
    """``first op1 constant op2 second``, where ``swapped`` puts the second argument first."""

    swapped: bool
    op1: str
    constant: int
    op2: str

    def code(self, args: tuple[str, str]) -> str:
        """The Python expression over ``args``, e.g. ``"a * 3 + b"``."""
        u, v = (args[1], args[0]) if self.swapped else args
        return f"{u} {self.op1} {self.constant} {self.op2} {v}"

    def words(self, args: tuple[str, str]) -> str:
        """The same in words, e.g. ``"a times 3 plus b"``."""
        u, v = (args[1], args[0]) if self.swapped else args
        return f"{u} {OPERATORS[self.op1]} {self.constant} {OPERATORS[self.op2]} {v}"

    def value(self, a: int, b: int) -> int:
        """The expression at ``(a, b)`` (Python's precedence: ``*`` before ``+`` and ``-``)."""
        u, v = (b, a) if self.swapped else (a, b)
        if self.op2 == "*" and self.op1 != "*":  # u op1 (c * v)
            return _APPLY[self.op1](u, self.constant * v)
        return _APPLY[self.op2](_APPLY[self.op1](u, self.constant), v)

    def neighbours(self) -> list[Expression]:
        """Every expression one edit away (another ``op1``, ``op2`` or constant, or the arguments
        swapped) that is a different function (``a + 3 + b`` swapped is the same one)."""
        out = [Expression(not self.swapped, self.op1, self.constant, self.op2)]
        out += [Expression(self.swapped, o, self.constant, self.op2) for o in OPERATORS if o != self.op1]
        out += [Expression(self.swapped, self.op1, self.constant, o) for o in OPERATORS if o != self.op2]
        out += [Expression(self.swapped, self.op1, c, self.op2) for c in CONSTANTS if c != self.constant]
        grid = [(a, b) for a in range(4) for b in range(4)]  # two such polynomials that agree here are equal
        return [n for n in out if any(n.value(a, b) != self.value(a, b) for a, b in grid)]


ALL_EXPRESSIONS = tuple(
    Expression(s, o1, c, o2) for s in (False, True) for o1 in OPERATORS for c in CONSTANTS for o2 in OPERATORS
)


@dataclass(frozen=True)
class CodeProblem:
    """One problem: function ``name``, its two ``args``, the ``expression`` it returns."""

    name: str
    args: tuple[str, str]
    expression: Expression

    def question(self) -> str:
        """The user turn: ``"Write a Python function f(a, b) that returns a times 3 plus b."``"""
        return f"Write a Python function {self.name}({', '.join(self.args)}) that returns {self.expression.words(self.args)}."

    def solution(self) -> str:
        """The reference answer, one line: ``"def f(a, b): return a * 3 + b"``."""
        return f"def {self.name}({', '.join(self.args)}): return {self.expression.code(self.args)}"

    def label(self, rng: random.Random) -> str:
        """The ``code`` verifier's label (``{"asserts": [one test of NUM_ASSERTS asserts]}``) with
        inputs drawn from ``rng`` that tell the expression from its neighbours (module docstring)."""
        neighbours = self.expression.neighbours()
        best: list[tuple[int, int]] = []
        best_caught = -1
        for _ in range(MAX_TRIES):
            inputs = [(rng.randint(0, MAX_INPUT), rng.randint(0, MAX_INPUT)) for _ in range(NUM_ASSERTS)]
            caught = sum(any(n.value(a, b) != self.expression.value(a, b) for a, b in inputs) for n in neighbours)
            if caught > best_caught:
                best, best_caught = inputs, caught
            if caught == len(neighbours):
                break
        test = "\n".join(f"assert {self.name}({a}, {b}) == {self.expression.value(a, b)}" for a, b in best)
        return json.dumps({"asserts": [test]})


def _variants(expression: Expression) -> list[CodeProblem]:
    return [CodeProblem(name, args, expression) for name, args in itertools.product(FUNCTION_NAMES, ARGUMENT_PAIRS)]


def make_code_datasets(
    out_dir: str | os.PathLike, *, num_sft: int, num_rl: int, num_eval: int, seed: int
) -> dict[str, Path]:
    """Write the three code splits as JSONL files into ``out_dir``.

    There are ``len(ALL_EXPRESSIONS)`` = 162 expressions, each under 16 (name, arguments)
    variants: 2592 problems. The fewest whole expressions that give ``num_eval`` problems are
    held out (shuffled by ``seed``), and ``num_eval`` of their variants are the evaluation
    problems; ``sft`` and ``rl_train`` each draw distinct problems (within the split) from the
    other expressions' variants. The same arguments always give byte-identical files.

    Args:
        out_dir: directory to write into (created if missing).
        num_sft, num_rl, num_eval: rows of ``sft``, ``rl_train``, ``rl_eval``.
        seed: seed of the generator (Python ``random.Random``).

    Returns:
        ``{"sft": Path, "rl_train": Path, "rl_eval": Path}``.

    Raises:
        ValueError: a count is not a positive int, or a split asks for more problems than
            its pool holds (the message names the argument, the pool size and the fix).
    """
    counts = {"num_sft": num_sft, "num_rl": num_rl, "num_eval": num_eval}
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"make_code_datasets: {name} must be a positive int, got {value!r}")
    per_expression = len(FUNCTION_NAMES) * len(ARGUMENT_PAIRS)
    held = -(-num_eval // per_expression)  # ceil
    if held >= len(ALL_EXPRESSIONS):
        raise ValueError(
            f"make_code_datasets: num_eval={num_eval} would hold out {held} of the "
            f"{len(ALL_EXPRESSIONS)} expressions and leave none to train on; use at most "
            f"{(len(ALL_EXPRESSIONS) - 1) * per_expression}"
        )
    rng = random.Random(seed)
    expressions = list(ALL_EXPRESSIONS)
    rng.shuffle(expressions)
    eval_pool = [p for e in expressions[:held] for p in _variants(e)]
    train_pool = [p for e in expressions[held:] for p in _variants(e)]

    def draw(name: str, n: int, pool: list[CodeProblem]) -> list[CodeProblem]:
        if n > len(pool):
            raise ValueError(
                f"make_code_datasets: {name}={n} exceeds the {len(pool)} problems of its pool "
                f"(training problems are those whose expression is not held out); lower {name}"
            )
        return rng.sample(pool, n)

    eval_problems = draw("num_eval", num_eval, eval_pool)

    def user(p: CodeProblem) -> list[dict]:
        return [{"role": "user", "content": p.question()}]

    sft = [
        {"messages": user(p) + [{"role": "assistant", "content": p.solution()}]}
        for p in draw("num_sft", num_sft, train_pool)
    ]
    rl_train = [{"prompt": user(p), "label": p.label(rng)} for p in draw("num_rl", num_rl, train_pool)]
    rl_eval = [{"prompt": user(p), "label": p.label(rng)} for p in eval_problems]

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for split, rows in (("sft", sft), ("rl_train", rl_train), ("rl_eval", rl_eval)):
        paths[split] = out / SPLIT_FILES[split]
        write_jsonl_atomic(rows, paths[split])
    return paths
