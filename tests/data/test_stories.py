"""The story task: prompt files and the story reward."""

from __future__ import annotations

import json

import pytest

from data.rewards import get_verifier
from data.stories import CHARACTERS, NAMES, make_story_datasets, story_opening, story_reward


def test_story_datasets_hold_out_pairs_and_are_reproducible(tmp_path):
    paths = make_story_datasets(tmp_path / "a", num_rl=500, num_eval=100, seed=3)
    again = make_story_datasets(tmp_path / "b", num_rl=500, num_eval=100, seed=3)
    assert all(paths[k].read_bytes() == again[k].read_bytes() for k in paths)
    train = [json.loads(line) for line in paths["rl_train"].open()]
    held = [json.loads(line) for line in paths["rl_eval"].open()]
    assert len(train) == 500 and len(held) == 100 == len({r["prompt"] for r in held})
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert (
        held[0]["prompt"] == story_opening(*_pair(held[0]["prompt"]))
        and held[0]["label"] == _pair(held[0]["prompt"])[1]
    )
    with pytest.raises(ValueError, match="num_eval=640 leaves none of the 640 openings"):
        make_story_datasets(tmp_path / "c", num_rl=1, num_eval=len(CHARACTERS) * len(NAMES), seed=0)
    with pytest.raises(ValueError, match="num_rl must be a positive int"):
        make_story_datasets(tmp_path / "c", num_rl=0, num_eval=1, seed=0)


def _pair(prompt: str) -> tuple[str, str]:
    words = prompt.rstrip(".").split()
    return words[-3], words[-1]


@pytest.mark.parametrize(
    "response, finish_reason, reward",
    [
        ("Max was happy. Max played all day. The end.", "stop", 1.0),
        ("Max was happy. Max played all day and then", "length", 0.0),  # did not finish
        ("The dog was happy. The end.", "stop", 0.0),  # forgot the character
        ("Maxi and Maxwell played.", "stop", 0.0),  # whole words only
        ("max played.", "stop", 0.0),  # names are case-sensitive
        ("Max's ball was red.", "stop", 1.0),  # a possessive is the name
        ('"Max!" said mom.', "stop", 1.0),
    ],
)
def test_story_reward(response, finish_reason, reward):
    assert story_reward(response, "Max", finish_reason=finish_reason) == reward
    assert get_verifier("story")(response, "Max", finish_reason) == reward  # as the engine calls it


def test_story_reward_rejects_bad_input():
    with pytest.raises(ValueError, match="finish_reason must be 'stop' or 'length', got 'abort'"):
        story_reward("Max.", "Max", finish_reason="abort")
    with pytest.raises(ValueError, match="empty label"):
        story_reward("Max.", " ", finish_reason="stop")
