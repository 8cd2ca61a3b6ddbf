"""The collectives of a data x tensor-parallel training step (megatron-core ``parallel_state``
groups over torch.distributed; gloo on CPU, NCCL on CUDA).

In a single process (no group, or world size 1) every function here is the identity or
the plain single-process computation, so DP=1 training is bit-identical to what it was
before data parallelism existed.

Data parallelism follows Megatron-LM's DistributedDataParallel (Shoeybi et al. 2019,
arXiv:1909.08053; Narayanan et al. 2021, arXiv:2104.04473): each data-parallel rank
back-propagates its share of the global batch; the loss sums are normalised by the global
batch's unit count (tokens, sequences or pairs), so summing the ranks' fp32 gradients
(all-reduce SUM) gives exactly the gradient DP=1 computes on the whole batch, up to the
order of the float additions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from engine.models.master_weights import master_params

# Seconds this process spent in the data-parallel gradient all-reduce (read by benchmarks).
COMM_SECONDS = {"all_reduce_s": 0.0}


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _megatron_group(kind: str):
    """Megatron's ``kind`` ("data" or "tensor_model") parallel group of this rank, or None in a
    single process (no torch.distributed group, no megatron state) or when that size is 1."""
    if not _initialized():
        return None
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    if getattr(parallel_state, f"get_{kind}_parallel_world_size")() == 1:
        return None
    return getattr(parallel_state, f"get_{kind}_parallel_group")()


def data_parallel_group():
    """Megatron's data-parallel process group of this rank, or None in a single process
    (no torch.distributed group, no megatron state, or a data-parallel size of 1)."""
    return _megatron_group("data")


def tensor_parallel_group():
    """Megatron's tensor-parallel process group of this rank, or None when TP is 1 (or no state)."""
    return _megatron_group("tensor_model")


def expert_model_parallel_group():
    """Megatron's expert-model-parallel group (the ranks an MoE layer's experts are sharded
    over), or None when its size is 1 (or no state)."""
    return _megatron_group("expert_model")


def expert_data_parallel_group():
    """Megatron's expert-data-parallel group (the ranks holding the same experts), or None
    when its size is 1 (or no state)."""
    return _megatron_group("expert_data")


def data_parallel_rank() -> int:
    """This rank's index in its data-parallel group (0 in a single process)."""
    group = data_parallel_group()
    return 0 if group is None else dist.get_rank(group)


def global_rank() -> int:
    """This process's rank in the default group (0 in a single process)."""
    return dist.get_rank() if _initialized() else 0


def world_size() -> int:
    """The default group's size (1 in a single process)."""
    return dist.get_world_size() if _initialized() else 1


def all_reduce_gradients(params: Sequence[torch.nn.Parameter], group=None) -> float:
    """Sum ``params``' gradients across the data-parallel ranks, in fp32, in place.

    Every rank must call it with the same parameters in the same order. A parameter
    without a gradient on this rank takes part as zeros (and gets the summed gradient); one
    without a gradient on every rank keeps none, as in a single process (AdamW skips it: no
    weight decay of a weight the loss does not reach, e.g. a reward model's unused output
    layer). The gradients are flattened into one fp32 buffer, with one "has a gradient" flag
    per parameter, and reduced in one call (the bucketing of megatron's DDP, with one bucket).

    Args:
        params: the parameters whose ``.grad`` the optimizer reads (the fp32 masters under
            mixed precision, ``engine.models.master_weights.gradient_params``).
        group: the process group; default :func:`data_parallel_group`.

    Returns: seconds spent in the all-reduce (0.0 without a group).
    """
    if group is None and expert_model_parallel_group() is not None:
        # Expert parallelism: an expert shard (megatron's ``allreduce=False``) differs between the
        # ranks of its expert-model-parallel group and is summed only over the ranks holding the
        # same experts; megatron's all-gather dispatcher already summed every rank's tokens into it.
        dense = [p for p in params if getattr(p, "allreduce", True)]
        experts = [p for p in params if not getattr(p, "allreduce", True)]
        seconds = all_reduce_gradients(dense, data_parallel_group())
        expert_group = expert_data_parallel_group()
        if expert_group is not None:
            seconds += all_reduce_gradients(experts, expert_group)
        return seconds
    group = data_parallel_group() if group is None else group
    if group is None or not params:
        return 0.0
    has_grad = torch.tensor([float(p.grad is not None) for p in params])
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p, dtype=torch.float32 if p.dtype == torch.float32 else p.dtype)
    t0 = time.perf_counter()
    grads = [p.grad for p in params if p.grad is not None]  # every one, given a zero gradient above
    flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads] + [has_grad.to(grads[0].device)])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n
    for p, ranks_with_grad in zip(params, flat[offset:].tolist()):
        if ranks_with_grad == 0:
            p.grad = None
    seconds = time.perf_counter() - t0
    COMM_SECONDS["all_reduce_s"] += seconds
    return seconds


def sum_across_ranks(values: dict[str, float], group=None) -> dict[str, float]:
    """``values`` summed key by key over the data-parallel ranks (keys missing on a rank count
    as 0); ``values`` itself without a group. Sums are taken in rank order, so every rank
    gets the same floats."""
    group = data_parallel_group() if group is None else group
    if group is None:
        return dict(values)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, dict(values), group=group)
    out: dict[str, float] = {}
    for part in gathered:
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + float(v)
    return out


# Replicated parameters whose gradient is partial on each tensor-parallel rank: the per-head
# q/k RMSNorm weights (Qwen3) see only the rank's own heads. Megatron-LM sums them over the
# tensor-parallel group (``finalize_model_grads``: ``_allreduce_non_tensor_model_parallel_grads``).
TP_PARTIAL_GRAD_NAMES = (".q_layernorm.", ".k_layernorm.")


def tensor_parallel_partial(name: str, param: torch.nn.Parameter) -> bool:
    """Whether ``param`` (named ``name`` in its model) is replicated over the tensor-parallel
    group with a gradient that is partial on each rank: :data:`TP_PARTIAL_GRAD_NAMES`, and under
    sequence parallelism every parameter megatron marks ``sequence_parallel=True`` (the norms,
    ``linear_proj``'s bias, an MoE router and a shared expert's gate: each rank's gradient covers
    its own slice of the sequence; ``engine.models.sequence_parallel``)."""
    return getattr(param, "sequence_parallel", False) or any(key in f".{name}" for key in TP_PARTIAL_GRAD_NAMES)


def all_reduce_tensor_parallel_partial_grads(model: torch.nn.Module) -> None:
    """Sum the gradients of the :func:`tensor_parallel_partial` parameters over the
    tensor-parallel group, in one flat fp32 all-reduce (their fp32 masters' under mixed
    precision); nothing without TP. As megatron's ``_allreduce_non_tensor_model_parallel_grads``,
    each parameter is summed once, whichever of the two reasons holds."""
    group = tensor_parallel_group()
    if group is None:
        return
    masters = master_params(model)
    targets = []
    for name, p in model.named_parameters():
        if p.requires_grad and tensor_parallel_partial(name, p):
            target = masters[name] if masters is not None and name in masters else p
            if target.grad is None:
                target.grad = torch.zeros_like(target)
            targets.append(target)
    if targets:
        all_reduce_gradients(targets, group)


def clip_grad_norm(params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the global L2 norm of ``params``' gradients to ``max_norm`` (Pascanu et al. 2013);
    returns the norm before clipping.

    Under tensor parallelism a sharded parameter (megatron's ``tensor_model_parallel``
    attribute) holds only this rank's slice: the squared norms of the shards are summed over
    the tensor-parallel group, those of replicated parameters (norms, row-parallel biases,
    identical on every rank) are counted once, as megatron's ``clip_grad_norm_fp32`` does.
    Under expert parallelism the expert shards (megatron's ``allreduce=False``) are summed
    likewise over the group their pieces are spread over: the expert-model-parallel group at
    tensor-parallel size 1, the expert tensor-and-model-parallel group (``TP x EP`` ranks,
    megatron's expert tensor parallelism) above it.
    Without TP and EP it is ``torch.nn.utils.clip_grad_norm_``.
    """
    params = [p for p in params if p.grad is not None]
    tp, ep = tensor_parallel_group(), expert_model_parallel_group()
    if tp is None and ep is None:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    buckets: list[tuple[Callable[[torch.nn.Parameter], bool], Any]] = []
    if ep is not None:  # expert shards: megatron's allreduce=False
        # megatron: seconds to import; only megatron-core models need it
        from megatron.core import parallel_state

        group = ep if tp is None else parallel_state.get_expert_tensor_and_model_parallel_group()
        buckets.append((lambda p: not getattr(p, "allreduce", True), group))
    if tp is not None:
        buckets.append((lambda p: getattr(p, "tensor_model_parallel", False), tp))
    return _clip_shards_over(params, max_norm, buckets)


def _clip_shards_over(
    params: Sequence[torch.nn.Parameter],
    max_norm: float,
    buckets: Sequence[tuple[Callable[[torch.nn.Parameter], bool], Any]],
) -> float:
    """:func:`clip_grad_norm` where a parameter for which a bucket's predicate holds (the first
    that does) is a slice held by the ranks of that bucket's group (its squared norm summed
    over the group) and the rest are replicated (counted once)."""
    sums = [torch.zeros((), dtype=torch.float32) for _ in buckets]
    replicated = torch.zeros((), dtype=torch.float32)
    grads = [(p, p.grad) for p in params if p.grad is not None]  # as clip_grad_norm_, one without a gradient is skipped
    for p, g in grads:
        sq = g.detach().float().pow(2).sum()
        index = next((i for i, (is_shard, _) in enumerate(buckets) if is_shard(p)), None)
        if index is None:
            replicated += sq
        else:
            sums[index] += sq
    for total_of_bucket, (_, group) in zip(sums, buckets):
        dist.all_reduce(total_of_bucket, op=dist.ReduceOp.SUM, group=group)
    total = float((sum(sums, torch.zeros((), dtype=torch.float32)) + replicated).sqrt())
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for _, g in grads:
            g.detach().mul_(coef)
    return total


def barrier() -> None:
    """Wait for every rank of the default group (nothing in a single process)."""
    if world_size() > 1:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank of the default group (``obj`` itself in a single process)."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
