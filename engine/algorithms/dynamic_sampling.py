"""DAPO dynamic sampling: drop prompt groups whose responses all got the same reward.

Such a group has zero advantage under GRPO-style estimators (no learning signal) but still
takes part in the loss normalisers; DAPO over-samples and keeps only informative groups until
the batch is full. Source: Yu et al. 2025, "DAPO", arXiv:2503.14476, section 3.2 (eq. 11);
verl ``filter_groups`` in ``recipe/dapo``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


def informative_group_mask(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Which responses belong to a group worth keeping: ``std_g(r) > 0``.

    A group is dropped when all its rewards are exactly equal (``max == min``), which
    includes groups of a single response.

    Args: ``rewards`` ``[B]`` float, ``group_index`` ``[B]`` int (any ids).

    Returns: BoolTensor ``[B]``, True for responses of kept groups (filter a batch with it;
        ``group_index[mask].unique()`` are the kept groups).

    Raises: ValueError unless both are 1-D of the same length.
    """
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} must be 1-D, same length"
        )
    _, inverse = torch.unique(group_index, return_inverse=True)
    n = int(inverse.max()) + 1 if len(inverse) else 0
    r = rewards.double()
    hi = torch.full((n,), -torch.inf, dtype=r.dtype).scatter_reduce(0, inverse, r, "amax")
    lo = torch.full((n,), torch.inf, dtype=r.dtype).scatter_reduce(0, inverse, r, "amin")
    return (hi > lo)[inverse]


def _default_rewards(group: Any) -> Sequence[float]:
    return group.rewards if hasattr(group, "rewards") else group


@dataclass(frozen=True)
class FilledBatch:
    """What :func:`fill_batch` gathered.

    groups: the kept groups, at most ``target_groups``, in generation order.
    rounds: generation rounds used.
    num_generated, num_dropped: groups generated in total / dropped as uninformative.
    """

    groups: list
    rounds: int
    num_generated: int
    num_dropped: int


def fill_batch(
    generate_round: Callable[[], Sequence[Any]],
    target_groups: int,
    max_rounds: int,
    *,
    strict: bool = True,
    rewards_of: Callable[[Any], Sequence[float]] = _default_rewards,
) -> FilledBatch:
    """Generate rounds of groups until ``target_groups`` informative ones are kept (DAPO).

    Each round calls ``generate_round()`` (a list of groups, already scored), drops groups
    whose rewards are all equal and keeps the rest; once ``target_groups`` are kept, the
    extras of the last round are discarded and the batch is returned.

    Args:
        generate_round: produces one round of groups.
        target_groups: groups wanted (>= 1).
        max_rounds: most rounds to try (>= 1).
        strict: what happens when ``max_rounds`` rounds still leave the batch short: True
            raises RuntimeError; False warns (RuntimeWarning) and returns the groups kept so
            far (possibly none).
        rewards_of: a group's rewards; default ``group.rewards`` if it has that attribute,
            else the group itself (a sequence of floats).

    Returns: :class:`FilledBatch`.

    Raises:
        ValueError: ``target_groups`` or ``max_rounds`` below 1.
        RuntimeError: ``strict`` and the batch is still short after ``max_rounds`` rounds.
    """
    if target_groups < 1 or max_rounds < 1:
        raise ValueError(f"target_groups={target_groups} and max_rounds={max_rounds} must be >= 1")
    kept: list = []
    generated = 0
    for rounds in range(1, max_rounds + 1):
        groups = list(generate_round())
        generated += len(groups)
        kept += [g for g in groups if len(set(map(float, rewards_of(g)))) > 1]
        if len(kept) >= target_groups:
            return FilledBatch(kept[:target_groups], rounds, generated, generated - len(kept))
    message = (
        f"dynamic sampling: only {len(kept)} of {target_groups} groups have differing rewards after "
        f"{max_rounds} rounds ({generated} groups generated); raise max_rounds or check the reward"
    )
    if strict:
        raise RuntimeError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    return FilledBatch(kept, max_rounds, generated, generated - len(kept))
