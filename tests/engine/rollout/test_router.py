"""The rollout router's pure parts: which engine generates which prompt, putting the results
back in prompt order, and the per-prompt seeds of a share (engine/rollout/router.py,
engine/rollout/base.py). The router on real Ray and vLLM engines, with engines killed and
stopped, is tests/engine/rl/test_rollout_faults.py."""

from __future__ import annotations

import pytest

from engine.rollout.base import SamplingSpec
from engine.rollout.router import assign_prompts, reassemble


def test_split_is_longest_first_to_the_least_loaded_engine():
    # by hand: costs 9(1) 9(3) 7(5) 5(0) 3(2) 1(4), longest first, ties by index; each to the
    # engine with the smaller total, ties to engine 0:
    # 1 -> e0 (9), 3 -> e1 (9), 5 -> e0 (16), 0 -> e1 (14), 2 -> e1 (17), 4 -> e0 (17)
    assert assign_prompts([5, 9, 3, 9, 1, 7], 2) == [[1, 4, 5], [0, 2, 3]]
    # three engines: 1 -> e0 (9), 3 -> e1 (9), 5 -> e2 (7), 0 -> e2 (12), 2 -> e0 (12), 4 -> e1 (10)
    assert assign_prompts([5, 9, 3, 9, 1, 7], 3) == [[1, 2], [3, 4], [0, 5]]
    # equal lengths (a step of same-shaped prompts): round robin by index
    assert assign_prompts([10] * 8, 2, response_budget=6) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # the response budget counts: without it the long prompt alone balances five short ones
    assert assign_prompts([40, 8, 8, 8, 8, 8], 2) == [[0], [1, 2, 3, 4, 5]]
    # with 32 response tokens each: costs 72 and 5 x 40: 0 -> e0 (72), 1 -> e1 (40), 2 -> e1 (80),
    # 3 -> e0 (112), 4 -> e1 (120), 5 -> e0 (152): three prompts each
    assert assign_prompts([40, 8, 8, 8, 8, 8], 2, response_budget=32) == [[0, 3, 5], [1, 2, 4]]
    # fewer prompts than engines: an engine gets nothing
    assert assign_prompts([3], 2) == [[0], []]
    with pytest.raises(ValueError, match="rl.rollout.num_engines must be >= 1"):
        assign_prompts([3], 0)


def test_split_is_deterministic_covers_every_prompt_once_and_is_balanced():
    import random

    rng = random.Random(0)
    for trial in range(50):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 64))]
        k = rng.randint(1, 5)
        shares = assign_prompts(lengths, k, response_budget=16)
        assert shares == assign_prompts(list(lengths), k, response_budget=16)  # same prompts, same split
        assert sorted(i for s in shares for i in s) == list(range(len(lengths)))
        assert all(s == sorted(s) for s in shares)
        totals = [sum(lengths[i] + 16 for i in s) for s in shares]
        # greedy's bound: the largest total exceeds the smallest by at most the largest cost
        assert max(totals) - min(totals) <= max(lengths) + 16, (trial, totals)


def test_reassemble_puts_results_back_in_prompt_order():
    shares = [[1, 4, 5], [0, 2, 3]]
    parts = [["b", "e", "f"], ["a", "c", "d"]]
    assert reassemble(shares, parts, 6) == ["a", "b", "c", "d", "e", "f"]
    assert reassemble([[0], []], [["x"], []], 1) == ["x"]
    with pytest.raises(ValueError, match="share 1: 2 prompts but 1 results"):
        reassemble([[0], [1, 2]], [["a"], ["b"]], 3)
    with pytest.raises(ValueError, match=r"prompts \[2\] are in no share"):
        reassemble([[0], [1]], [["a"], ["b"]], 3)
    with pytest.raises(ValueError, match="prompt 1 is in two shares"):
        reassemble([[0, 1], [1]], [["a", "b"], ["c"]], 2)


def test_a_share_seeds_each_prompt_by_its_place_in_the_batch():
    spec = SamplingSpec(n=4, seed=1000)
    assert [spec.prompt_seed(i) for i in range(3)] == [1000, 1004, 1008]  # the whole batch: seed + i * n
    share = SamplingSpec(n=4, seed=1000, prompt_index=(5, 2))
    assert [share.prompt_seed(i) for i in range(2)] == [1020, 1008]  # seed + place * n
