"""Sequence packing: a micro-batch's variable-length sequences laid end to end, no padding.

A right-padded batch ``[B, T]`` spends ``B * T`` token positions on ``sum_b n_b`` real
tokens; with a long-tailed length distribution most of the work is padding. Packing
concatenates the real tokens of every row into one row of ``N = sum_b n_b`` positions (the
"THD" layout: tokens, heads, head dim) described by cumulative sequence lengths
``cu_seqlens = [0, n_0, n_0 + n_1, ..., N]``. Each sequence keeps its own positions
(``0..n_b - 1``, so rotary embeddings see what they see unpacked) and attends only inside
``[cu_seqlens[b], cu_seqlens[b + 1])``: block-diagonal causal attention
(``engine.models.megatron.gpt_logits_packed`` runs megatron-core's GPTModel this way).
Every other layer acts per token, so each packed sequence's logits equal its unpacked ones.

This module only moves tokens and indices; it needs no model. Shapes: ``B`` sequences,
``T`` padded width, ``N`` packed tokens, ``L`` response width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.batching.collate import TokenBatch


def _check_lengths(lengths: torch.Tensor, width: int | None = None) -> torch.Tensor:
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or lengths.numel() == 0:
        raise ValueError(f"packing: lengths must be a non-empty 1-D tensor, got shape {tuple(lengths.shape)}")
    lengths = lengths.long()
    if int(lengths.min()) < 1:
        raise ValueError(f"packing: sequence {int(lengths.argmin())} has length {int(lengths.min())} (need >= 1)")
    if width is not None and int(lengths.max()) > width:
        raise ValueError(
            f"packing: sequence {int(lengths.argmax())} has length {int(lengths.max())} "
            f"but the padded batch is only {width} wide"
        )
    return lengths


def cu_seqlens_of(lengths: torch.Tensor) -> torch.Tensor:
    """Cumulative sequence lengths ``[0, n_0, n_0 + n_1, ..., N]``.

    Args: ``lengths``: integer tensor ``[B]``, every entry >= 1.
    Returns: IntTensor ``[B + 1]`` (int32, the dtype megatron-core's ``PackedSeqParams`` expects).
    Raises: ValueError for an empty or non-1-D ``lengths`` or a length < 1.
    """
    lengths = _check_lengths(lengths)
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)


def packed_position_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Position of every packed token inside its own sequence (restarting at 0 per sequence).

    Args: ``cu_seqlens``: IntTensor ``[B + 1]`` (:func:`cu_seqlens_of`).
    Returns: LongTensor ``[N]``, e.g. ``[0, 1, 2, 0, 1]`` for lengths ``[3, 2]``.
    """
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths)
    return torch.arange(int(cu[-1]), device=cu.device) - starts


@dataclass(frozen=True)
class PackedSequences:
    """Sequences concatenated into one row (THD layout).

    Attributes:
        input_ids: LongTensor ``[1, N]``: sequence 0's tokens, then sequence 1's, ... (no pad).
        position_ids: LongTensor ``[1, N]``: each token's position inside its own sequence.
        cu_seqlens: IntTensor ``[B + 1]`` (int32): sequence ``b`` is ``[cu_seqlens[b], cu_seqlens[b + 1])``.
        max_seqlen: the longest sequence, in tokens.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int

    @property
    def lengths(self) -> torch.Tensor:
        """LongTensor ``[B]``: tokens per sequence."""
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()

    @property
    def num_tokens(self) -> int:
        """``N``, the packed row's length (every token real)."""
        return int(self.cu_seqlens[-1])

    def __len__(self) -> int:
        return self.cu_seqlens.numel() - 1


def pack_sequences(input_ids: torch.Tensor, lengths: torch.Tensor) -> PackedSequences:
    """Pack the first ``lengths[b]`` tokens of every row of a right-padded batch into one row.

    Args:
        input_ids: integer tensor ``[B, T]``, right-padded.
        lengths: integer tensor ``[B]``, real tokens per row, ``1 <= lengths[b] <= T``.

    Returns: :class:`PackedSequences` with ``N = sum(lengths)`` tokens, rows in batch order.

    Raises:
        ValueError: ``input_ids`` is not 2-D, ``lengths`` is not ``[B]``, or a length is < 1
            or > ``T``.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"pack_sequences: input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    lengths = _check_lengths(lengths, width=input_ids.size(1))
    if lengths.numel() != input_ids.size(0):
        raise ValueError(f"pack_sequences: {input_ids.size(0)} rows but {lengths.numel()} lengths")
    keep = torch.arange(input_ids.size(1), device=input_ids.device)[None, :] < lengths[:, None]
    cu = cu_seqlens_of(lengths)
    return PackedSequences(
        input_ids=input_ids[keep].long()[None, :],  # boolean indexing is row-major: row 0's tokens first
        position_ids=packed_position_ids(cu)[None, :],
        cu_seqlens=cu,
        max_seqlen=int(lengths.max()),
    )


def unpack_sequences(
    values: torch.Tensor, cu_seqlens: torch.Tensor, width: int | None = None, fill: float = 0.0
) -> torch.Tensor:
    """Per-token values of a packed row back into a right-padded batch.

    Args:
        values: ``[N, ...]``, e.g. logits ``[N, V]`` (drop the packed row's batch dimension first).
        cu_seqlens: IntTensor ``[B + 1]`` of the packing.
        width: padded width ``T`` (default: the longest sequence).
        fill: value of the padding positions.

    Returns: ``[B, T, ...]``; row ``b``'s first ``n_b`` positions are sequence ``b``'s values.
        Differentiable with respect to ``values``.

    Raises: ValueError when ``values`` does not hold ``cu_seqlens[-1]`` tokens or ``width``
        is shorter than a sequence.
    """
    n = int(cu_seqlens[-1])
    if values.size(0) != n:
        raise ValueError(f"unpack_sequences: values hold {values.size(0)} tokens but cu_seqlens describe {n}")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    width = int(lengths.max()) if width is None else width
    if int(lengths.max()) > width:
        raise ValueError(f"unpack_sequences: width {width} is shorter than the longest sequence ({int(lengths.max())})")
    out = values.new_full((lengths.numel(), width, *values.shape[1:]), fill)
    keep = torch.arange(width, device=values.device)[None, :] < lengths[:, None]
    out[keep] = values
    return out


def packed_response_index(cu_seqlens: torch.Tensor, prompt_lengths: torch.Tensor, response_width: int) -> torch.Tensor:
    """Where in the packed row the logits predicting each response token are.

    Row ``b``'s response token ``j`` sits at packed position ``cu_seqlens[b] + prompt_lengths[b] + j``
    and is predicted by the position before it. Positions past a sequence's end are clamped
    to its last token (their values are padding; mask them with the response mask), so a
    gather never reads another sequence.

    Args:
        cu_seqlens: IntTensor ``[B + 1]`` of the packed prompt + response sequences.
        prompt_lengths: LongTensor ``[B]``, each >= 1 and < the sequence's length.
        response_width: ``L``, the response tensor's width.

    Returns: LongTensor ``[B, L]`` of indices into ``[0, N)``.

    Raises: ValueError when a prompt is empty or not shorter than its sequence.
    """
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    prompt_lengths = prompt_lengths.long()
    if bool((prompt_lengths < 1).any()) or bool((prompt_lengths >= lengths).any()):
        raise ValueError("packed_response_index: every prompt needs >= 1 token and a response after it")
    j = torch.arange(response_width, device=cu.device)[None, :]
    pos = (prompt_lengths[:, None] - 1 + j).clamp(max=(lengths - 1)[:, None])
    return cu[:-1, None] + pos


@dataclass(frozen=True)
class PackedTokenBatch:
    """A :class:`TokenBatch` packed into one row (:class:`PackedSequences`).

    The micro-batch form of SFT and reward-model training with packing (``sft.packing``,
    ``rm.packing``): the same sequences, in the same order, without padding.

    Attributes:
        packed: the sequences end to end (``input_ids [1, N]``, ``cu_seqlens [B + 1]``).
        loss_mask: LongTensor ``[N]``, 1 where packed token ``t`` is a target predicted by
            packed position ``t - 1``. It is 0 on every sequence's first token (nothing in
            the sequence predicts it), so ``loss_mask.sum()`` equals the padded batch's
            ``loss_mask[:, 1:].sum()``.
    """

    packed: PackedSequences
    loss_mask: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        """LongTensor ``[B]``: tokens per sequence."""
        return self.packed.lengths

    @property
    def num_tokens(self) -> int:
        """Real tokens in the batch (``N``: every packed token is real)."""
        return self.packed.num_tokens

    def __len__(self) -> int:
        return len(self.packed)


def pack_token_batch(batch: TokenBatch) -> PackedTokenBatch:
    """Pack a right-padded :class:`TokenBatch` (rows in order).

    Args:
        batch: ``input_ids``/``loss_mask`` ``[B, T]``, ``lengths [B]`` (each 1..T).

    Returns: :class:`PackedTokenBatch` with ``N = sum(lengths)`` tokens; its loss mask is the
        batch's on the real tokens, with every sequence's first token set to 0.

    Raises: ValueError as :func:`pack_sequences`.
    """
    packed = pack_sequences(batch.input_ids, batch.lengths)
    keep = torch.arange(batch.input_ids.size(1))[None, :] < packed.lengths[:, None]
    mask = batch.loss_mask[keep].long()
    mask[packed.cu_seqlens[:-1].long()] = 0  # a sequence's first token is never predicted
    return PackedTokenBatch(packed=packed, loss_mask=mask)
