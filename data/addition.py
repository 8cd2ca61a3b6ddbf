"""The quickstart's own task: two-digit addition ("What is 47 + 38?" -> "85").

No dataset hub is needed: every split is generated from a seed. The files use the
normalized formats the rest of the data layer reads:

- ``sft.jsonl``: ``{"messages": [{"role": "user", ...}, {"role": "assistant", "content": "85"}]}``
- ``preference.jsonl``: ``{"prompt": [user message], "chosen": "85", "rejected": "86"}``
- ``rl_train.jsonl`` / ``rl_eval.jsonl``: ``{"prompt": [user message], "label": "85"}``

The held-out evaluation prompts share no operand pair with any training split, in either
order: if ``47 + 38`` is held out, neither ``47 + 38`` nor ``38 + 47`` is trained on, so
evaluation measures addition rather than recall of a seen prompt.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from data.validate import write_jsonl_atomic

MIN_OPERAND = 10
MAX_OPERAND = 99

SPLIT_FILES = {
    "sft": "sft.jsonl",
    "preference": "preference.jsonl",
    "rl_train": "rl_train.jsonl",
    "rl_eval": "rl_eval.jsonl",
}


def addition_question(a: int, b: int) -> str:
    """The user turn for ``a + b``, e.g. ``"What is 47 + 38?"``."""
    return f"What is {a} + {b}?"


def wrong_sums(a: int, b: int) -> list[int]:
    """Plausible wrong answers to ``a + b``, deduplicated, in a fixed order.

    Off by one (``s - 1``, ``s + 1``), off by ten (``s - 10``, ``s + 10``: a dropped or
    extra carry) and the sum's digits reversed (``85 -> 58``) when that differs from the
    sum. Never the sum itself, never negative.
    """
    s = a + b
    candidates = [s - 1, s + 1, s - 10, s + 10, int(str(s)[::-1])]
    out: list[int] = []
    for c in candidates:
        if c != s and c >= 0 and c not in out:
            out.append(c)
    return out


def make_addition_datasets(
    out_dir: str | os.PathLike,
    *,
    num_sft: int,
    num_preference: int,
    num_rl: int,
    num_eval: int,
    seed: int,
) -> dict[str, Path]:
    """Write the four addition splits as JSONL files into ``out_dir``.

    Operands range over 10..99 (8100 ordered pairs). ``num_eval`` distinct ordered pairs
    are held out first; every training split then draws distinct pairs (within the split)
    from the pairs whose unordered operand set is not held out. Different training splits
    may share pairs with each other. The same arguments always give byte-identical files.

    Args:
        out_dir: directory to write into (created if missing).
        num_sft, num_preference, num_rl, num_eval: rows per split (``sft``,
            ``preference``, ``rl_train``, ``rl_eval``).
        seed: seed of the generator (Python ``random.Random``).

    Returns:
        ``{"sft": Path, "preference": Path, "rl_train": Path, "rl_eval": Path}``.

    Raises:
        ValueError: a count is not positive, or more pairs are requested than exist
            (the message names the argument and the available number).
    """
    counts = {"num_sft": num_sft, "num_preference": num_preference, "num_rl": num_rl, "num_eval": num_eval}
    for name, value in counts.items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"make_addition_datasets: {name} must be a positive int, got {value!r}")

    operands = range(MIN_OPERAND, MAX_OPERAND + 1)
    all_pairs = [(a, b) for a in operands for b in operands]
    if num_eval > len(all_pairs):
        raise ValueError(f"make_addition_datasets: num_eval={num_eval} exceeds the {len(all_pairs)} operand pairs")
    rng = random.Random(seed)
    eval_pairs = rng.sample(all_pairs, num_eval)
    held_out = {frozenset(p) for p in eval_pairs}
    train_pool = [p for p in all_pairs if frozenset(p) not in held_out]

    def draw(name: str, n: int) -> list[tuple[int, int]]:
        if n > len(train_pool):
            raise ValueError(
                f"make_addition_datasets: {name}={n} exceeds the {len(train_pool)} training pairs left after holding out evaluation"
            )
        return rng.sample(train_pool, n)

    def user(a: int, b: int) -> list[dict]:
        return [{"role": "user", "content": addition_question(a, b)}]

    sft = [
        {"messages": user(a, b) + [{"role": "assistant", "content": str(a + b)}]} for a, b in draw("num_sft", num_sft)
    ]
    preference = [
        {"prompt": user(a, b), "chosen": str(a + b), "rejected": str(rng.choice(wrong_sums(a, b)))}
        for a, b in draw("num_preference", num_preference)
    ]
    rl_train = [{"prompt": user(a, b), "label": str(a + b)} for a, b in draw("num_rl", num_rl)]
    rl_eval = [{"prompt": user(a, b), "label": str(a + b)} for a, b in eval_pairs]

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for split, rows in (("sft", sft), ("preference", preference), ("rl_train", rl_train), ("rl_eval", rl_eval)):
        paths[split] = out / SPLIT_FILES[split]
        write_jsonl_atomic(rows, paths[split])
    return paths
