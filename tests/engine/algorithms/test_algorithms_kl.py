"""KL estimators, KL loss, KL reward penalty and the KL controllers by hand."""

from __future__ import annotations

import math

import pytest
import torch

from engine.algorithms.kl import (
    KL_CONTROLLERS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_estimator,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_loss,
)


def test_estimator_values():
    half, quarter = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # policy 0.5, reference 0.25: log r = log(0.25 / 0.5) = -log 2
    assert kl_k1(half, quarter).item() == pytest.approx(math.log(2))
    assert kl_k2(half, quarter).item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_k3(half, quarter).item() == pytest.approx(0.5 - 1 + math.log(2))
    # policy 0.25, reference 0.5: log r = log 2
    assert kl_k1(quarter, half).item() == pytest.approx(-math.log(2))
    assert kl_k2(quarter, half).item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_k3(quarter, half).item() == pytest.approx(2 - 1 - math.log(2))


def test_k3_is_clamped_like_low_var_kl():
    # log r = 30 -> clamped to 20 -> e^20 - 21, then clamped to 10; log r = -30 -> 19 -> 10
    assert kl_k3(torch.tensor([-30.0]), torch.tensor([0.0])).item() == 10.0
    assert kl_k3(torch.tensor([0.0]), torch.tensor([-30.0])).item() == 10.0
    assert get_kl_estimator("low_var_kl") is kl_k3


def test_k1_and_k3_unbiased_k2_not():
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)  # policy
    p = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)  # reference
    kl = (q * (q / p).log()).sum().item()
    assert (q * kl_k1(q.log(), p.log())).sum().item() == pytest.approx(kl, abs=1e-12)
    assert (q * kl_k3(q.log(), p.log())).sum().item() == pytest.approx(kl, abs=1e-12)
    assert (q * kl_k2(q.log(), p.log())).sum().item() != pytest.approx(kl, abs=1e-3)


def test_kl_loss_is_aggregated():
    logprobs = torch.log(torch.tensor([[0.5, 0.5, 0.9]]))
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert kl_loss(logprobs, ref, mask, "k1").item() == pytest.approx((math.log(2) + 0) / 2, abs=1e-6)
    with pytest.raises(KeyError, match="known"):
        kl_loss(logprobs, ref, mask, "k4")


def test_kl_reward_penalty_hand_computed():
    logprobs = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.25, 0.9]]))
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.5], [0.5, 0.5, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    beta, ln2 = 0.1, math.log(2)
    token_rewards, seq_kl = apply_kl_penalty(torch.tensor([1.0, 0.0]), logprobs, ref, mask, beta, "k1")
    # k1 per token: row 0 [ln2, 0, 0], row 1 [0, -ln2, (padding)]; score on the last mask token
    expected = torch.tensor([[-beta * ln2, 0.0, 1.0], [0.0, beta * ln2, 0.0]])
    torch.testing.assert_close(token_rewards, expected)
    torch.testing.assert_close(seq_kl, torch.tensor([ln2, -ln2]))


def test_adaptive_controller_update_numbers():
    ctl = AdaptiveKLController(init_coef=0.1, target_kl=6.0, horizon=10000)
    # KL 9: error 9/6 - 1 = 0.5, clipped to 0.2 -> x (1 + 0.2 * 256 / 10000) = x 1.00512
    assert ctl.update(9.0, 256) == pytest.approx(0.1 * 1.00512)
    # KL 5.4: error -0.1 -> x (1 - 0.1 * 256 / 10000) = x 0.99744
    assert ctl.update(5.4, 256) == pytest.approx(0.1 * 1.00512 * 0.99744)
    # KL 0: error -1, clipped to -0.2 -> x 0.99488
    assert ctl.update(0.0, 256) == pytest.approx(0.1 * 1.00512 * 0.99744 * 0.99488)
    assert ctl.value == pytest.approx(0.1 * 1.00512 * 0.99744 * 0.99488)
    with pytest.raises(ValueError, match="must all be > 0"):
        AdaptiveKLController(0.1, 0.0, 10000)


def test_fixed_controller_and_registry():
    ctl = KL_CONTROLLERS["fixed"](0.05)
    assert isinstance(ctl, FixedKLController)
    assert ctl.update(100.0, 256) == 0.05 and ctl.value == 0.05
    assert KL_CONTROLLERS["adaptive"] is AdaptiveKLController
