"""The story task for a pretrained story model (configs/tinystories.yaml).

Prompts are plain-text story openings built from a list of characters, e.g.
``"Once upon a time, there was a little dog named Max."``, labelled with the character's
name (``"Max"``). The reward (:func:`story_reward`) asks for a story that comes back to
its character and finishes within the response budget.

Files (the normalized ``rl`` kind, prompts as plain strings):
``rl_train.jsonl`` / ``rl_eval.jsonl`` with rows ``{"prompt": str, "label": name}``.
The held-out openings share no (character, name) pair with the training openings.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

from data.validate import write_jsonl_atomic

CHARACTERS = (
    "girl",
    "boy",
    "dog",
    "cat",
    "bird",
    "bunny",
    "bear",
    "fish",
    "mouse",
    "frog",
    "duck",
    "puppy",
    "kitten",
    "lion",
    "fox",
    "owl",
)
NAMES = (
    "Lily",
    "Tim",
    "Tom",
    "Ben",
    "Sue",
    "Max",
    "Sam",
    "Mia",
    "Anna",
    "Lucy",
    "Jack",
    "Timmy",
    "Sara",
    "Amy",
    "Bob",
    "Jane",
    "Kitty",
    "Spot",
    "Daisy",
    "Molly",
    "Billy",
    "Zoe",
    "Mark",
    "Jill",
    "Joe",
    "Kate",
    "Ellie",
    "Emma",
    "Jake",
    "Leo",
    "Mike",
    "Rose",
    "Pete",
    "Fred",
    "Ted",
    "Ann",
    "Lila",
    "Benny",
    "Bella",
    "Sally",
)
SPLIT_FILES = {"rl_train": "rl_train.jsonl", "rl_eval": "rl_eval.jsonl"}


def story_opening(character: str, name: str) -> str:
    """The prompt for one character, e.g. ``story_opening("dog", "Max")``."""
    return f"Once upon a time, there was a little {character} named {name}."


def make_story_datasets(out_dir: str | os.PathLike, *, num_rl: int, num_eval: int, seed: int) -> dict[str, Path]:
    """Write ``rl_train.jsonl`` and ``rl_eval.jsonl`` into ``out_dir``.

    ``num_eval`` distinct (character, name) pairs of the 16 x 40 = 640 are held out; the
    ``num_rl`` training rows are drawn with repetition from the other pairs. The same
    arguments always give byte-identical files.

    Returns: ``{"rl_train": Path, "rl_eval": Path}``.

    Raises:
        ValueError: a count is not positive, or ``num_eval`` leaves no training pair.
    """
    for name, value in (("num_rl", num_rl), ("num_eval", num_eval)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"make_story_datasets: {name} must be a positive int, got {value!r}")
    pairs = [(c, n) for c in CHARACTERS for n in NAMES]
    if num_eval >= len(pairs):
        raise ValueError(
            f"make_story_datasets: num_eval={num_eval} leaves none of the {len(pairs)} openings for training"
        )
    rng = random.Random(seed)
    held_out = rng.sample(pairs, num_eval)
    held = set(held_out)
    train_pool = [p for p in pairs if p not in held]
    rows = {
        "rl_train": [
            {"prompt": story_opening(c, n), "label": n} for c, n in (rng.choice(train_pool) for _ in range(num_rl))
        ],
        "rl_eval": [{"prompt": story_opening(c, n), "label": n} for c, n in held_out],
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {split: out / file for split, file in SPLIT_FILES.items()}
    for split, path in paths.items():
        write_jsonl_atomic(rows[split], path)
    return paths


def story_reward(response: str, label: str, *, finish_reason: str) -> float:
    """1.0 for a story that mentions its character again and ends within the budget, else 0.0.

    Both must hold: the response names ``label`` as a whole word (case-sensitive: names are
    capitalised, ``"Max"`` does not match ``"Maxi"``), and generation stopped at an EOS
    token (``finish_reason == "stop"``) rather than running out of tokens (``"length"``).

    Raises:
        ValueError: ``finish_reason`` is neither ``"stop"`` nor ``"length"``, or the label is blank.
    """
    if finish_reason not in ("stop", "length"):
        raise ValueError(f"story_reward: finish_reason must be 'stop' or 'length', got {finish_reason!r}")
    name = label.strip()
    if not name:
        raise ValueError("story_reward: empty label (expected the character's name)")
    mentioned = re.search(rf"(?<!\w){re.escape(name)}(?!\w)", response) is not None
    return 1.0 if mentioned and finish_reason == "stop" else 0.0
