"""GRPO advantages, PPO clipped loss, k3 KL and entropy against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from engine.algorithms.advantages import get_advantage_estimator, grpo_advantages
from engine.algorithms.aggregation import masked_mean
from engine.algorithms.kl import kl_k3
from engine.algorithms.logits import entropy_from_logits, logprobs_from_logits
from engine.algorithms.policy_loss import get_policy_loss, ppo_clip_loss


def test_grpo_advantages_hand_computed():
    # group 7: [1, 0] -> mean 0.5, unbiased std sqrt(0.5); group 3: [1, 2, 3] -> mean 2, std 1.
    rewards = torch.tensor([1.0, 1.0, 0.0, 2.0, 3.0])
    groups = torch.tensor([7, 3, 7, 3, 3])
    adv = grpo_advantages(rewards, groups, eps=0.0)
    s = 0.5 / math.sqrt(0.5)
    torch.testing.assert_close(adv, torch.tensor([s, -1.0, -s, 0.0, 1.0]), rtol=0, atol=1e-6)
    # the default eps shrinks them by 1/(std + 1e-6)
    adv_eps = grpo_advantages(rewards.double(), groups)
    assert adv_eps.dtype == torch.float64
    assert adv_eps[4].item() == pytest.approx(1.0 / (1.0 + 1e-6), abs=1e-9)


def test_grpo_degenerate_groups_are_zero_and_finite():
    rewards = torch.tensor([5.0, 2.0, 2.0, 2.0, 0.0, 1.0])
    groups = torch.tensor([0, 1, 1, 1, 2, 2])  # size-1 group, all-equal group, normal group
    adv = grpo_advantages(rewards, groups)
    assert torch.isfinite(adv).all()
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert adv[4].item() == pytest.approx(-math.sqrt(0.5), abs=1e-5)


def test_grpo_rejects_bad_input():
    with pytest.raises(ValueError, match="same length"):
        grpo_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="finite"):
        grpo_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))


def test_registries():
    assert get_advantage_estimator("grpo") is grpo_advantages
    assert get_policy_loss("ppo_clip") is ppo_clip_loss
    with pytest.raises(KeyError, match="unknown advantage estimator 'ppo'; known: .*'grpo'"):
        get_advantage_estimator("ppo")
    with pytest.raises(KeyError, match="known: \\['gspo', 'ppo_clip'\\]"):
        get_policy_loss("dpo")


def _ppo_case():
    ratios = torch.tensor([[1.5, 0.5, 1.1], [0.9, 0.5, 3.0]])
    old = torch.full_like(ratios, -1.0)
    new = (old + ratios.log()).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0], [-1.0, -1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return new, old, adv, mask


def test_ppo_clip_loss_hand_computed():
    new, old, adv, mask = _ppo_case()
    out = ppo_clip_loss(new, old, adv, mask, clip_ratio=0.2)
    # per token max(-A r, -A clip(r)): 1.5,A=1 -> -1.2 (clipped); 0.5,A=1 -> -0.5;
    # 1.1,A=-1 -> 1.1; 0.9,A=-1 -> 0.9; 0.5,A=-1 -> 0.8 (clipped); last token masked.
    assert out.pg_loss.item() == pytest.approx((-1.2 - 0.5 + 1.1 + 0.9 + 0.8) / 5, abs=1e-6)
    assert out.pg_clipfrac.item() == pytest.approx(2 / 5, abs=1e-7)
    log_sum = math.log(1.5) + math.log(0.5) + math.log(1.1) + math.log(0.9) + math.log(0.5)
    assert out.ppo_kl.item() == pytest.approx(-log_sum / 5, abs=1e-6)
    out.pg_loss.backward()
    # d/dlogp of -A r is -A r where unclipped is active; 0 where the clip is active or masked.
    expected = torch.tensor([[0.0, -0.5, 1.1], [0.9, 0.0, 0.0]]) / 5
    torch.testing.assert_close(new.grad, expected, rtol=0, atol=1e-6)


def test_ppo_micro_batches_sum_to_global_token_mean():
    new, old, adv, mask = _ppo_case()
    full = ppo_clip_loss(new, old, adv, mask).pg_loss
    total = mask.sum()
    parts = sum(
        ppo_clip_loss(new[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], num_tokens=total).pg_loss
        for i in range(2)
    )
    assert parts.item() == pytest.approx(full.item(), abs=1e-7)


def test_kl_k3_value_and_unbiased():
    assert kl_k3(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])).item() == pytest.approx(
        0.5 - 1 + math.log(2), abs=1e-7
    )
    # E_{x~policy}[k3(x)] equals KL(policy || reference) exactly for a categorical.
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    p = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    expectation = (q * kl_k3(q.log(), p.log())).sum()
    assert expectation.item() == pytest.approx((q * (q / p).log()).sum().item(), abs=1e-12)
    assert (kl_k3(q.log(), p.log()) >= 0).all()


def test_entropy_and_logprobs_from_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]]])
    h = entropy_from_logits(logits)
    assert h[0, 0].item() == pytest.approx(math.log(4), abs=1e-6)
    assert h[0, 1].item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)
    lp = logprobs_from_logits(logits, torch.tensor([[2, 1]]))
    torch.testing.assert_close(lp, torch.tensor([[math.log(0.25), math.log(0.75)]]), rtol=0, atol=1e-6)


def test_masked_mean_empty_mask_is_zero():
    assert masked_mean(torch.ones(2, 3), torch.zeros(2, 3)).item() == 0.0
