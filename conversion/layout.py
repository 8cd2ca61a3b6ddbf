"""Megatron's fused-tensor layouts: QKV fused per query group, gate/up fused into linear_fc1.

megatron-core's ``SelfAttention.get_query_key_value_tensors`` views ``linear_qkv``'s output
as ``[T, B, groups, (heads/groups + 2) * head_dim]`` and splits the last dimension into
``heads/groups`` query heads, one key head and one value head; so the fused rows are, per
query group g: the g-th block of query heads, then key head g, then value head g.
``MLP.forward`` with ``gated_linear_unit`` chunks ``linear_fc1``'s output in two and
computes ``act(first) * second``: the rows are ``[gate; up]`` (SwiGLU, Shazeer 2020).
The same functions serve weights ``[out, in]`` and biases ``[out]``.
"""

from __future__ import annotations

import torch


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """Interleave separate projections into megatron's per-group QKV layout.

    Args:
        q: ``[heads * d, *rest]``; k, v: ``[groups * d, *rest]`` (rest = ``[in]`` or empty).
        num_query_groups: number of key/value heads.

    Returns:
        ``[(heads + 2 * groups) * d, *rest]``.
    """
    g, rest = num_query_groups, q.shape[1:]
    parts = [x.reshape(g, -1, *rest) for x in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_query_groups: int, head_dim: int):
    """Exact inverse of :func:`fuse_qkv`: returns new (unaliased) ``q, k, v`` tensors."""
    g, rest = num_query_groups, qkv.shape[1:]
    per_group = qkv.reshape(g, (num_heads // g + 2) * head_dim, *rest)
    q, k, v = per_group.split([num_heads // g * head_dim, head_dim, head_dim], dim=1)
    return tuple(x.reshape(-1, *rest).clone() for x in (q, k, v))


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``[ffn, H]`` gate and up projections -> megatron ``linear_fc1`` ``[2 * ffn, H]``."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor):
    """Exact inverse of :func:`fuse_gate_up`: returns new ``gate, up`` tensors ``[ffn, H]``."""
    gate, up = fc1.chunk(2, dim=0)
    return gate.clone(), up.clone()
