"""A Megatron policy as buckets of HF-named tensors, for streaming weight sync to a rollout engine.

The trainer used to hand the rollout engine one list holding a copy of every HF tensor: a
second full copy of the model in the trainer's memory and one model-sized transfer. Here
the HF tensor stream of :func:`conversion.registry.megatron_to_hf` is cut into *buckets*
of at most ``bucket_bytes`` bytes, and only the bucket being sent is materialised: the
extra memory is about one bucket, not the model.

- :func:`plan_buckets` / :func:`plan_policy`: the bucket boundaries, from names, shapes and
  dtypes in stream order (a :class:`BucketPlan`, small and picklable).
- :func:`iter_buckets` / :func:`hf_bucket`: the buckets themselves, as lists of
  ``(hf_name, tensor)`` whose tensors own their memory (nothing aliases the model).
- :class:`BucketServer`: serves buckets by index (the trainer worker's side of the sync);
  requests for consecutive indices continue one pass over the stream.
- ``engine.distributed.weight_source.HFBucketSource`` (the actor workers' ``hf_bucket_plan`` /
  ``hf_bucket``) serves them over a lazily built :class:`BucketServer` (both RL backends).
  Under tensor parallelism the ranks of the group take part together: each split tensor is gathered from their shards into the full
  megatron tensor first (:func:`gather_tensor_parallel`), so the buckets hold full HF tensors.
  Under expert parallelism the ranks of the expert group likewise gather every MoE layer's
  experts (:func:`gather_expert_parallel`).

Bucket boundaries never split a *load group* (:func:`load_group`): the tensors vLLM loads
into one module (``q/k/v_proj`` into ``qkv_proj``, ``gate/up_proj`` into ``gate_up_proj``,
a weight and its bias). vLLM's in-place reload processes a module once all its tensors have
arrived within one call; a module that receives only some of them in a call is rebuilt
with uninitialised memory in place of the missing parts.

A policy already held in HF names (the DeepSpeed backend's transformers model) takes part
through a *weight source*: any object with a method ``hf_tensors()`` that yields
``(hf_name, tensor)`` in a fixed order. Wherever a function here takes ``model``, such a
source may be given instead; its stream is used as it is (no conversion) and every tensor
of it is copied into the bucket.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from conversion.registry import megatron_to_hf
from conversion.tensor_parallel import split_of
from engine.models.expert_lockstep import expert_group
from engine.models.megatron import mcore_state

NamedTensors = list[tuple[str, torch.Tensor]]


# HF projection names that vLLM fuses into one module (its ``packed_modules_mapping`` for
# Llama, Qwen2 and Qwen3).
FUSED_MODULES: dict[str, str] = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


# An MoE layer's routed experts (``...experts.{j}.<proj>.weight``): vLLM loads all of them into
# one FusedMoE module (``w13_weight``/``w2_weight`` stacked over experts), named ``...experts``.
_EXPERT = re.compile(r"(.+\.experts)\.\d+\.[^.]+\.weight")


def load_group(hf_name: str) -> str:
    """The module a rollout engine loads ``hf_name`` into: the name without its last
    component, with fused projections renamed (``model.layers.0.self_attn.k_proj.bias`` ->
    ``model.layers.0.self_attn.qkv_proj``); every routed expert of an MoE layer goes to the
    layer's one experts module (``model.layers.0.mlp.experts.3.up_proj.weight`` ->
    ``model.layers.0.mlp.experts``). A name without a dot is its own group."""
    expert = _EXPERT.fullmatch(hf_name)
    if expert:
        return expert.group(1)
    module, _, _ = hf_name.rpartition(".")
    if not module:
        return hf_name
    parent, _, leaf = module.rpartition(".")
    fused = FUSED_MODULES.get(leaf)
    if fused is None:
        return module
    return f"{parent}.{fused}" if parent else fused


@dataclass(frozen=True)
class TensorMeta:
    """One HF tensor of the stream: name, shape, dtype and size in bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


@dataclass(frozen=True)
class BucketPlan:
    """Consecutive runs of the HF tensor stream, each sent as one bucket.

    Attributes:
        bucket_bytes: the budget (bytes) the plan was made for.
        tensors: every tensor of the stream, in stream order.
        starts: bucket ``i`` is ``tensors[starts[i]:starts[i + 1]]``; ``len(starts)`` is
            ``num_buckets + 1``, ``starts[0] == 0`` and ``starts[-1] == len(tensors)``.
    """

    bucket_bytes: int
    tensors: tuple[TensorMeta, ...]
    starts: tuple[int, ...]

    @property
    def num_buckets(self) -> int:
        return len(self.starts) - 1

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole stream (the model's HF tensors)."""
        return sum(t.nbytes for t in self.tensors)

    def bucket(self, index: int) -> tuple[TensorMeta, ...]:
        """The tensors of bucket ``index``. Raises IndexError outside ``[0, num_buckets)``."""
        _check_index(index, self.num_buckets)
        return self.tensors[self.starts[index] : self.starts[index + 1]]

    def bucket_nbytes(self, index: int) -> int:
        """Bytes of bucket ``index``. Raises IndexError outside ``[0, num_buckets)``."""
        return sum(t.nbytes for t in self.bucket(index))


def _check_index(index: int, num_buckets: int) -> None:
    if not 0 <= index < num_buckets:
        raise IndexError(f"bucket index {index} out of range: the plan has {num_buckets} buckets")


def plan_buckets(
    tensors: Iterable[tuple[str, Sequence[int], torch.dtype]],
    bucket_bytes: int,
    group_of: Callable[[str], str] = load_group,
) -> BucketPlan:
    """Cut a stream of HF tensors into buckets of at most ``bucket_bytes`` bytes, in order.

    The stream is first split into *segments*, the shortest runs that no load group crosses
    (a group spans from its first to its last tensor, so a group whose tensors are not
    adjacent keeps everything between them in its segment too). Segments are then packed
    greedily: a bucket takes segments while its size stays within ``bucket_bytes``. A
    segment larger than the budget (e.g. a big embedding) gets a bucket of its own.

    Args:
        tensors: ``(hf_name, shape, dtype)`` in the order the weights will be streamed
            (consumed lazily, one at a time).
        bucket_bytes: budget per bucket, in bytes (> 0).
        group_of: HF name -> load group (default :func:`load_group`).

    Returns: a :class:`BucketPlan`; an empty stream gives zero buckets.

    Raises:
        ValueError: ``bucket_bytes <= 0``, or a name occurs twice in the stream.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    metas: list[TensorMeta] = []
    last_of_group: dict[str, int] = {}
    seen: set[str] = set()
    for name, shape, dtype in tensors:
        if name in seen:
            raise ValueError(f"weight stream: tensor {name!r} occurs twice")
        seen.add(name)
        shape = tuple(int(s) for s in shape)
        numel = 1
        for s in shape:
            numel *= s
        metas.append(TensorMeta(name, shape, dtype, numel * dtype.itemsize))
        last_of_group[group_of(name)] = len(metas) - 1

    segments: list[tuple[int, int, int]] = []  # (start, end, bytes)
    seg_start, reach, seg_bytes = 0, -1, 0
    for j, meta in enumerate(metas):
        reach = max(reach, last_of_group[group_of(meta.name)])
        seg_bytes += meta.nbytes
        if reach == j:
            segments.append((seg_start, j + 1, seg_bytes))
            seg_start, seg_bytes = j + 1, 0

    starts = [0]
    filled = 0
    for start, _end, size in segments:
        if filled and filled + size > bucket_bytes:
            starts.append(start)
            filled = 0
        filled += size
    if metas:
        starts.append(len(metas))
    return BucketPlan(bucket_bytes=int(bucket_bytes), tensors=tuple(metas), starts=tuple(starts))


def _hf_stream(hf_config: Mapping[str, Any], model) -> tuple[Iterator[tuple[str, torch.Tensor]], set[int] | None]:
    """The model's HF tensor stream and the storage addresses of its parameters (None for a
    weight source's stream: copy every tensor)."""
    hf_tensors = getattr(model, "hf_tensors", None)
    if callable(hf_tensors):
        return iter(hf_tensors()), None
    state = mcore_state(model)
    aliased = {t.untyped_storage().data_ptr() for t in state.values()}
    return iter(megatron_to_hf(hf_config, gather_expert_parallel(gather_tensor_parallel(state)))), aliased


def _tensor_parallel_group():
    """Megatron's tensor-parallel group of this process, or None when its size is 1 (or there is
    no process group or megatron state)."""
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core import parallel_state

    if not (dist.is_available() and dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return None
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def gather_tensor_parallel(state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """The full megatron state of a tensor-parallel model from every rank's shard (a collective:
    every rank of the tensor-parallel group calls it with its own ``mcore_state``, in the same
    order); ``state`` itself without tensor parallelism.

    Each split tensor (``conversion.tensor_parallel.split_of``: dim and stride) is all-gathered
    and put back as ``conversion.tensor_parallel.merge_shards`` does (piece ``s`` of every rank,
    for ``s`` below the stride: ``linear_fc1`` is ``[gate_0; gate_1; ...; up_0; up_1; ...]``);
    replicated tensors (norms, ``linear_proj.bias``) are this rank's own. The rollout engine
    needs full HF tensors, so weight sync converts this state. It holds one full copy of the
    model while a sync pass runs (the bucket budget bounds what is sent at once, not this).

    Raises:
        conversion.registry.ConversionError: a tensor the layout table does not know.
    """
    group = _tensor_parallel_group()
    if group is None:
        return state
    size = dist.get_world_size(group)
    out = {}
    for name, t in state.items():
        split = split_of(name)
        if split is None:
            out[name] = t
            continue
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        pieces = [p.chunk(split.stride, dim=split.dim) for p in parts]
        out[name] = torch.cat([pieces[r][s] for s in range(split.stride) for r in range(size)], dim=split.dim)
    return out


_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def gather_expert_parallel(state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """The full megatron state of an expert-parallel model: every routed expert of every MoE layer,
    named by its global index, from every rank's shard (a collective: every rank of the
    expert-model-parallel group calls it with its own ``mcore_state``, in the same order);
    ``state`` itself without expert parallelism.

    At expert-parallel size N a rank holds ``n = num_experts / N`` experts of each layer,
    ``...local_experts.{j}...``; expert ``j`` of expert-parallel rank ``r`` is global expert
    ``r * n + j`` (megatron's ``SequentialMLP``: ``local_expert_indices``). Each local expert
    tensor is all-gathered over the group and stored under the global index; every other tensor
    is this rank's own (replicated). Like :func:`gather_tensor_parallel`, it holds a full copy of
    the experts while a sync pass runs.
    """
    group = expert_group()
    if group is None:
        return state
    size = dist.get_world_size(group)
    local = 1 + max((int(m.group(1)) for n in state if (m := _LOCAL_EXPERT.search(n))), default=-1)
    out = {}
    for name, t in state.items():
        m = _LOCAL_EXPERT.search(name)
        if m is None:
            out[name] = t
            continue
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        j = int(m.group(1))
        for r, part in enumerate(parts):
            out[f"{name[: m.start(1)]}{r * local + j}{name[m.end(1) :]}"] = part
    return out


def plan_policy(hf_config: Mapping[str, Any], model, bucket_bytes: int) -> BucketPlan:
    """Plan the buckets of a Megatron policy's HF weights (one pass over
    :func:`conversion.registry.megatron_to_hf`, holding one tensor at a time).

    Args:
        hf_config: the policy's HF ``config.json`` dict (selects the tensor map).
        model: megatron-core GPTModel (``engine.models.megatron.build_gpt_model``) or a weight
            source (module docstring).
        bucket_bytes: budget per bucket, in bytes (> 0).

    Raises:
        ValueError: ``bucket_bytes <= 0``.
        conversion.registry.ConversionError: the model does not match ``hf_config``.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    stream, _ = _hf_stream(hf_config, model)
    return plan_buckets(((name, t.shape, t.dtype) for name, t in stream), bucket_bytes)


def _owned(tensor: torch.Tensor, aliased: set[int] | None) -> torch.Tensor:
    """``tensor`` if it is a contiguous tensor that owns its whole storage and shares none
    with the model; otherwise (always when ``aliased`` is None) a contiguous copy."""
    tensor = tensor.detach()
    storage = tensor.untyped_storage()
    if (
        aliased is None
        or storage.data_ptr() in aliased
        or not tensor.is_contiguous()
        or tensor.storage_offset() != 0
        or storage.nbytes() != tensor.numel() * tensor.element_size()
    ):
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _next_checked(stream: Iterator[tuple[str, torch.Tensor]], meta: TensorMeta, position: int) -> torch.Tensor:
    pair = next(stream, None)
    if pair is None:
        raise ValueError(f"weight stream ended at tensor {position}, but the bucket plan expects {meta.name!r}")
    name, tensor = pair
    if name != meta.name or tuple(tensor.shape) != meta.shape or tensor.dtype != meta.dtype:
        raise ValueError(
            f"weight stream does not match the bucket plan at tensor {position}: expected {meta.name!r} "
            f"{meta.shape} {meta.dtype}, got {name!r} {tuple(tensor.shape)} {tensor.dtype}"
        )
    return tensor


def _take(stream, plan: BucketPlan, index: int, aliased: set[int] | None) -> NamedTensors:
    first = plan.starts[index]
    return [
        (meta.name, _owned(_next_checked(stream, meta, first + k), aliased))
        for k, meta in enumerate(plan.bucket(index))
    ]


def iter_buckets(hf_config: Mapping[str, Any], model, plan: BucketPlan, start: int = 0) -> Iterator[NamedTensors]:
    """Yield buckets ``start, start + 1, ...`` of the policy's HF weights, one pass over the stream.

    Each bucket is a list of ``(hf_name, tensor)`` in stream order whose tensors are
    contiguous and own their memory (tensors the converter returns as views of the model
    are cloned, fresh ones are kept), so changing the model afterwards does not change a
    bucket. Tensors before ``start`` are skipped without being copied. The generator keeps
    no reference to a bucket once it is yielded: the extra memory is the bucket the caller
    holds plus the converter's tensors of one layer.

    Concatenating all buckets gives exactly ``list(megatron_to_hf(hf_config, mcore_state(model)))``
    (names, order, values).

    Args:
        hf_config: the policy's HF ``config.json`` dict.
        model: megatron-core GPTModel or a weight source (module docstring).
        plan: from :func:`plan_policy` for this model (shapes and dtypes must match).
        start: first bucket to yield, in ``[0, plan.num_buckets]``.

    Raises:
        IndexError: ``start`` outside ``[0, plan.num_buckets]``.
        ValueError: the stream does not match the plan (another name, shape or dtype at a
            position, or a different length); raised when the mismatch is reached.
        conversion.registry.ConversionError: the model does not match ``hf_config``.
    """
    if not 0 <= start <= plan.num_buckets:
        raise IndexError(f"start bucket {start} out of range: the plan has {plan.num_buckets} buckets")
    return _iter_buckets(hf_config, model, plan, start)


def _iter_buckets(hf_config, model, plan: BucketPlan, start: int) -> Iterator[NamedTensors]:
    stream, aliased = _hf_stream(hf_config, model)
    for position in range(plan.starts[start] if plan.num_buckets else 0):
        _next_checked(stream, plan.tensors[position], position)
    for index in range(start, plan.num_buckets):
        yield _take(stream, plan, index, aliased)
    extra = next(stream, None)
    if extra is not None:
        raise ValueError(
            f"weight stream has more tensors than the bucket plan ({len(plan.tensors)}): next is {extra[0]!r}"
        )


def hf_bucket(hf_config: Mapping[str, Any], model, plan: BucketPlan, index: int) -> NamedTensors:
    """Bucket ``index`` alone (see :func:`iter_buckets`); streams past the tensors before it.

    Raises:
        IndexError: ``index`` outside ``[0, plan.num_buckets)``.
        ValueError: the stream does not match the plan up to this bucket.
    """
    _check_index(index, plan.num_buckets)
    return next(iter_buckets(hf_config, model, plan, index))


class BucketServer:
    """Buckets of a live policy by index, planned once (shapes do not change in training).

    :meth:`bucket` continues the current pass over the stream when asked for the bucket
    after the previous one, so a sync that requests ``0, 1, ..., n - 1`` converts every
    tensor once; index 0, or any other index out of sequence, starts a new pass (so a sync
    always reads the weights as they are when it starts).

    Args:
        hf_config: the policy's HF ``config.json`` dict.
        model: megatron-core GPTModel or a weight source (read at each pass; updated in place
            by training).
        bucket_bytes: budget per bucket, in bytes (> 0).

    Raises:
        ValueError: ``bucket_bytes <= 0``.
    """

    def __init__(self, hf_config: Mapping[str, Any], model, bucket_bytes: int):
        self.hf_config = hf_config
        self.model = model
        self.plan = plan_policy(hf_config, model, bucket_bytes)
        self._stream: Iterator[NamedTensors] | None = None
        self._next = 0

    def bucket(self, index: int) -> NamedTensors:
        """Bucket ``index`` (see :func:`iter_buckets`). Raises IndexError outside
        ``[0, plan.num_buckets)``, ValueError if the stream no longer matches the plan."""
        _check_index(index, self.plan.num_buckets)
        if self._stream is None or index == 0 or index != self._next:
            self._stream = iter_buckets(self.hf_config, self.model, self.plan, index)
        try:
            out = next(self._stream)
        except BaseException:
            self._stream = None
            raise
        self._next = index + 1
        if self._next == self.plan.num_buckets:
            self._stream = None  # the last bucket: release the stream
        return out
