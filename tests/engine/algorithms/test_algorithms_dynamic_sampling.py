"""DAPO dynamic sampling: the group filter and fill_batch with a deterministic fake generator."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.algorithms.dynamic_sampling import fill_batch, informative_group_mask


def test_informative_group_mask():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 2.0, 2.0, 2.0, 0.35, 0.35 + 1e-9], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 2, 3, 3, 3, 9, 9])
    # all-equal and size-1 groups are dropped; any difference at all (std > 0) keeps a group
    keep = informative_group_mask(rewards, groups)
    assert keep.tolist() == [False, False, True, True, False, False, False, False, True, True]
    assert groups[keep].unique().tolist() == [1, 9]
    assert informative_group_mask(torch.zeros(0), torch.zeros(0, dtype=torch.long)).tolist() == []
    with pytest.raises(ValueError, match="same length"):
        informative_group_mask(torch.zeros(3), torch.zeros(2, dtype=torch.long))


def _fake_generator(rounds):
    """generate_round() returning the given rounds in order, counting calls."""
    it = iter(rounds)

    def generate_round():
        generate_round.calls += 1
        return next(it)

    generate_round.calls = 0
    return generate_round


ROUNDS = [
    [[1, 1], [0, 1], [0, 0]],  # keeps 1
    [[1, 0], [1, 1]],  # keeps 1 (2 so far)
    [[0, 1], [1, 0.5], [0.2, 0.3]],  # keeps 3 (5 so far) -> the target of 3 is reached
    [[0, 1]],
]


def test_fill_batch_reaches_the_target():
    gen = _fake_generator(ROUNDS)
    out = fill_batch(gen, target_groups=3, max_rounds=10)
    assert out.groups == [[0, 1], [1, 0], [0, 1]]  # the extras of round 3 are discarded
    assert (out.rounds, out.num_generated, out.num_dropped, gen.calls) == (3, 8, 3, 3)


def test_fill_batch_max_rounds_strict_raises_lenient_warns():
    with pytest.raises(RuntimeError, match="only 2 of 3 groups .* after 2 rounds"):
        fill_batch(_fake_generator(ROUNDS), target_groups=3, max_rounds=2)
    with pytest.warns(RuntimeWarning, match="only 2 of 3 groups"):
        out = fill_batch(_fake_generator(ROUNDS), target_groups=3, max_rounds=2, strict=False)
    assert out.groups == [[0, 1], [1, 0]] and out.rounds == 2 and out.num_dropped == 3
    with pytest.raises(ValueError, match="must be >= 1"):
        fill_batch(_fake_generator(ROUNDS), target_groups=0, max_rounds=2)


def test_fill_batch_reads_group_rewards_attribute():
    @dataclass
    class Group:
        prompt: str
        rewards: list

    rounds = [[Group("a", [1.0, 1.0]), Group("b", [0.0, 1.0])], [Group("c", [1.0])], [Group("d", [0.0, 0.5])]]
    out = fill_batch(_fake_generator(rounds), target_groups=2, max_rounds=3)
    assert [g.prompt for g in out.groups] == ["b", "d"]
    assert (out.rounds, out.num_generated, out.num_dropped) == (3, 4, 2)
