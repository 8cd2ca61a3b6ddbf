"""Expert-parallel lock-step: every rank of an expert-model-parallel group runs the same forwards.

Under expert parallelism (``<section>.parallel.expert_model_parallel_size`` N > 1) megatron's
all-gather token dispatcher (``MoEAllGatherTokenDispatcher.token_dispatch``) gathers every rank's
``[tokens, H]`` activations with one equal-size all-gather over the expert group, in every MoE
layer's forward, and reduce-scatters them in its backward. So every rank of the group must run

* the same number of forwards (and backwards) in a pass: a rank short of micro-batches runs
  padding forwards whose outputs are discarded (:func:`lockstep_padding`, :func:`lockstep_passes`);
* forwards of the same number of tokens: each forward's input is padded to the group's largest
  shape (:func:`lockstep_shape`; causal attention keeps the real positions' outputs unchanged,
  and the extra rows and columns are cut off the logits or hidden states; every forward of
  ``engine.models.megatron`` does it).

Megatron-LM keeps both equal by construction (a fixed ``[micro_batch_size, seq_length]`` and the
same ``num_microbatches`` on every data-parallel rank); verl's dynamic batching all-reduces the
micro-batch count (MAX) over the data-parallel group (``rearrange_micro_batches``). Here the RL
batch is split by rows (``engine.distributed.group.shard_rows``), so a rank may hold fewer rows
than its peer has micro-batches, and splitting into the maximum count is not always possible:
hence padding forwards. Without expert parallelism (or in a single process) both functions are
the identity and run no collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from engine.batching.packing import PackedSequences

T = TypeVar("T")


def expert_group():
    """Megatron's expert-model-parallel process group of this rank, or None when its size is 1
    (or there is no process group or megatron state)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_expert_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_expert_model_parallel_group()


def _max_over_group(values: Sequence[int]) -> list[int]:
    group = expert_group()
    if group is None:
        return [int(v) for v in values]
    t = torch.tensor([int(v) for v in values], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


def lockstep_padding(count: int) -> int:
    """Padding forwards this rank adds to its ``count`` micro-batches of a pass so that every
    rank of its expert group runs as many: ``max(count over the group) - count`` (0 without
    expert parallelism). A collective of the expert group: every rank calls it once per pass,
    before the pass's first forward."""
    return _max_over_group([count])[0] - int(count)


def lockstep_passes(micro_batches: Sequence[T]) -> list[tuple[T, bool]]:
    """The passes this rank runs over ``micro_batches`` so that every rank of its expert group
    runs as many: ``(micro_batch, True)`` for each micro-batch, then :func:`lockstep_padding`'s
    padding passes as ``(micro_batches[0], False)``, whose results the caller discards (and, in
    an update, back-propagates times 0). Without expert parallelism: every micro-batch, real.
    A collective of the expert group, run when called: call it before the pass's first forward.

    Raises: ValueError for an empty ``micro_batches`` (a padding pass needs a micro-batch to repeat).
    """
    if len(micro_batches) == 0:
        raise ValueError("lockstep_passes: no micro-batches (every rank of a pass needs at least one)")
    padding = lockstep_padding(len(micro_batches))
    return [(mb, True) for mb in micro_batches] + [(micro_batches[0], False)] * padding


def lockstep_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` (e.g. ``[B, T]`` of a forward's ``input_ids``, or ``[N]`` packed tokens) raised
    dimension by dimension to the maximum over this rank's expert group; ``shape`` itself without
    expert parallelism. A collective of the expert group: every rank calls it once per forward."""
    return tuple(_max_over_group(shape))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_ids(input_ids: torch.Tensor, multiple: int = 1) -> torch.Tensor:
    """``input_ids`` ``[B, T]`` right- and bottom-padded with token 0 to :func:`lockstep_shape`,
    its ``T`` rounded up to a multiple of ``multiple`` (sequence parallelism: the tensor-parallel
    size, ``engine.models.sequence_parallel``); itself when already that shape. Causal attention:
    the real positions' logits do not change (up to float rounding); cut the result back with
    ``[:B, :T]``."""
    b, t = input_ids.shape
    mb, mt = lockstep_shape((b, t))
    mt = _round_up(mt, multiple)
    if (mb, mt) == (b, t):
        return input_ids
    return torch.nn.functional.pad(input_ids, (0, mt - t, 0, mb - b), value=0)


def pad_packed(packed: PackedSequences, multiple: int = 1) -> PackedSequences:
    """``packed`` (``input_ids [1, N]``) with one more sequence of token 0 appended so that its
    ``N`` is :func:`lockstep_shape`'s rounded up to a multiple of ``multiple`` (as in
    :func:`pad_ids`); itself when already that length. The appended sequence attends only to
    itself (its own ``cu_seqlens`` segment), so the real sequences' logits do not change; cut the
    result back with ``[:N]``."""
    n = packed.num_tokens
    (m,) = lockstep_shape((n,))
    m = _round_up(m, multiple)
    if m == n:
        return packed
    extra = m - n
    ids = packed.input_ids
    return dataclasses.replace(
        packed,
        input_ids=torch.cat([ids, ids.new_zeros((1, extra))], dim=1),
        position_ids=torch.cat([packed.position_ids, torch.arange(extra, device=ids.device)[None, :]], dim=1),
        cu_seqlens=torch.cat([packed.cu_seqlens, packed.cu_seqlens.new_tensor([m])]),
        max_seqlen=max(packed.max_seqlen, extra),
    )
