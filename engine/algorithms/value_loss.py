"""The critic's loss for PPO: the clipped value loss.

Shapes: ``B`` responses, ``L`` response tokens; ``mask`` ``[B, L]`` is the loss mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.algorithms.aggregation import GlobalNorm, aggregate_loss, masked_sum


@dataclass(frozen=True)
class ValueLossOutput:
    """Result of :func:`clipped_value_loss`.

    Attributes:
        vf_loss: scalar tensor with grad, already aggregated (``loss_agg_mode`` with ``norm``).
        vf_clipfrac: scalar tensor, the fraction of mask tokens where the clipped error is the
            larger one (the clip is active), over this batch's tokens.
    """

    vf_loss: torch.Tensor
    vf_clipfrac: torch.Tensor


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    norm: GlobalNorm | None = None,
) -> ValueLossOutput:
    """PPO's clipped value loss.

    ``V_clip = V_old + clamp(V - V_old, -c, c)``;
    ``loss_t = 0.5 * max((V_t - R_t)^2, (V_clip_t - R_t)^2)``, aggregated over the mask tokens
    with ``loss_agg_mode`` (:func:`engine.algorithms.aggregation.aggregate_loss`). The clip
    keeps one update from moving a value estimate further than ``c`` from the one that produced
    the advantages. Sources: OpenAI baselines PPO2 (``ppo2/model.py``, ``vf_losses``); verl
    ``compute_value_loss`` (``verl/trainer/ppo/core_algos.py``), whose default ``c`` is 0.5.

    Args:
        values: ``[B, L]`` the critic's current predictions (with grad).
        old_values: ``[B, L]`` the predictions before this step's updates (no grad).
        returns: ``[B, L]`` the targets, ``A + V_old`` from
            :func:`engine.algorithms.advantages.compute_gae`.
        mask: ``[B, L]`` loss mask.
        cliprange_value: ``c > 0``, in the units of the reward.
        loss_agg_mode, norm: as for :func:`engine.algorithms.aggregation.aggregate_loss`.

    Returns: :class:`ValueLossOutput`.

    Raises: ValueError when the shapes differ or ``cliprange_value <= 0``.
    """
    if not (values.shape == old_values.shape == returns.shape == mask.shape) or values.dim() != 2:
        raise ValueError(
            f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, returns "
            f"{tuple(returns.shape)} and mask {tuple(mask.shape)} must all be [B, L]"
        )
    if not cliprange_value > 0:
        raise ValueError(f"cliprange_value must be > 0, got {cliprange_value}")
    old_values, returns = old_values.detach(), returns.detach()
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_err = (values - returns) ** 2
    clipped_err = (clipped - returns) ** 2
    loss = 0.5 * aggregate_loss(torch.maximum(unclipped_err, clipped_err), mask, loss_agg_mode, norm)
    m = mask.to(values.dtype)
    clipfrac = masked_sum((clipped_err > unclipped_err).to(values.dtype).detach(), m) / m.sum().clamp(min=1.0)
    return ValueLossOutput(loss, clipfrac)
