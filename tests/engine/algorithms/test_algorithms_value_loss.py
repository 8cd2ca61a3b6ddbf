"""The critic's clipped value loss and PPO's GAE advantages, against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from config.rl import CriticConfig, RLConfig
from engine.algorithms.value_loss import clipped_value_loss
from engine.trajectory import Trajectory


def test_clipped_value_loss_by_hand():
    # token 0: V - V_old = 0.5 -> clipped to 0.7: errors (1 - 2)^2 = 1, (0.7 - 2)^2 = 1.69 -> 1.69
    # token 1: V - V_old = -0.5 -> clipped to 2.3: errors 0, 0.09 -> 0.09; token 2 is padding
    values = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.5, 2.5, 0.0]])
    returns = torch.tensor([[2.0, 2.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = clipped_value_loss(values, old, returns, mask, 0.2)
    assert out.vf_loss.item() == pytest.approx(0.5 * (1.69 + 0.09) / 2, abs=1e-6)
    assert out.vf_clipfrac.item() == 1.0
    out.vf_loss.backward()
    # both tokens take the clipped branch, whose clamp is saturated: no gradient at all
    assert torch.equal(values.grad, torch.zeros(1, 3))


def test_value_loss_inside_the_clip_is_half_the_squared_error():
    values = torch.tensor([[1.0, 3.0]], requires_grad=True)
    out = clipped_value_loss(values, torch.tensor([[0.9, 3.1]]), torch.tensor([[2.0, 2.0]]), torch.ones(1, 2), 0.2)
    # both inside the clip range: 0.5 * ((1 - 2)^2 + (3 - 2)^2) / 2 = 0.5, no clipping
    assert out.vf_loss.item() == pytest.approx(0.5) and out.vf_clipfrac.item() == 0.0
    out.vf_loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[-0.5, 0.5]]))  # (V - R) / 2 tokens


def test_value_loss_rejects_bad_input():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="must all be"):
        clipped_value_loss(x, x, torch.zeros(2, 2), x, 0.2)
    with pytest.raises(ValueError, match="cliprange_value"):
        clipped_value_loss(x, x, x, x, 0.0)


def test_gae_advantages_and_returns_in_the_rl_step():
    """rl.algorithm gae: GAE over the loss mask (gamma 1, lambda 0.5), score on the last
    token, advantages whitened over the batch's mask tokens; returns = A + V before whitening."""
    from engine.rl.phases import compute_advantages

    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    traj = Trajectory(
        input_ids=torch.ones(2, 5, dtype=torch.long),
        prompt_lengths=torch.tensor([2, 2]),
        response_ids=torch.ones(2, 3, dtype=torch.long),
        response_mask=mask,
        rollout_logprobs=torch.zeros(2, 3),
        group_index=torch.tensor([0, 1]),
        rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.zeros(2, 3),
        truncated=torch.tensor([False, False]),
        values=torch.tensor([[0.2, 0.4, 0.6], [0.5, 0.1, 0.0]]),
    )
    cfg = RLConfig(algorithm="gae", n_samples=1, critic=CriticConfig(gamma=1.0, lam=0.5))
    out = compute_advantages(traj, cfg)
    # row 0: deltas 0.2, 0.2, 0.4 -> A = 0.4, 0.4, 0.4; row 1: deltas -0.4, -0.1 -> A = -0.45, -0.1
    raw = torch.tensor([0.4, 0.4, 0.4, -0.45, -0.1])
    torch.testing.assert_close(out.returns, torch.tensor([[0.6, 0.8, 1.0], [0.05, 0.0, 0.0]]), rtol=0, atol=1e-6)
    whitened = (raw - 0.13) / raw.std()  # batch mean 0.13, unbiased std
    torch.testing.assert_close(out.advantages[mask.bool()], whitened, rtol=0, atol=1e-5)
    assert out.advantages[1, 2].item() == 0.0
    assert out.advantages[mask.bool()].mean().item() == pytest.approx(0.0, abs=1e-6)


def test_gae_config_rules():
    RLConfig(algorithm="gae", n_samples=1)  # PPO needs no groups
    with pytest.raises(ValueError, match="n_samples"):
        RLConfig(algorithm="grpo", n_samples=1)
    with pytest.raises(ValueError, match="rl.critic.warmup_steps"):
        RLConfig(algorithm="gae", steps=3, critic=CriticConfig(warmup_steps=3))
    with pytest.raises(ValueError, match="rl.dynamic_sampling.enabled drops groups"):
        RLConfig(algorithm="gae", n_samples=4, dynamic_sampling={"enabled": True})
    with pytest.raises(ValueError, match="n_samples 1"):
        RLConfig(algorithm="reinforce_plus_plus", n_samples=1, dynamic_sampling={"enabled": True})
    # the critic warm-up updates no policy: the policy's schedule and version count the rest
    cfg = RLConfig(algorithm="gae", steps=10, critic=CriticConfig(warmup_steps=4))
    assert [cfg.policy_updates(s) for s in (0, 3, 4, 5, 10)] == [0, 0, 0, 1, 6]
    assert RLConfig(steps=10, critic=CriticConfig(warmup_steps=4)).policy_updates(10) == 10  # grpo: no critic
