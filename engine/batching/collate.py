"""Token batches: right-padded collation, micro-batch splitting and epoch-ordered sampling.

Every trainer (SFT, reward model, RL actor) turns variable-length token sequences into
``[B, T]`` tensors the same way here, so padding and loss-mask conventions cannot differ
between them. Right padding is safe for causal decoders: position ``t`` attends to
``0..t`` only, so pad tokens after a sequence never change its logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class TokenBatch:
    """Right-padded token sequences.

    Attributes:
        input_ids: LongTensor ``[B, T]``; positions at or after ``lengths[b]`` hold the pad id.
        loss_mask: LongTensor ``[B, T]``, 1 where token ``t`` is a training target (it is
            predicted from positions ``< t``), 0 elsewhere including padding.
        lengths: LongTensor ``[B]``, number of real (non-pad) tokens per row (>= 1).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    lengths: torch.Tensor

    @property
    def attention_mask(self) -> torch.Tensor:
        """LongTensor ``[B, T]``: 1 on real tokens, 0 on padding."""
        t = self.input_ids.size(1)
        return (torch.arange(t).unsqueeze(0) < self.lengths.unsqueeze(1)).long()

    @property
    def num_tokens(self) -> int:
        """Real (non-pad) tokens in the batch."""
        return int(self.lengths.sum())

    def __len__(self) -> int:
        return self.input_ids.size(0)


def collate_tokens(
    sequences: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]] | None = None,
    pad_id: int = 0,
) -> TokenBatch:
    """Right-pad sequences into a :class:`TokenBatch` as long as its longest row.

    Args:
        sequences: B token-id lists, each non-empty.
        loss_masks: B lists of 0/1 of the same lengths as ``sequences``; None means every
            token except the first of each row is a target (plain language modelling).
        pad_id: token id written into padding positions (never a target).

    Returns:
        TokenBatch with ``input_ids``/``loss_mask`` ``[B, max_len]`` and ``lengths`` ``[B]``.

    Raises:
        ValueError: naming the row, for an empty batch, an empty sequence, or a loss mask
            whose length differs from its sequence or holds values other than 0/1.
    """
    if len(sequences) == 0:
        raise ValueError("collate_tokens: empty batch (no sequences)")
    if loss_masks is not None and len(loss_masks) != len(sequences):
        raise ValueError(f"collate_tokens: {len(sequences)} sequences but {len(loss_masks)} loss masks")
    lengths = [len(s) for s in sequences]
    for i, n in enumerate(lengths):
        if n == 0:
            raise ValueError(f"collate_tokens: sequence {i} is empty")
    width = max(lengths)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : lengths[i]] = torch.as_tensor(list(seq), dtype=torch.long)
        if loss_masks is None:
            mask[i, 1 : lengths[i]] = 1
            continue
        m = list(loss_masks[i])
        if len(m) != lengths[i]:
            raise ValueError(f"collate_tokens: row {i} has {lengths[i]} tokens but a loss mask of length {len(m)}")
        if any(v not in (0, 1) for v in m):
            raise ValueError(f"collate_tokens: row {i} loss mask must hold only 0 and 1")
        mask[i, : lengths[i]] = torch.as_tensor(m, dtype=torch.long)
    return TokenBatch(input_ids=ids, loss_mask=mask, lengths=torch.as_tensor(lengths, dtype=torch.long))


def split_micro_batches(items: Sequence[T], micro_batch_size: int) -> list[list[T]]:
    """Split a global batch into consecutive micro-batches of ``micro_batch_size`` items.

    The last micro-batch is shorter when ``len(items)`` is not a multiple. Collate each
    micro-batch separately so it is padded only to its own longest row.

    Raises:
        ValueError: if ``micro_batch_size < 1`` or ``items`` is empty.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if len(items) == 0:
        raise ValueError("split_micro_batches: empty batch")
    return [list(items[i : i + micro_batch_size]) for i in range(0, len(items), micro_batch_size)]


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad id, else its EOS id (padding is never a target, so either works).

    Raises:
        ValueError: the tokenizer has neither.
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("tokenizer has neither a pad nor an EOS token; set pad_token in tokenizer_config.json")
    return int(pad)
