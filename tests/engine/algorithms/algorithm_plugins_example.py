"""Algorithm plug-ins as a user writes them (``rl.algorithm`` / ``rl.policy_loss``
``tests.engine.algorithms.algorithm_plugins_example:<function>``): GRPO advantages and the
PPO clipped loss, each computed by a different formula path than the built-ins, so a test
can compare them with ``grpo_advantages`` and ``ppo_clip_loss``."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from engine.algorithms.aggregation import aggregate_loss, masked_mean
from engine.algorithms.policy_loss import PolicyLossOutput


def grpo_by_hand(rewards, group_index, mask=None, **options):
    """GRPO outcome advantages in plain Python: per group, ``(r - mean) / (std + 1e-6)``
    with the Bessel-corrected std, 0 for a group of one; broadcast over the mask."""
    scores = rewards.double() if rewards.dim() == 1 else (rewards.double() * mask.double()).sum(-1)
    groups = defaultdict(list)
    for i, g in enumerate(group_index.tolist()):
        groups[g].append(i)
    adv = [0.0] * len(scores)
    for members in groups.values():
        values = [float(scores[i]) for i in members]
        if len(values) < 2:
            continue
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        for i, v in zip(members, values):
            adv[i] = (v - mean) / (std + 1e-6)
    out = torch.tensor(adv, dtype=torch.float64)
    return out if mask is None else out[:, None] * mask.double()  # float64: the caller casts


def ppo_clip_by_hand(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    clip_ratio,
    num_tokens=None,
    *,
    clip_ratio_low=None,
    clip_ratio_high=None,
    loss_agg_mode="token-mean",
    norm=None,
    **options,
):
    """The PPO clipped surrogate in the paper's form ``-min(rho A, clip(rho) A)`` (the
    built-in takes ``max(-rho A, -clip(rho) A)``); dual-clip and TIS are not supported."""
    if options.get("clip_ratio_c") is not None or options.get("tis_cap") is not None:
        raise ValueError("ppo_clip_by_hand has no dual-clip or TIS")
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    ratio = torch.exp(logprobs - old_logprobs)
    surrogate = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - low, 1.0 + high) * advantages
    loss = -torch.minimum(surrogate, clipped)
    m = mask.to(loss.dtype)
    with torch.no_grad():
        clipfrac = masked_mean((clipped < surrogate).to(m.dtype), m)
        kl = masked_mean(old_logprobs - logprobs.detach(), m)
    return PolicyLossOutput(aggregate_loss(loss, m, loss_agg_mode, norm), clipfrac, kl, torch.zeros(()))


def takes_nothing():
    """Callable, but with no parameters (a wrong signature for either plug-in point)."""
    return None


NOT_A_FUNCTION = 3


def wrong_shape(rewards, group_index, mask=None):
    """Returns ``[B]`` even with a mask (the contract asks for ``[B, L]``)."""
    return torch.zeros(rewards.shape[0])


def returns_a_float(logprobs, old_logprobs, advantages, mask, clip_ratio, **options):
    """Returns a float instead of a PolicyLossOutput."""
    return 0.0
