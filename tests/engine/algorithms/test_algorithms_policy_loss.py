"""PPO clip-higher / dual-clip / TIS and GSPO against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from engine.algorithms.policy_loss import entropy_bonus, get_policy_loss, gspo_loss, ppo_clip_loss, truncated_is_weight


def _logprobs_for(ratios, old=-1.0, dtype=torch.float64):
    """A leaf ``logprobs`` with ``exp(logprobs - old) == ratios``."""
    ratios = torch.tensor(ratios, dtype=dtype)
    old_lp = torch.full_like(ratios, old)
    return (old_lp + ratios.log()).requires_grad_(True), old_lp


def test_clip_higher_asymmetric_range():
    new, old = _logprobs_for([[1.25, 0.75, 1.35]])
    adv = torch.tensor([[1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    out = ppo_clip_loss(new, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    # 1.25 < 1.28: not clipped -> -1.25; 0.75 < 0.8 with A < 0: clipped -> 0.8; 1.35 > 1.28 -> -1.28
    assert out.pg_loss.item() == pytest.approx((-1.25 + 0.8 - 1.28) / 3, abs=1e-12)
    assert out.pg_clipfrac.item() == pytest.approx(2 / 3)
    # the symmetric default clips the first token too: -1.2
    sym = ppo_clip_loss(new, old, adv, mask, clip_ratio=0.2)
    assert sym.pg_loss.item() == pytest.approx((-1.2 + 0.8 - 1.2) / 3, abs=1e-12)


def test_dual_clip_hand_computed():
    new, old = _logprobs_for([[5.0, 2.0, 5.0, 0.5]])
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    out = ppo_clip_loss(new, old, adv, torch.ones(1, 4), clip_ratio=0.2, clip_ratio_c=3.0)
    # r=5, A=-1: max(5, 1.2) = 5, capped by -A c = 3 -> 3   (lower clip active)
    # r=2, A=-1: max(2, 1.2) = 2 < 3                      -> 2
    # r=5, A=+1: max(-5, -1.2) = -1.2, no dual-clip for A > 0
    # r=0.5, A=-1: max(0.5, 0.8) = 0.8 < 3                 -> 0.8
    assert out.pg_loss.item() == pytest.approx((3.0 + 2.0 - 1.2 + 0.8) / 4, abs=1e-12)
    assert out.pg_clipfrac.item() == pytest.approx(2 / 4)
    assert out.pg_clipfrac_lower.item() == pytest.approx(1 / 4)
    out.pg_loss.backward()
    # only the r=2 token is on the unclipped branch: d(-A r)/dlogp = -A r = 2, over 4 tokens
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, 0.5, 0.0, 0.0]], dtype=torch.float64))
    assert ppo_clip_loss(new, old, adv, torch.ones(1, 4)).pg_clipfrac_lower.item() == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        ppo_clip_loss(new, old, adv, torch.ones(1, 4), clip_ratio_c=1.0)


def test_truncated_importance_sampling_weights_the_token_loss():
    old = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    rollout = torch.tensor([[-1.5, -3.0]], dtype=torch.float64)
    w = truncated_is_weight(old, rollout, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[math.exp(0.5), 2.0]], dtype=torch.float64))  # exp(2) capped at 2
    new = old.clone().requires_grad_(True)  # ratio 1: per-token loss -A = -1
    adv = torch.ones(1, 2, dtype=torch.float64)
    out = ppo_clip_loss(new, old, adv, torch.ones(1, 2), rollout_logprobs=rollout, tis_cap=2.0)
    assert out.pg_loss.item() == pytest.approx(-(math.exp(0.5) + 2.0) / 2, abs=1e-12)
    out.pg_loss.backward()
    torch.testing.assert_close(new.grad, -w / 2)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        ppo_clip_loss(new, old, adv, torch.ones(1, 2), tis_cap=2.0)
    with pytest.raises(ValueError, match="tis_cap must be > 0"):
        truncated_is_weight(old, rollout, cap=0.0)


def test_gspo_sequence_ratio_hand_computed():
    old = torch.zeros(2, 3, dtype=torch.float64)
    new = torch.tensor([[0.1, 0.3, 0.0], [-0.4, 0.0, 5.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=torch.float64)
    out = gspo_loss(new, old, adv, mask, clip_ratio=0.2)
    # s_0 = exp(mean(0.1, 0.3)) = exp(0.2) = 1.2214 > 1.2, A > 0 -> clipped: -1.2
    # s_1 = exp(mean(-0.4, 0.0)) = exp(-0.2) = 0.8187 in [0.8, 1.2], A < 0 -> 0.8187
    s1 = math.exp(-0.2)
    assert out.pg_loss.item() == pytest.approx((-1.2 + s1) / 2, abs=1e-12)  # seq-mean-token-mean
    assert out.pg_clipfrac.item() == pytest.approx(2 / 4)  # both tokens of sequence 0
    out.pg_loss.backward()
    # sequence 1 unclipped: d/dlogp_t = -A * s_1 * (1 / n_1) / G = s_1 / 4; padding gets nothing
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, 0.0, 0.0], [s1 / 4, s1 / 4, 0.0]], dtype=torch.float64))


def test_gspo_gradient_equals_the_sequence_level_objective():
    torch.manual_seed(0)
    old = -torch.rand(4, 5, dtype=torch.float64)
    new = (old + 0.3 * torch.randn(4, 5, dtype=torch.float64)).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.float64)
    seq_adv = torch.tensor([1.0, -0.5, 0.3, -2.0], dtype=torch.float64)
    gspo_loss(new, old, seq_adv[:, None].expand(4, 5), mask, clip_ratio=0.1).pg_loss.backward()
    token_form = new.grad.clone()
    # the paper's eq. 5 directly: s_b = exp(mean over the sequence of log-ratios)
    new.grad = None
    s = torch.exp(((new - old) * mask).sum(-1) / mask.sum(-1))
    per_seq = torch.maximum(-seq_adv * s, -seq_adv * s.clamp(0.9, 1.1))
    per_seq.mean().backward()
    torch.testing.assert_close(token_form, new.grad)
    assert token_form.abs().sum() > 0


def test_entropy_bonus_and_registry():
    entropy = torch.tensor([[1.0, 2.0], [3.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert entropy_bonus(entropy, mask, coef=0.1).item() == pytest.approx(-0.1 * 6.0 / 3)
    assert get_policy_loss("gspo") is gspo_loss
    with pytest.raises(KeyError, match="known"):
        get_policy_loss("gpg")


def test_gspo_side_bounds_take_precedence_over_clip_ratio():
    """How the actor calls it: clip_ratio from the config plus rl.clip_ratio_low/high."""
    mask = torch.ones(1, 4)
    old = torch.zeros(1, 4)
    new = torch.full((1, 4), 0.01)  # sequence ratio e^0.01: outside 1 +- 4e-4, inside 1 +- 0.2
    adv = torch.ones(1, 4)
    assert gspo_loss(new, old, adv, mask, 0.2, clip_ratio_low=3e-4, clip_ratio_high=4e-4).pg_clipfrac.item() == 1.0
    assert gspo_loss(new, old, adv, mask, 0.2).pg_clipfrac.item() == 0.0
    assert gspo_loss(new, old, adv, mask).pg_clipfrac.item() == 1.0  # the paper's range by default
