"""RL algorithms as pure tensor functions behind small string registries.

Shapes: ``B`` sequences (prompt x sample), ``L`` response tokens (right-padded),
``V`` vocabulary. ``mask`` is ``[B, L]`` with 1 for real response tokens, 0 for padding.
Log-probabilities are natural logs (nats).

Registries: :data:`ADVANTAGE_ESTIMATORS` (``"grpo"``) and :data:`POLICY_LOSSES`
(``"ppo_clip"``); look them up with :func:`get_advantage_estimator` /
:func:`get_policy_loss`, which name the known keys when a name is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1. Shapes: both ``[B, L]``; returns a scalar."""
    return (values * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens: float | torch.Tensor | None = None) -> torch.Tensor:
    """Token-mean of ``values`` over ``mask``.

    Args:
        values, mask: ``[B, L]``.
        num_tokens: the normaliser; defaults to ``mask.sum()``. Pass the token count of the
            whole global batch when ``values`` is one micro-batch of it, so that summing the
            micro-batch results gives the global token-mean (gradient accumulation that
            does not depend on how the batch was split).

    Returns: scalar. An all-zero mask with no ``num_tokens`` gives 0 (not NaN).
    """
    denom = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=values.dtype)
    return masked_sum(values, mask) / torch.clamp(denom, min=1.0)


# ----------------------------------------------------------------------------- advantages


def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantages: each reward normalised within its prompt's group.

    ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` where ``g`` is the group (all samples
    of the same prompt) that ``i`` belongs to and ``std`` is the unbiased (Bessel-corrected)
    sample standard deviation, as in TRL's and verl's GRPO.
    Source: Shao et al. 2024, "DeepSeekMath", section 4.1.2 (outcome supervision).

    Degenerate groups are defined, and always finite:
    - a group of size 1 has no spread to compare against: advantage 0;
    - a group whose rewards are all equal: numerator 0, so advantage 0.

    Args:
        rewards: ``[B]`` float, one scalar reward per response.
        group_index: ``[B]`` int, the prompt (group) id of each response; any integers.
        eps: added to the standard deviation.

    Returns: ``[B]`` float advantages (same dtype as ``rewards``). Broadcast to tokens with
        ``advantages[:, None] * mask``.

    Raises:
        ValueError: ``rewards`` and ``group_index`` are not 1-D of the same length, or a
            reward is not finite.
    """
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} must be 1-D, same length")
    if not torch.isfinite(rewards).all():
        raise ValueError(f"rewards must be finite, got {rewards.tolist()}")
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    r = rewards.double()
    sums = torch.zeros(len(counts), dtype=r.dtype).index_add_(0, inverse, r)
    mean = sums / counts
    centered = r - mean[inverse]
    sq = torch.zeros(len(counts), dtype=r.dtype).index_add_(0, inverse, centered**2)
    std = torch.sqrt(sq / torch.clamp(counts - 1, min=1))
    adv = centered / (std[inverse] + eps)
    adv = torch.where(counts[inverse] > 1, adv, torch.zeros_like(adv))
    return adv.to(rewards.dtype)


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {"grpo": grpo_advantages}


def get_advantage_estimator(name: str) -> Callable[..., torch.Tensor]:
    """The advantage function registered as ``name``. Raises KeyError listing the known names."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise KeyError(f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


# ----------------------------------------------------------------------------- losses


@dataclass(frozen=True)
class PolicyLossOutput:
    """Scalars of one policy-loss evaluation.

    pg_loss: the loss to minimise (differentiable).
    pg_clipfrac: fraction of tokens where the clipped term was the active one (detached).
    ppo_kl: token-mean of ``old_logprob - logprob``, the k1 estimate of KL(old || new) (detached).
    """

    pg_loss: torch.Tensor
    pg_clipfrac: torch.Tensor
    ppo_kl: torch.Tensor


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio: float = 0.2,
    num_tokens: float | torch.Tensor | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate objective, token-mean aggregated.

    ``rho = exp(logprob - old_logprob)``;
    ``loss_t = max(-A_t * rho_t, -A_t * clip(rho_t, 1 - clip_ratio, 1 + clip_ratio))``;
    ``pg_loss = sum_t mask_t * loss_t / num_tokens``.
    Source: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7
    (negated to a loss); token-mean aggregation as in DAPO (Yu et al. 2025) and verl's
    ``agg_loss(loss_agg_mode="token-mean")``.

    Args:
        logprobs: ``[B, L]`` current policy log-probs of the sampled tokens (with grad).
        old_logprobs: ``[B, L]`` log-probs of the policy that generated the batch.
        advantages: ``[B, L]`` per-token advantages (GRPO: the sequence advantage broadcast).
        mask: ``[B, L]`` response mask.
        clip_ratio: epsilon of the clip range.
        num_tokens: normaliser (see :func:`masked_mean`); default ``mask.sum()``.

    Returns: :class:`PolicyLossOutput`. ``pg_clipfrac`` and ``ppo_kl`` are always plain
        token-means over ``mask`` (diagnostics, not summed over micro-batches).
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    pg_loss = masked_mean(torch.maximum(unclipped, clipped), mask, num_tokens)
    with torch.no_grad():
        pg_clipfrac = masked_mean((clipped > unclipped).to(logprobs.dtype), mask)
        ppo_kl = masked_mean(-log_ratio, mask)
    return PolicyLossOutput(pg_loss=pg_loss, pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl)


POLICY_LOSSES: dict[str, Callable[..., PolicyLossOutput]] = {"ppo_clip": ppo_clip_loss}


def get_policy_loss(name: str) -> Callable[..., PolicyLossOutput]:
    """The policy loss registered as ``name``. Raises KeyError listing the known names."""
    if name not in POLICY_LOSSES:
        raise KeyError(f"unknown policy loss {name!r}; known: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference), for tokens sampled from the policy.

    With ``log r = ref_logprob - logprob``: ``k3 = exp(log r) - 1 - log r``, which is >= 0,
    unbiased for KL(policy || reference), and lower-variance than ``-log r``.
    Source: Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html);
    used as the GRPO KL term in Shao et al. 2024, eq. 4.

    Args: both ``[B, L]``. Returns: ``[B, L]`` (aggregate with :func:`masked_mean`).
    The log-ratio is clamped to [-20, 20] so a far-off token gives a large finite value
    instead of ``inf``.
    """
    log_r = torch.clamp(ref_logprobs - logprobs, min=-20.0, max=20.0)
    return torch.exp(log_r) - 1.0 - log_r


# ----------------------------------------------------------------------------- logits


def logprobs_from_logits(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each given token under ``softmax(logits)``.

    Args:
        logits: ``[B, L, V]`` (the logits that predict position ``t`` of ``token_ids``).
        token_ids: ``[B, L]`` int.

    Returns: ``[B, L]`` ``log_softmax(logits)[b, t, token_ids[b, t]]``, in float32 or wider.
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    picked = torch.gather(logits, -1, token_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per position, in nats.

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v`` (equal to ``-sum p log p``, without
    forming ``log p``). Args: ``logits`` ``[..., V]``. Returns: ``[...]``.
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)
