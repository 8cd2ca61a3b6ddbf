"""Reducing a per-token loss ``[B, L]`` to the scalar that is back-propagated.

Every mode is written as a *sum* over the rows of the batch divided by normalisers that
belong to the global batch (:class:`GlobalNorm`). Given the global batch's normalisers, the
losses of its micro-batches therefore add up to the loss of the whole batch, and so do their
gradients, however the batch was split and however each micro-batch was padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1. Shapes: both ``[B, L]``; returns a scalar."""
    return (values * mask).sum()


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, num_tokens: float | torch.Tensor | None = None
) -> torch.Tensor:
    """Token-mean of ``values`` over ``mask``.

    Args:
        values, mask: ``[B, L]``.
        num_tokens: the normaliser; defaults to ``mask.sum()``. Pass the token count of the
            whole global batch when ``values`` is one micro-batch of it, so that summing the
            micro-batch results gives the global token-mean.

    Returns: scalar. The normaliser is clamped to >= 1, so an all-zero mask gives 0, not NaN.
    """
    denom = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=values.dtype)
    return masked_sum(values, mask) / torch.clamp(denom, min=1.0)


@dataclass(frozen=True)
class GlobalNorm:
    """Normalisers of one global batch (the batch of one optimizer step), as plain numbers.

    num_tokens: response tokens in the global batch (``mask.sum()``).
    num_seqs: sequences with at least one response token.
    max_response_length: the constant ``C`` of ``seq-mean-token-sum-norm``; use the
        configured maximum response length (Dr.GRPO) so it does not depend on padding.
    """

    num_tokens: float
    num_seqs: float
    max_response_length: float


def global_norm(masks: torch.Tensor | Sequence[torch.Tensor], max_response_length: int | None = None) -> GlobalNorm:
    """The :class:`GlobalNorm` of a global batch, from its mask or its micro-batches' masks.

    Args:
        masks: one ``[B, L]`` mask, or a list of micro-batch masks ``[B_i, L_i]`` (the
            ``L_i`` may differ).
        max_response_length: ``C`` for ``seq-mean-token-sum-norm``; default the largest ``L_i``.
            Pass the configured generation limit when micro-batches are padded
            independently, otherwise ``C`` depends on how the batch was padded.

    Raises: ValueError if ``masks`` is an empty list.
    """
    masks = [masks] if isinstance(masks, torch.Tensor) else list(masks)
    if not masks:
        raise ValueError("global_norm needs at least one mask")
    num_tokens = sum(float(m.sum()) for m in masks)
    num_seqs = sum(float((m.sum(-1) > 0).sum()) for m in masks)
    length = max(m.size(-1) for m in masks) if max_response_length is None else max_response_length
    return GlobalNorm(num_tokens=num_tokens, num_seqs=num_seqs, max_response_length=float(length))


def aggregate_loss(
    loss_mat: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str = "token-mean", norm: GlobalNorm | None = None
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar; micro-batch invariant given the global ``norm``.

    With ``m`` the mask, ``n_b = sum_t m_bt`` the length of row ``b``, ``N`` = ``norm.num_tokens``,
    ``S`` = ``norm.num_seqs`` and ``C`` = ``norm.max_response_length``:

    - ``token-mean``: ``sum_bt m_bt l_bt / N`` (DAPO, Yu et al. 2025, arXiv:2503.14476);
    - ``seq-mean-token-sum``: ``sum_b (sum_t m_bt l_bt) / S``;
    - ``seq-mean-token-mean``: ``sum_b (sum_t m_bt l_bt / n_b) / S`` (original GRPO,
      Shao et al. 2024);
    - ``seq-mean-token-sum-norm``: ``sum_b (sum_t m_bt l_bt / C) / S`` (Dr.GRPO, Liu et al.
      2025, arXiv:2503.20783: a constant instead of the per-sequence length).

    Mode names follow verl's ``agg_loss`` (``verl/trainer/ppo/core_algos.py``).
    ``N`` and ``S`` are clamped to >= 1 and ``n_b`` too, so empty masks give 0, not NaN.

    Args:
        loss_mat: ``[B, L]`` per-token loss (any float dtype, with grad).
        mask: ``[B, L]`` response mask (bool, int or float).
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.
        norm: the global batch's normalisers (:func:`global_norm`); default: this batch's own,
            i.e. ``loss_mat`` is the whole batch.

    Returns: scalar tensor. For a micro-batch of a global batch, pass the global ``norm``;
        then the sum over micro-batches is the global loss and nothing must be divided later.

    Raises: ValueError on an unknown mode or mismatched shapes.
    """
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} must have the same shape")
    norm = global_norm(mask) if norm is None else norm
    mask = mask.to(loss_mat.dtype)
    row_sums = (loss_mat * mask).sum(-1)  # [B]
    seqs = max(norm.num_seqs, 1.0)
    if loss_agg_mode == "token-mean":
        return row_sums.sum() / max(norm.num_tokens, 1.0)
    if loss_agg_mode == "seq-mean-token-sum":
        return row_sums.sum() / seqs
    if loss_agg_mode == "seq-mean-token-mean":
        return (row_sums / mask.sum(-1).clamp(min=1.0)).sum() / seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return row_sums.sum() / (norm.max_response_length * seqs)
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; known: {list(LOSS_AGG_MODES)}")
