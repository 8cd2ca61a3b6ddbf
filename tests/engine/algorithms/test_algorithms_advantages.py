"""Advantage estimators against hand-computed values and loop references, including degenerate groups."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from engine.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_gae,
    dr_grpo_advantages,
    get_advantage_estimator,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)

OUTCOME = ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"]


def test_registry_keys():
    assert sorted(ADVANTAGE_ESTIMATORS) == sorted(OUTCOME + ["reinforce_plus_plus", "gae", "on_policy_distill"])


def test_grpo_group_of_four_hand_computed():
    # [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3); A = +-0.5 / sqrt(1/3) = +-0.866
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    a = 0.5 / math.sqrt(1 / 3)
    assert a == pytest.approx(0.8660254, abs=1e-7)
    adv = grpo_advantages(rewards, torch.zeros(4, dtype=torch.long), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a]), rtol=0, atol=1e-6)
    # Dr.GRPO drops the std: A = r - mean
    one_group = torch.zeros(4, dtype=torch.long)
    torch.testing.assert_close(dr_grpo_advantages(rewards, one_group), torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert get_advantage_estimator("dr_grpo")(rewards, one_group).tolist() == [0.5, -0.5, -0.5, 0.5]


def test_outcome_estimators_broadcast_to_tokens_and_accept_token_rewards():
    rewards = torch.tensor([1.0, 0.0, 2.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    # the same scores spread over tokens (they sum to the score over the mask; padding ignored)
    token_rewards = torch.tensor([[0.5, 0.5, 9.0], [0.0, 0.0, 0.0], [1.0, 0.5, 0.5], [0.0, 5.0, -3.0]])
    for name in OUTCOME:
        fn = get_advantage_estimator(name)
        seq = fn(rewards, groups)
        assert seq.shape == (4,)
        tok = fn(rewards, groups, mask)
        assert tok.shape == (4, 3)
        if name != "reinforce_plus_plus_baseline":  # its std is over tokens with a mask, over responses without
            torch.testing.assert_close(tok, seq[:, None] * mask, msg=name)
        torch.testing.assert_close(fn(token_rewards, groups, mask), tok, msg=name)


@pytest.mark.parametrize("name", OUTCOME)
def test_degenerate_groups_are_finite_and_zero(name):
    fn = get_advantage_estimator(name)
    rewards = torch.tensor([5.0, 2.0, 2.0, 2.0, 0.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([0, 1, 1, 1, 2, 2])  # size-1 group, all-equal group, normal group
    adv = fn(rewards, groups)
    assert torch.isfinite(adv).all()
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert adv[4] < 0 < adv[5]


@pytest.mark.parametrize("name", OUTCOME)
def test_nearly_equal_rewards_do_not_blow_up(name):
    # 0.35 vs 0.35 + 1e-9: exact standardisation would give +-0.707; eps = 1e-6 bounds
    # |A| <= |r - mean| / eps = 5e-10 / 1e-6 = 5e-4, well under the documented 1e-2.
    rewards = torch.tensor([0.35, 0.35 + 1e-9], dtype=torch.float64)
    adv = get_advantage_estimator(name)(rewards, torch.tensor([3, 3]))
    assert torch.isfinite(adv).all()
    assert adv.abs().max().item() <= 1e-2


def test_grpo_float32_rewards_are_computed_in_float64():
    rewards = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float32)
    adv = grpo_advantages(rewards, torch.zeros(3, dtype=torch.long), eps=0.0)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 1.0]), rtol=0, atol=1e-6)


def test_rloo_hand_computed_and_loop_reference():
    # [1, 0, 0]: baselines are the mean of the other two: 0, 0.5, 0.5
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([4, 4, 4]))
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, -0.5]))
    rewards = torch.tensor([0.3, 1.0, 0.2, 0.7, 0.1, 0.9], dtype=torch.float64)
    groups = torch.tensor([0, 1, 0, 1, 1, 2])  # group 2 has one response -> 0
    expected = []
    for i in range(6):
        others = [rewards[j].item() for j in range(6) if groups[j] == groups[i] and j != i]
        expected.append(rewards[i].item() - sum(others) / len(others) if others else 0.0)
    torch.testing.assert_close(rloo_advantages(rewards, groups), torch.tensor(expected, dtype=torch.float64))


def test_reinforce_plus_plus_hand_computed():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    token_rewards = torch.tensor([[0.0, -0.1, 1.0], [0.2, 0.0, 0.0]])
    groups = torch.tensor([0, 0])
    # gamma = 1: reward-to-go [[0.9, 0.9, 1.0], [0.2, 0.0, -]], whitened over the 5 tokens
    returns = [0.9, 0.9, 1.0, 0.2, 0.0]
    mean, std = statistics.mean(returns), statistics.stdev(returns)
    white = [(g - mean) / (std + 1e-6) for g in returns]
    expected = torch.tensor([white[:3], white[3:] + [0.0]])
    torch.testing.assert_close(reinforce_plus_plus_advantages(token_rewards, groups, mask), expected, rtol=0, atol=1e-6)
    # gamma = 0.5: row 0 returns 1, -0.1 + 0.5 * 1 = 0.4, 0 + 0.5 * 0.4 = 0.2; row 1: 0.2, 0
    returns = [0.2, 0.4, 1.0, 0.2, 0.0]
    mean, std = statistics.mean(returns), statistics.stdev(returns)
    white = [(g - mean) / (std + 1e-6) for g in returns]
    adv = reinforce_plus_plus_advantages(token_rewards, groups, mask, gamma=0.5)
    torch.testing.assert_close(adv, torch.tensor([white[:3], white[3:] + [0.0]]), rtol=0, atol=1e-6)
    # a [B] score is placed on each row's last mask token
    scores = torch.tensor([1.0, 0.2])
    placed = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.2, 0.0]])
    torch.testing.assert_close(
        reinforce_plus_plus_advantages(scores, groups, mask), reinforce_plus_plus_advantages(placed, groups, mask)
    )
    with pytest.raises(ValueError, match="needs the response mask"):
        reinforce_plus_plus_advantages(scores, groups)


def test_reinforce_plus_plus_baseline_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 1])
    centered = [0.5, -0.5, 1.0, -1.0, 0.0]  # group means 0.5 and 2
    std = statistics.stdev(centered)  # over the 5 responses
    adv = reinforce_plus_plus_baseline_advantages(rewards, groups)
    torch.testing.assert_close(adv, torch.tensor([c / (std + 1e-6) for c in centered]), rtol=0, atol=1e-6)
    # with a mask the std is over tokens (each carries its response's value); no re-centring
    lengths = [1, 2, 1, 1, 3]
    mask = torch.tensor([[1.0] * n + [0.0] * (3 - n) for n in lengths])
    std_tok = statistics.stdev([c for c, n in zip(centered, lengths) for _ in range(n)])
    expected = torch.tensor([c / (std_tok + 1e-6) for c in centered])[:, None] * mask
    adv = reinforce_plus_plus_baseline_advantages(rewards, groups, mask)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)


def test_gae_three_tokens_hand_rolled():
    gamma, lam = 0.9, 0.8
    r, v = [0.0, 0.0, 1.0], [0.5, 0.6, 0.7]
    # backwards: delta_t = r_t + gamma V_{t+1} - V_t (V_3 = 0), A_t = delta_t + gamma lam A_{t+1}
    d2 = r[2] + gamma * 0.0 - v[2]  # 0.3
    a2 = d2
    d1 = r[1] + gamma * v[2] - v[1]  # 0.03
    a1 = d1 + gamma * lam * a2  # 0.246
    d0 = r[0] + gamma * v[1] - v[0]  # 0.04
    a0 = d0 + gamma * lam * a1  # 0.21712
    assert (a0, a1, a2) == pytest.approx((0.21712, 0.246, 0.3))
    # row 1 is the same response with one padding token in the middle of the tensor's tail
    rewards = torch.tensor([r, [0.0, 1.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([v, [0.5, 0.7, 9.9]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    # row 1: delta_1 = 1 - 0.7 = 0.3; delta_0 = 0.9 * 0.7 - 0.5 = 0.13; A_0 = 0.13 + 0.72 * 0.3
    expected = torch.tensor([[a0, a1, a2], [0.13 + 0.72 * 0.3, 0.3, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, (expected + values) * mask)
    # registry form: [B] scores on the last token, values as a keyword
    gae = get_advantage_estimator("gae")
    scores = torch.tensor([1.0, 1.0], dtype=torch.float64)
    out = gae(scores, torch.tensor([0, 1]), mask, values=values, gamma=gamma, lam=lam)
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="values"):
        gae(torch.tensor([1.0, 1.0]), torch.tensor([0, 1]), mask)


def test_gae_lambda_one_is_monte_carlo():
    # gamma = lam = 1: A_t = (reward-to-go) - V_t, returns = reward-to-go
    rewards = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    values = torch.tensor([[1.0, -1.0, 0.5, 0.0]])
    adv, ret = compute_gae(rewards, values, torch.ones(1, 4))
    to_go = torch.tensor([[1.0, 0.9, 0.7, 0.4]])
    torch.testing.assert_close(ret, to_go)
    torch.testing.assert_close(adv, to_go - values)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="same length"):
        grpo_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="finite"):
        rloo_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="need a mask"):
        grpo_advantages(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="must all be"):
        compute_gae(torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3))
