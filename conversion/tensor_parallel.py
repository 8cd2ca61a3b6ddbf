"""Tensor-parallel (TP) shards of a megatron-core GPTModel state dict, and merging them back.

``conversion.hf_to_megatron`` produces, and ``conversion.megatron_to_hf`` consumes, the full
(unsharded) state of the local-spec GPTModel. A model built at TP size N holds on each rank
r only its part of the sharded tensors; :func:`shard_state` cuts a full state into those N
parts and :func:`merge_shards` puts them back together, bit for bit.

Layouts (megatron-core 0.16.1, local spec, no sequence parallelism). ``dim`` is the
``partition_dim`` and ``stride`` the ``partition_stride`` megatron attaches to each
parameter (``tensor_parallel.layers.set_tensor_model_parallel_attributes``); a tensor of
size S on ``dim`` is cut into ``N * stride`` equal pieces and rank r keeps pieces
``r, r + N, r + 2N, ...`` concatenated in that order (how
``tensor_parallel.layers._initialize_affine_weight_cpu`` scatters a master weight):

=========================================  =========  ======  ===========================
megatron tensor                            dim        stride  megatron layer
=========================================  =========  ======  ===========================
embedding.word_embeddings.weight [V, H]    0 (vocab)  1       VocabParallelEmbedding
output_layer.weight [V, H] (untied)        0 (vocab)  1       ColumnParallelLinear
self_attention.linear_qkv.weight/.bias     0          1       ColumnParallelLinear
self_attention.linear_proj.weight          1          1       RowParallelLinear
self_attention.linear_proj.bias            replicated         (added after the all-reduce)
mlp.linear_fc1.weight [2F, H]              0          2       ColumnParallelLinear, stride 2
mlp.linear_fc2.weight [H, F]               1          1       RowParallelLinear
every norm (incl. q/k_layernorm)           replicated         RMSNorm
MoE: mlp.router.weight [E, H]              replicated         TopKRouter
mlp.experts.local_experts.{j}.linear_fc1   0          2       expert ColumnParallelLinear
mlp.experts.local_experts.{j}.linear_fc2   1          1       expert RowParallelLinear
mlp.shared_experts.linear_fc1.weight       0          2       ColumnParallelLinear
mlp.shared_experts.linear_fc2.weight       1          1       RowParallelLinear
mlp.shared_experts.gate_weight [1, H]      replicated         SharedExpertMLP gate
=========================================  =========  ======  ===========================

MoE layers (megatron's expert tensor parallelism, ``expert_tensor_parallel_size`` = the
tensor-parallel size, its default): every expert is an MLP sharded as the dense one (its FFN
width ``moe_ffn_hidden_size`` split, gate and up each in N), so each rank holds 1/N of every
expert and the all-gather token dispatcher gives each rank all of the group's tokens; the
router and the shared expert's gate are replicated. Under expert parallelism the names are a
rank's local experts (``local_experts.{j}``, ``engine.storage.expert_shards``); the table is
the same for every ``j``.

Two layouts need care:

- ``linear_qkv`` rows are grouped per query group (``conversion.layout``: group g's query
  heads, then its key head and value head), so a contiguous split on dim 0 gives every
  rank whole groups, exactly what ``SelfAttention`` expects with
  ``num_query_groups / N`` groups per rank. ``num_key_value_heads`` must divide by N.
- ``linear_fc1`` is ``[gate; up]`` (SwiGLU). Splitting it contiguously would give rank 0
  all of gate and rank 1 all of up; instead gate and up are *each* split in N, and rank r
  holds ``[gate_r; up_r]``, so its local ``MLP`` chunk in two still yields its own gate and
  up halves. This is megatron's ``stride=2`` for gated units (``transformer/mlp.py``,
  ``MLP.__init__`` and ``apply_swiglu_sharded_factory``, which saves a rank's chunks as
  pieces r and N + r of the global tensor), and what Megatron-LM's
  ``tools/checkpoint`` saver does for swiglu (chunk W and V per rank, concatenate pairs).

Replicated weights stay equal on every rank only if their gradients do: q/k_layernorm act
on each rank's own heads, so megatron sums their gradients over the TP group after backward
(``distributed/finalize_model_grads.py``); a CPU training step at TP > 1 must do the same.

The table is explicit per tensor name; ``tests/conversion/test_tensor_parallel.py`` checks
it against the attributes megatron puts on a built model's parameters.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from conversion.registry import FAMILIES, ConversionError
from conversion.spec import HF_ARCHITECTURES, GPTSpec


@dataclass(frozen=True)
class Split:
    """How a sharded tensor is cut: megatron's ``partition_dim`` and ``partition_stride``."""

    dim: int
    stride: int = 1


# Tensor name (global) or per-layer suffix -> Split, or None for replicated tensors.
GLOBAL_SPLITS: dict[str, Split | None] = {
    "embedding.word_embeddings.weight": Split(0),
    "output_layer.weight": Split(0),
    "decoder.final_layernorm.weight": None,
}
LAYER_SPLITS: dict[str, Split | None] = {
    "input_layernorm.weight": None,
    "self_attention.linear_qkv.weight": Split(0),
    "self_attention.linear_qkv.bias": Split(0),
    "self_attention.q_layernorm.weight": None,
    "self_attention.k_layernorm.weight": None,
    "self_attention.linear_proj.weight": Split(1),
    "self_attention.linear_proj.bias": None,
    "pre_mlp_layernorm.weight": None,
    "mlp.linear_fc1.weight": Split(0, stride=2),
    "mlp.linear_fc2.weight": Split(1),
    "mlp.router.weight": None,
    "mlp.experts.local_experts.{j}.linear_fc1.weight": Split(0, stride=2),
    "mlp.experts.local_experts.{j}.linear_fc2.weight": Split(1),
    "mlp.shared_experts.linear_fc1.weight": Split(0, stride=2),
    "mlp.shared_experts.linear_fc2.weight": Split(1),
    "mlp.shared_experts.gate_weight": None,
}
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")
_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT_INDEX = re.compile(r"(?<=\.local_experts\.)\d+(?=\.)")
_HF_CLASS = {arch: cls for cls, arch in HF_ARCHITECTURES.items()}


def split_of(name: str) -> Split | None:
    """The split of megatron tensor ``name`` (None: replicated on every rank).

    Raises:
        ConversionError: ``name`` is not a tensor of the local-spec GPTModel.
    """
    if name in GLOBAL_SPLITS:
        return GLOBAL_SPLITS[name]
    m = _LAYER_NAME.fullmatch(name)
    suffix = _EXPERT_INDEX.sub("{j}", m.group(2)) if m else None
    if suffix in LAYER_SPLITS:
        return LAYER_SPLITS[suffix]
    raise ConversionError(f"tensor-parallel layout: unknown megatron tensor {name!r}")


def _check_tp(spec: GPTSpec, tp_size: int) -> None:
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor-parallel size must be an integer >= 1, got {tp_size!r}")
    for field, size in (
        ("moe_ffn_hidden_size", spec.moe_ffn_hidden_size),
        ("moe_shared_expert_ffn_hidden_size", spec.moe_shared_expert_ffn_hidden_size),
    ):
        if spec.num_experts is not None and size is not None and size % tp_size:
            raise ConversionError(
                f"{field}={size} is not divisible by tensor-parallel size {tp_size} (each expert's "
                "linear_fc1 gate/up rows and linear_fc2 columns are split)"
            )
    if spec.num_key_value_heads % tp_size:
        raise ConversionError(
            f"num_key_value_heads={spec.num_key_value_heads} (megatron num_query_groups) is not divisible by "
            f"tensor-parallel size {tp_size}: each rank must hold whole query groups of linear_qkv"
        )
    has_dense_mlp = spec.num_experts is None or bool(spec.moe_dense_layers)
    if has_dense_mlp and spec.ffn_hidden_size % tp_size:
        raise ConversionError(
            f"ffn_hidden_size={spec.ffn_hidden_size} is not divisible by tensor-parallel size {tp_size} "
            "(linear_fc1 gate/up rows and linear_fc2 columns are split)"
        )


def _check_names(kind: str, spec: GPTSpec, names: Sequence[str]) -> None:
    expected = FAMILIES[_HF_CLASS[spec.architecture]].mcore_shapes(spec)
    missing = [n for n in expected if n not in names]
    if missing:
        raise ConversionError(f"{kind}: missing tensor {missing[0]!r} ({len(missing)} missing in total)")
    unexpected = [n for n in names if n not in expected and not n.endswith("._extra_state")]
    if unexpected:
        raise ConversionError(f"{kind}: unexpected tensor {unexpected[0]!r}")


def _check_divisible(name: str, t: torch.Tensor, split: Split, tp_size: int) -> None:
    size = t.shape[split.dim] if t.dim() > split.dim else None
    if size is not None and size % (tp_size * split.stride) == 0:
        return
    if name in VOCAB_TENSORS:
        raise ConversionError(
            f"tensor {name!r}: vocabulary rows {size} are not divisible by tensor-parallel size {tp_size} "
            "(pad the vocabulary, GPTSpec.with_vocab_padding)"
        )
    raise ConversionError(
        f"tensor {name!r} of shape {tuple(t.shape)}: dim {split.dim} is not divisible by "
        f"{tp_size * split.stride} (tensor-parallel size {tp_size} x stride {split.stride})"
    )


def shard_state(spec: GPTSpec, full_state: Mapping[str, torch.Tensor], tp_size: int) -> list[dict[str, torch.Tensor]]:
    """Cut a full megatron-core state dict into ``tp_size`` tensor-parallel shards.

    For a split tensor of size S on its dim, rank r gets
    ``cat(chunk(t, tp_size * stride, dim)[r::tp_size], dim)`` (size S / tp_size); e.g. at
    tp_size 2 the shards are: embedding/output_layer ``[V/2, H]``, linear_qkv
    ``[(heads + 2 * groups) * d / 2, H]`` (whole query groups), linear_proj ``[H, heads * d / 2]``,
    linear_fc1 ``[F, H]`` = ``[gate_r; up_r]``, linear_fc2 ``[H, F/2]``. Replicated tensors
    (norms, linear_proj.bias) are the same tensor objects in every shard (not copied); split
    ones are new contiguous tensors. ``_extra_state`` entries are dropped.

    Args:
        spec: architecture of the state.
        full_state: megatron name -> tensor, e.g. from ``conversion.hf_to_megatron`` (the
            vocabulary tensors may carry padding rows).
        tp_size: number of tensor-parallel ranks.

    Returns:
        ``tp_size`` dicts, index = TP rank; each loads into that rank's GPTModel.

    Raises:
        ValueError: ``tp_size`` < 1.
        ConversionError (a ValueError): ``num_key_value_heads`` or ``ffn_hidden_size`` not
            divisible by ``tp_size`` (message names the field); vocabulary rows of a
            vocabulary tensor not divisible (message names the tensor); a missing or
            unexpected tensor.
    """
    _check_tp(spec, tp_size)
    names = [n for n in full_state if not n.endswith("._extra_state")]
    _check_names("full megatron state", spec, names)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]
    for name in names:
        t, split = full_state[name], split_of(name)
        if split is None:
            for shard in shards:
                shard[name] = t
            continue
        _check_divisible(name, t, split, tp_size)
        pieces = t.chunk(tp_size * split.stride, dim=split.dim)
        for rank, shard in enumerate(shards):
            shard[name] = torch.cat(pieces[rank::tp_size], dim=split.dim)
    return shards


def merge_shards(spec: GPTSpec, shards: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Exact inverse of :func:`shard_state`: the full megatron-core state from all TP shards.

    A split tensor is rebuilt by cutting each rank's part into ``stride`` pieces and
    concatenating piece s of every rank, for s = 0 .. stride-1 (for linear_fc1:
    ``[gate_0; gate_1; ...; up_0; up_1; ...]``). Replicated tensors must be identical on
    every rank; rank 0's is returned.

    Args:
        spec: architecture of the model.
        shards: one state dict per TP rank, in rank order (e.g. each rank's
            ``engine.models.megatron.mcore_state``); ``_extra_state`` entries are ignored.

    Returns:
        megatron name -> full tensor, as ``conversion.megatron_to_hf`` takes it.

    Raises:
        ConversionError (a ValueError): no shards, ranks with different tensor names or
            shapes, replicated tensors that differ between ranks, a missing or unexpected
            tensor, or ``num_key_value_heads``/``ffn_hidden_size`` not divisible by the
            number of shards (each message names the tensor or field).
    """
    if not shards:
        raise ConversionError("merge_shards: no shards given")
    tp_size = len(shards)
    _check_tp(spec, tp_size)
    names = [n for n in shards[0] if not n.endswith("._extra_state")]
    _check_names("megatron shard of rank 0", spec, names)
    out: dict[str, torch.Tensor] = {}
    for name in names:
        parts = []
        for rank, shard in enumerate(shards):
            if name not in shard:
                raise ConversionError(f"megatron shard of rank {rank}: missing tensor {name!r}")
            parts.append(shard[name])
            if parts[-1].shape != parts[0].shape:
                raise ConversionError(
                    f"tensor {name!r}: rank {rank} has shape {tuple(parts[-1].shape)}, rank 0 {tuple(parts[0].shape)}"
                )
        split = split_of(name)
        if split is None:
            for rank, t in enumerate(parts[1:], start=1):
                if not torch.equal(t, parts[0]):
                    raise ConversionError(f"replicated tensor {name!r} differs between rank 0 and rank {rank}")
            out[name] = parts[0]
            continue
        _check_divisible(name, parts[0], split, 1)
        per_rank = [t.chunk(split.stride, dim=split.dim) for t in parts]
        out[name] = torch.cat([per_rank[r][s] for s in range(split.stride) for r in range(tp_size)], dim=split.dim)
    for rank, shard in enumerate(shards[1:], start=1):
        extra = [n for n in shard if n not in out and not n.endswith("._extra_state")]
        if extra:
            raise ConversionError(f"megatron shard of rank {rank}: unexpected tensor {extra[0]!r}")
    return out
