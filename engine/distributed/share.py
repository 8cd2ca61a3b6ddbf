"""A data-parallel rank's share of a global batch's micro-batches (the sft, rm and po stages).

Every rank forms the same micro-batches of a step (the same deterministic sampler and
batching, from the same seed) and back-propagates every ``k``-th of them, starting at its
data-parallel rank: rank ``r`` of ``k`` takes ``micro[r::k]``.
``engine.training.optimizer_step.accumulate_gradients`` then sums the ranks' gradients and
normalises by the whole batch's loss units, so the step is DP=1's step up to float rounding.
In a single process the share is the whole list (the same list object), so DP=1 training is
unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch.distributed as dist

from engine.distributed.collectives import data_parallel_group, data_parallel_rank

T = TypeVar("T")


def data_parallel_size() -> int:
    """Ranks of this process's data-parallel group (1 in a single process)."""
    group = data_parallel_group()
    return 1 if group is None else dist.get_world_size(group)


def micro_batch_share(micro_batches: Sequence[T], section: str) -> Sequence[T]:
    """This rank's micro-batches of one step: ``micro_batches[r::k]`` for data-parallel rank
    ``r`` of ``k``; ``micro_batches`` itself when ``k == 1``.

    Args:
        micro_batches: the step's micro-batches, identical on every rank.
        section: the stage's config section (``"sft"`` or ``"rm"``), for the error message.

    Raises:
        ValueError: fewer micro-batches than ranks (a token budget can form fewer micro-batches
            than ``<section>.parallel.data_parallel_size``; a rank without one would have
            nothing to back-propagate). Every rank raises it for the same step, so none is left
            waiting in a collective.

    A count the ranks cannot share evenly is fine, also under expert parallelism, where the MoE
    layers exchange tokens in every forward: a rank with fewer micro-batches runs padding passes
    (``engine.models.expert_lockstep.lockstep_passes`` in
    ``engine.training.optimizer_step.accumulate_gradients``).
    """
    k = data_parallel_size()
    if k == 1:
        return micro_batches
    if len(micro_batches) < k:
        raise ValueError(
            f"{section}.parallel.data_parallel_size={k}: this step formed only {len(micro_batches)} micro-batches "
            f"({section}.max_tokens_per_micro_batch), fewer than the ranks (every rank needs at least one); lower "
            f"{section}.max_tokens_per_micro_batch, raise {section}.global_batch_size or use fewer ranks"
        )
    return micro_batches[data_parallel_rank() :: k]
