"""RL data mixtures: the drawn fraction per source follows the weights, each source's own
order is an epoch permutation, and a resumed sampler continues every source exactly."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from engine.batching.sampler import EpochSampler, MixtureSampler
from engine.storage.train_state import DataPosition

STEPS, PROMPTS_PER_STEP = 60, 8


def source_of(index: int, starts: list[int]) -> int:
    return max(i for i, s in enumerate(starts) if s <= index)


@pytest.mark.parametrize("weights", [[3.0, 1.0], [1.0, 2.0, 5.0]])
def test_drawn_fraction_per_source_matches_the_weights_within_three_standard_errors(weights):
    sizes = [7, 11, 5][: len(weights)]
    sampler = MixtureSampler(sizes, weights, seed=1234)
    drawn = [sampler.next_indices(PROMPTS_PER_STEP) for _ in range(STEPS)]
    n = STEPS * PROMPTS_PER_STEP  # 480 draws
    counts = np.bincount([source_of(i, sampler.starts) for step in drawn for i in step], minlength=len(weights))
    for i, w in enumerate(weights):
        p = w / sum(weights)
        expected, se = n * p, math.sqrt(n * p * (1 - p))  # Binomial(n, p) mean and standard deviation
        # e.g. weights [3, 1]: n 480, expected 360 +- 9.5 from source 0 (observed: counts[0])
        assert abs(counts[i] - expected) <= 3 * se, (
            f"source {i}: n {n}, expected {expected:.1f} +- {se:.2f}, observed {counts[i]}"
        )
    assert sampler.draws == n


def test_each_source_is_visited_in_its_own_epoch_permutations():
    sizes, seed = [4, 6], 7
    sampler = MixtureSampler(sizes, [1.0, 1.0], seed)
    drawn = sampler.next_indices(200)
    for i, size in enumerate(sizes):
        own = [x - sampler.starts[i] for x in drawn if source_of(x, sampler.starts) == i]
        reference = EpochSampler(size, MixtureSampler.source_seed(seed, i)).next_indices(len(own))
        assert own == reference  # exactly the source's EpochSampler order, across epochs
        assert sorted(own[:size]) == list(range(size))  # the first epoch is a permutation
    # the sources' shuffles are independent streams, not the same permutation
    assert MixtureSampler.source_seed(seed, 0) != MixtureSampler.source_seed(seed, 1)


def test_draws_depend_on_seed_and_count_only_not_on_how_they_were_batched():
    a = MixtureSampler([5, 9], [1.0, 3.0], seed=3)
    b = MixtureSampler([5, 9], [1.0, 3.0], seed=3)
    assert a.next_indices(2500) == [i for size in [1, 1023, 7, 1469] for i in b.next_indices(size)]  # across blocks
    assert MixtureSampler([5, 9], [1.0, 3.0], seed=4).next_indices(50) != MixtureSampler(
        [5, 9], [1.0, 3.0], seed=3
    ).next_indices(50)


def test_a_resumed_sampler_continues_every_sources_order_exactly():
    sizes, weights, seed = [3, 8, 5], [2.0, 1.0, 1.5], 11
    uninterrupted = MixtureSampler(sizes, weights, seed)
    expected = [uninterrupted.next_indices(PROMPTS_PER_STEP) for _ in range(STEPS)]

    first = MixtureSampler(sizes, weights, seed)
    got = [first.next_indices(PROMPTS_PER_STEP) for _ in range(23)]
    position = DataPosition(0, 0, seed, first.draws, first.sources)
    # a checkpoint stores the position as plain data (lists, ints) and reads it back
    restored = DataPosition(
        **{k: [list(s) for s in v] if k == "sources" else v for k, v in dataclasses.asdict(position).items()}
    )
    assert restored == position and restored.sources == first.sources
    assert any(epoch > 0 for epoch, _ in restored.sources)  # the small source is past its first epoch
    resumed = MixtureSampler(sizes, weights, seed, restored.draws, restored.sources)
    got += [resumed.next_indices(PROMPTS_PER_STEP) for _ in range(STEPS - 23)]
    assert got == expected
    assert resumed.sources == uninterrupted.sources and resumed.draws == uninterrupted.draws == STEPS * PROMPTS_PER_STEP


def test_bad_mixtures_are_refused():
    with pytest.raises(ValueError, match="2 sources and 1 weights"):
        MixtureSampler([3, 4], [1.0], 0)
    with pytest.raises(ValueError, match="positive and finite"):
        MixtureSampler([3, 4], [1.0, 0.0], 0)
    with pytest.raises(ValueError, match="holds 1 sources, the mixture has 2"):
        MixtureSampler([3, 4], [1.0, 1.0], 0, 5, ((0, 1),))
    with pytest.raises(ValueError, match="no rows"):
        MixtureSampler([3, 0], [1.0, 1.0], 0)
